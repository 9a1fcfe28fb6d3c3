"""The estimator against the memory meter: for each architecture x policy x what trains (all
parameters, or LoRA adapters on frozen weights) x batch size, the estimated peak (from the config,
on fake tensors) and the peak measured on a real step, and the error. The same script runs on a GPU, where the measured side is the CUDA allocator's peak.

    python bench/estimate_accuracy.py                 # small configs, a few minutes on 2 CPU cores
    python bench/estimate_accuracy.py --hidden 512 --seq 256
    python bench/estimate_accuracy.py --checkpoints   # a 125M Llama saved in fp32 and in bf16, batch 2 x 512

``--fsdp``: the FSDP section - the estimate against the meter on 2 gloo ranks (a tiny Llama: 4 blocks,
vocabulary 4,000; full fine-tune and LoRA, checkpointing, the chunked loss, 128-512 tokens), and the plan
of a Llama-3-70B config (from config.json alone) at 8 x 80 GiB and 4,096, 8,192 and 32,768 tokens with the
per-block arithmetic beside it. Written to bench/results/estimate_accuracy_fsdp.json.

``--checkpoints``: the rows users ask about - a Llama-style model of 125M parameters (hidden 768,
12 layers, vocabulary 32,000) saved with ``save_pretrained`` in fp32 and in bf16 and loaded the
default way (``dtype="auto"``: the bf16 one comes back bf16), full fine-tuning and LoRA, fp32 master
weights and pure bf16 (``weights:bf16``), and mixture-of-experts models of 139M and 151M parameters
(a Mixtral and a Qwen2-MoE: hidden 512, 8 layers, 8 experts, 2 per token, vocabulary 32,000), run
with Transformers' default ``grouped_mm`` experts. Written to bench/results/estimate_accuracy_checkpoints.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from _common import machine

from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model
from hf_memstack.planning.estimate import peft_config_from

POLICIES = [
    "fp32",
    "bf16",
    "bf16+ckpt",
    "bf16+ckpt:2",
    # the rungs beyond the blocks (the chunked loss only where there are logits: causal LMs)
    "bf16+loss:chunked",
    "bf16+ckpt:selective",
    "bf16+ckpt+loss:chunked+optim:8bit+optim:in_backward",
]
TRAINABLE = ["all", "lora"]  # lora: r=8 on every linear layer but the head (hf_memstack.planning.estimate.DEFAULT_LORA)


def configs(hidden: int, layers: int, vocab: int) -> dict:
    from transformers import BertConfig, GPT2Config, LlamaConfig

    heads = max(1, hidden // 64)
    return {
        "llama": (
            LlamaConfig(
                hidden_size=hidden,
                intermediate_size=hidden * 2,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2),
                vocab_size=vocab,
                bos_token_id=1,
                eos_token_id=2,
            ),
            "causal-lm",
        ),
        "gpt2": (
            GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, bos_token_id=1, eos_token_id=2),
            "causal-lm",
        ),
        "bert": (
            BertConfig(
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=hidden * 4,
                vocab_size=vocab,
                num_labels=4,
            ),
            "classification",
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--checkpoints", action="store_true", help="the 125M-parameter checkpoint rows instead (see above)")
    ap.add_argument(
        "--cases",
        default=None,
        help="--checkpoints: the CHECKPOINT_CASES indices to run (e.g. 1,3), merged into the file",
    )
    ap.add_argument("--fsdp", action="store_true", help="the FSDP section instead (see above)")
    args = ap.parse_args()
    if args.fsdp:
        fsdp_section(Path(args.out or Path(__file__).parent / "results" / "estimate_accuracy_fsdp.json"))
        return
    if args.checkpoints:
        checkpoint_rows(
            Path(args.out or Path(__file__).parent / "results" / "estimate_accuracy_checkpoints.json"),
            cases=[int(i) for i in args.cases.split(",")] if args.cases else None,
        )
        return
    args.out = args.out or str(Path(__file__).parent / "results" / "estimate_accuracy.json")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, (cfg, task) in configs(args.hidden, args.layers, args.vocab).items():
            cfg.save_pretrained(Path(tmp) / arch)  # the estimator reads a local directory, as a user passes one
            auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
            for trainable in TRAINABLE:
                for policy in POLICIES:
                    if "loss:chunked" in policy and task != "causal-lm":
                        continue
                    for b in map(int, args.batches.split(",")):
                        est = estimate_memory(
                            Path(tmp) / arch, policy, batch_size=b, seq_len=args.seq, task=task, trainable=trainable
                        )
                        real = _measured(auto, cfg, task, policy, trainable, b, args, device)
                        rows.append(
                            {
                                "arch": arch,
                                "trainable": trainable,
                                "policy": policy,
                                "batch": b,
                                "estimate": est.peak_bytes,
                                "measured": real.peak_bytes,
                                "error": est.peak_bytes / real.peak_bytes - 1,
                            }
                        )
                        print(
                            f"{arch:6s} {trainable:4s} {policy:30s} b={b:<3d} estimate {est.peak_bytes / 2**20:8.1f} MiB  measured "
                            f"{real.peak_bytes / 2**20:8.1f} MiB  error {rows[-1]['error'] * 100:+.1f}%",
                            flush=True,
                        )
    for trainable in TRAINABLE:
        sub = [r for r in rows if r["trainable"] == trainable]
        print(
            f"trainable={trainable}: {len(sub)} cells, worst |error| {max(abs(r['error']) for r in sub) * 100:.1f}%, "
            f"within ±10%: {sum(abs(r['error']) <= 0.10 for r in sub)}/{len(sub)}"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nmachine: {machine()}; hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq}")
    print(
        f"{len(rows)} cells; worst |error| {worst * 100:.1f}%; within ±10%: {sum(abs(r['error']) <= 0.10 for r in rows)}/{len(rows)}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=2))


def _measured(auto, cfg, task, policy, trainable, b, args, device):
    """The meter's peak on a real step of the same model (random weights), LoRA adapters added when asked."""
    torch.manual_seed(0)
    model = auto.from_config(cfg).to(device)
    peft_config = peft_config_from(trainable)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    model = prepare_model(model.train(), policy)
    opt = make_optimizer(model, lr=1e-5)  # the policy's optimizer (AdamW; 8-bit / in the backward when it says so)
    ids = torch.randint(3, args.vocab, (b, args.seq), device=device)
    labels = ids if task == "causal-lm" else torch.zeros(b, dtype=torch.long, device=device)
    return measure_step(model, {"input_ids": ids, "labels": labels}, opt, timed=False)


# (model, saved dtype, policy, what trains) at batch 2 x 512: the rows first - fp32 and bf16
# weights, full and LoRA, pure bf16 - then the mixtures of experts.
CHECKPOINT_CASES = [
    ("llama", "fp32", "bf16", "all"),
    ("llama", "bf16", "bf16", "all"),
    ("llama", "fp32", "bf16+ckpt", "lora"),
    ("llama", "bf16", "bf16+ckpt", "lora"),
    ("llama", "bf16", "bf16+ckpt+weights:bf16", "all"),
    ("llama", "bf16", "bf16+ckpt", "all"),
    ("llama", "fp32", "bf16+weights:bf16", "all"),
    ("mixtral", "bf16", "bf16+ckpt", "lora"),
    ("mixtral", "bf16", "bf16", "all"),
    ("qwen2-moe", "bf16", "bf16+ckpt", "lora"),
    ("qwen2-moe", "bf16", "bf16+ckpt+weights:bf16", "all"),
]


def checkpoint_config(arch: str):
    """The model of a checkpoint row: the 125M Llama, or a 139M Mixtral / 151M Qwen2-MoE."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig

    ids = {"vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "llama":
        return LlamaConfig(
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            **ids,
        )
    moe = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, **ids}
    if arch == "mixtral":
        return MixtralConfig(intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2, **moe)
    return Qwen2MoeConfig(
        intermediate_size=1024,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
        **moe,
    )


def checkpoint_rows(out: Path, batch: int = 2, seq: int = 512, cases: list[int] | None = None) -> None:
    """The rows of ``CHECKPOINT_CASES`` (those at ``cases``' indices, when given), merged into ``out``:
    rows measured before for other cases are kept, so a slow machine can add them one run at a time."""
    from transformers import AutoModelForCausalLM

    wanted = [CHECKPOINT_CASES[i] for i in (cases if cases is not None else range(len(CHECKPOINT_CASES)))]
    old = json.loads(out.read_text()) if out.exists() else {}
    same = (old.get("batch"), old.get("seq")) == (batch, seq)

    def case(r: dict) -> tuple[str, str, str, str]:
        return (r.get("arch", "llama"), r["saved"], r["policy"], r["trainable"])

    rows = [r for r in old.get("rows", []) if same and case(r) not in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        for arch, saved in sorted({(a, s) for a, s, _, _ in wanted}):
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(checkpoint_config(arch)).to(
                getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[saved])
            ).save_pretrained(Path(tmp) / f"{arch}-{saved}")
        for arch, saved, policy, trainable in wanted:
            start = time.perf_counter()
            path = Path(tmp) / f"{arch}-{saved}"
            est = estimate_memory(path, policy, batch_size=batch, seq_len=seq, trainable=trainable)
            model = AutoModelForCausalLM.from_pretrained(path)  # dtype="auto", as users load
            loaded = str(next(model.parameters()).dtype).removeprefix("torch.")
            if trainable != "all":
                from peft import get_peft_model

                model = get_peft_model(model, peft_config_from(trainable))
            model = prepare_model(model.train(), policy)
            ids = torch.randint(3, 32000, (batch, seq), generator=torch.Generator().manual_seed(0))
            real = measure_step(
                model, {"input_ids": ids, "labels": ids.clone()}, make_optimizer(model, lr=1e-5), timed=False
            )
            fields = {k: (getattr(est, k), getattr(real, k)) for k in ("parameters", "gradients", "optimizer")}
            rows.append(
                {
                    "arch": arch,
                    "saved": saved,
                    "loaded": loaded,
                    "policy": policy,
                    "trainable": trainable,
                    "estimate": est.peak_bytes,
                    "measured": real.peak_bytes,
                    "error": est.peak_bytes / real.peak_bytes - 1,
                    "fields": fields,
                    "total_parameters": est.total_parameters,
                    "notes": list(est.notes),
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            print(
                f"{arch} saved {saved} (loaded {loaded}) {trainable:4s} {policy:26s} estimate {est.peak_bytes / 2**20:8.1f} MiB  "
                f"measured {real.peak_bytes / 2**20:8.1f} MiB  error {rows[-1]['error'] * 100:+.2f}%  states equal: "
                f"{all(a == b for a, b in fields.values())}",
                flush=True,
            )
            # After every row: a long run stopped early keeps what it measured.
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"machine": machine(), "batch": batch, "seq": seq, "rows": rows}, indent=2))
    if rows:
        print(
            f"\nmachine: {machine()}; batch {batch} x {seq}; worst |error| "
            f"{max(abs(r['error']) for r in rows) * 100:.2f}% over {len(rows)} rows"
        )


# --- FSDP: the estimate against the meter on 2 gloo ranks, and a 70B plan with its per-block arithmetic ---

FSDP_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4000,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
FSDP_CELLS = [
    ("fp32+fsdp", "all", 320),
    ("fp32+ckpt+fsdp", "all", 192),
    ("fp32+fsdp+loss:chunked", "lora", 128),
    ("fp32+ckpt+fsdp+loss:chunked", "lora", 512),
    ("bf16+ckpt+fsdp", "all", 256),
    ("bf16+fsdp", "all", 192),
]
FSDP_FIELDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "peak_bytes")
LLAMA_3_70B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def _fsdp_cells(rank: int, world: int) -> list:
    """Each cell measured on this rank (MemTracker through measure_step) and, on rank 0, estimated."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    out = []
    for policy, trainable, seq in FSDP_CELLS:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**FSDP_SHAPE)).train()
        if trainable == "lora":
            model = get_peft_model(model, peft_config_from("lora"))
        model = prepare_model(model, policy)
        ids = torch.randint(3, FSDP_SHAPE["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(rank))
        real = measure_step(
            model, {"input_ids": ids, "labels": ids.clone()}, make_optimizer(model, lr=1e-4), timed=False
        )
        est = None
        if rank == 0:
            e = estimate_memory(
                LlamaConfig(**FSDP_SHAPE), policy, batch_size=2, seq_len=seq, world_size=world, trainable=trainable
            )
            est = {k: getattr(e, k) for k in FSDP_FIELDS}
        out.append({"real": {k: getattr(real, k) for k in FSDP_FIELDS}, "est": est})
    return out


def _plan_70b(seq: int, tmp: Path) -> dict:
    """The 70B plan at 8 x 80 GiB and ``seq`` tokens, with the arithmetic of its activations beside it."""
    from hf_memstack import plan_policy

    (tmp / "config.json").write_text(json.dumps(LLAMA_3_70B))
    start = time.perf_counter()
    plan = plan_policy(str(tmp), budget="80GiB", seq_len=seq, world_size=8, device="cuda")
    row: dict = {"seq": seq, "seconds": round(time.perf_counter() - start, 1), "policy": None}
    e = plan.estimate
    if e is None:
        return row | {"shortfall_gib": plan.shortfall_bytes / 2**30}
    ck = plan.policy.checkpointing
    checkpointed = {"full": e.blocks, "every_n": -(-e.blocks // ck.every_n)}.get(ck.mode, 0)
    return row | {
        "policy": plan.policy.to_string(),
        "peak_gib": e.peak_bytes / 2**30,
        "per_block_activation_gib": e.activations_per_block / 2**30,
        "blocks": e.blocks,
        "blocks_checkpointed": checkpointed,
        "activations_gib": e.activations / 2**30,
        "per_block_x_blocks_gib": e.activations_per_block * e.blocks / 2**30,
        "resident_params_gib": e.parameters / 2**30,
        "gradients_gib": e.gradients / 2**30,
        "optimizer_gib": e.optimizer / 2**30,
    }


def fsdp_section(out: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from dist_utils import run_ranks

    rows = []
    for (policy, trainable, seq), cell in zip(FSDP_CELLS, run_ranks(_fsdp_cells, timeout=1200)[0], strict=True):
        real, est = cell["real"], cell["est"]
        err = {k: (est[k] / real[k] - 1 if real[k] else None) for k in FSDP_FIELDS}
        rows.append({"policy": policy, "trainable": trainable, "seq": seq, "real": real, "est": est, "error": err})
        print(
            f"{policy:30s} {trainable:4s} seq {seq:3d}: peak {est['peak_bytes'] / 2**20:7.2f} MiB vs "
            f"{real['peak_bytes'] / 2**20:7.2f} ({err['peak_bytes'] * 100:+.1f}%)"
        )
    plans = []
    for seq in (4096, 8192, 32768):
        with tempfile.TemporaryDirectory() as tmp:
            plans.append(_plan_70b(seq, Path(tmp)))
        print(plans[-1])
    out.write_text(json.dumps({"machine": machine(), "fsdp_2_ranks": rows, "plan_70b_8x80gib": plans}, indent=2))


if __name__ == "__main__":
    main()
