"""The estimator against the memory meter: for each architecture x policy x what trains (all
parameters, or LoRA adapters on frozen weights) x batch size, the estimated peak (from the config,
on fake tensors) and the peak measured on a real step, and the error. The same script runs on a GPU, where the measured side is the CUDA allocator's peak.

    python bench/estimate_accuracy.py                 # small configs, a few minutes on 2 CPU cores
    python bench/estimate_accuracy.py --hidden 512 --seq 256
    python bench/estimate_accuracy.py --checkpoints   # a 125M Llama saved in fp32 and in bf16, batch 2 x 512
    python bench/estimate_accuracy.py --loops         # the kept-outputs and dropped-outputs loops vs MemTracker
    python bench/estimate_accuracy.py --orders        # PEFT / a 4-bit load before or after prepare_model vs MemTracker

``--fsdp``: the FSDP section - the estimate against the meter on 2 gloo ranks (a tiny Llama: 4 blocks,
vocabulary 4,000; fp32 and bf16, full fine-tune and LoRA, checkpointing, the chunked loss, batch 1-2 x
128-512 tokens; under bf16 also a tiny Mixtral and Qwen3-MoE, 4 experts, 2 per token, full and LoRA
on the experts and routers, with and without checkpointing; each rank's row), and the plan of a Llama-3-70B config (from config.json alone) at 8 x 80 GiB and 4,096,
8,192 and 32,768 tokens with the per-block arithmetic beside it. Written to bench/results/estimate_accuracy_fsdp.json.

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
TRAINABLE = [
    "all",
    "lora",
]  # lora: r=8 on every linear layer but the head (hf_memstack.planning.estimate.estimator.DEFAULT_LORA)


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
    ap.add_argument(
        "--loops", action="store_true", help="the kept-outputs and dropped-outputs loop rows (see loop_rows)"
    )
    ap.add_argument(
        "--orders", action="store_true", help="PEFT / 4-bit load before and after prepare_model vs MemTracker"
    )
    ap.add_argument("--fsdp", action="store_true", help="the FSDP section instead (see above)")
    args = ap.parse_args()
    if args.fsdp:
        fsdp_section(Path(args.out or Path(__file__).parent / "results" / "estimate_accuracy_fsdp.json"))
        return
    if args.loops:
        loop_rows(Path(args.out or Path(__file__).parent / "results" / "estimate_accuracy_loops.json"))
        return
    if args.orders:
        order_rows(Path(args.out or Path(__file__).parent / "results" / "estimate_accuracy_orders.json"))
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


# --- The loop style (issue 39 item 3): a loop that keeps `outputs` through the backward ----------------


def loop_rows(
    out: Path, *, hidden: int = 256, layers: int = 2, vocab: int = 4000, batch: int = 4, seq: int = 128
) -> None:
    """Two rows, "dropped-outputs loop" (``loss = model(**batch).loss; loss.backward()``, as Trainer and
    the recipe run it) and "kept-outputs loop" (``outputs = model(**batch); outputs.loss.backward()``,
    Transformers' docs): a Llama saved in bf16 and loaded the default way, ``bf16+ckpt``, full fine-tune.
    For each, PyTorch's own MemTracker on the third step of the hand-written loop (AdamW's state
    existing; the previous step's kept outputs given to it with ``track_external``) against
    ``estimate_memory(keep_outputs=)``, ``measure_step(keep_outputs=)``, and - for the kept loop - the
    estimate of the dropped loop (what was reported before ``keep_outputs``). On a GPU also the CUDA
    allocator's peak of the same hand-written step (``max_memory_allocated``). Written to ``out``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        bos_token_id=1,
        eos_token_id=2,
    )
    ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    data = {"input_ids": ids, "labels": ids.clone()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp)

        def prepared():
            model = AutoModelForCausalLM.from_pretrained(tmp).to(device).train()  # bf16, as saved
            return prepare_model(model, "bf16+ckpt")

        for keep in (False, True):
            hand = _hand_loop_peaks(prepared(), data, keep_outputs=keep)
            est = estimate_memory(tmp, "bf16+ckpt", batch_size=batch, seq_len=seq, device=device, keep_outputs=keep)
            model = prepared()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            meter = measure_step(model, data, opt, timed=False, keep_outputs=keep)
            row = {
                "loop": "kept-outputs loop" if keep else "dropped-outputs loop",
                "memtracker": hand["memtracker"],
                "estimate": est.peak_bytes,
                "estimate_error": est.peak_bytes / hand["memtracker"] - 1,
                "measure_step": meter.peak_bytes,
                "measure_step_loop": meter.loop,
                "measure_step_error": meter.peak_bytes / hand["memtracker"] - 1,
                "kept_outputs_bytes": est.kept_outputs_bytes,
            }
            if keep:  # what the estimate said of this loop before it could be told about it
                dropped = estimate_memory(tmp, "bf16+ckpt", batch_size=batch, seq_len=seq, device=device)
                row["estimate_of_dropped_loop_error"] = dropped.peak_bytes / hand["memtracker"] - 1
            if "cuda_max_allocated" in hand:
                row["cuda_max_allocated"] = hand["cuda_max_allocated"]
                row["estimate_error_vs_cuda"] = est.peak_bytes / hand["cuda_max_allocated"] - 1
            rows.append(row)
            print(
                f"{row['loop']:22s} MemTracker {row['memtracker']:>12,d} B  estimate {row['estimate']:>12,d} B "
                f"({row['estimate_error'] * 100:+.2f}%)  measure_step [{meter.loop}] {row['measure_step']:>12,d} B "
                f"({row['measure_step_error'] * 100:+.2f}%)"
                + (f"  estimate assuming dropped: {row['estimate_of_dropped_loop_error'] * 100:+.2f}%" if keep else ""),
                flush=True,
            )
    job = {"hidden": hidden, "layers": layers, "vocab": vocab, "batch": batch, "seq": seq, "policy": "bf16+ckpt"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "saved": "bf16", **job, "rows": rows}, indent=2))


def _hand_loop_peaks(model, data: dict, *, keep_outputs: bool, steps: int = 3) -> dict:
    """The last of ``steps`` steps of the hand-written loop under PyTorch's MemTracker (and, on CUDA,
    the allocator's peak of that step, from the bytes alive before it)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loop = {"outputs": None}

    def step() -> None:
        if keep_outputs:
            loop["outputs"] = model(**data)  # the previous outputs live until this rebinding
            loop["outputs"].loss.backward()
        else:
            loss = model(**data).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(steps - 1):
        step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    if loop["outputs"] is not None:
        tracker.track_external(*(t for t in loop["outputs"].values() if torch.is_tensor(t)))
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    result = {"memtracker": sum(int(v) for dev in peak.values() for k, v in dev.items() if str(k) == "Total")}
    if cuda:
        torch.cuda.synchronize()
        result["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return result


# ---------------------------------------------------------------------------------------------------
# Orders: PEFT (or a 4-bit load) before or after prepare_model, against PyTorch's own MemTracker on a
# steady-state step (the third: the optimizer's state exists). Self-contained: callable as
# order_rows() from another script, or `python bench/estimate_accuracy.py --orders`.

ORDER_CASES = [
    ("bf16 checkpoint, PEFT after prepare", False, "prepare-peft"),
    ("bf16 checkpoint, PEFT before prepare", False, "peft-prepare"),
    ("QLoRA (bnb 4-bit), prepare then PEFT", True, "prepare-peft"),
    ("QLoRA (bnb 4-bit), PEFT then prepare", True, "peft-prepare"),
]


class _NoHook:
    def remove(self) -> None:
        pass


def memtracker_step(model, batch, optimizer, steps: int = 3) -> dict[str, int]:
    """PyTorch's MemTracker over the last of ``steps`` training steps (forward, ``loss.backward()``,
    ``step()``, ``zero_grad()``; the outputs dropped after ``.loss``): the categories at its peak.
    Plain MemTracker, but for two things it cannot do alone: frozen parameters get no gradient hook
    (PyTorch refuses one), and a bitsandbytes weight's quantization state (tensors beside it, no
    module's parameter or buffer) is given to it, counted with the parameters."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            for p in module.parameters():
                if not p.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def step() -> None:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    for _ in range(steps - 1):
        step()
    states = []
    for p in model.parameters():
        q = p.__dict__.get("quant_state")
        while q is not None and hasattr(q, "absmax"):
            states += [t for t in (q.absmax, q.code, getattr(q, "offset", None)) if torch.is_tensor(t)]
            q = getattr(q, "state2", None)
    tracker = Tracker()
    tracker.track_external(model, optimizer, *states)
    with tracker:
        step()
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {
        "peak": snap[_TOTAL_KEY],
        "parameters": snap[_MemRefType.PARAM] + snap[_MemRefType.BUFFER] + snap[_MemRefType.OTH],
        "gradients": snap[_MemRefType.GRAD],
        "optimizer": snap[_MemRefType.OPT],
    }


def order_model(folder, four_bit: bool, order: str, policy: str = "bf16+ckpt", lora=None):
    """The checkpoint in ``folder`` loaded the default way (``dtype="auto"``; 4-bit with bitsandbytes when
    ``four_bit``), then ``prepare_model`` and ``get_peft_model`` in ``order``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {}
    if four_bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    lora = lora or LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    if order == "prepare-peft":
        return get_peft_model(prepare_model(model, policy), lora)
    model = get_peft_model(model, lora)
    prepare_model(model, policy)
    return model


def order_rows(
    out: Path | None = None, *, hidden: int = 256, layers: int = 2, vocab: int = 4096, batch: int = 4, seq: int = 128
) -> list[dict]:
    """The four order rows: estimate_memory(model) on the prepared model vs MemTracker on its third step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=vocab,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)  # a bf16 checkpoint, as real ones are
        ids = torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        data = {"input_ids": ids, "labels": ids.clone()}
        for name, four_bit, order in ORDER_CASES:
            model = order_model(tmp, four_bit, order)
            est = estimate_memory(model, "bf16+ckpt", batch_size=batch, seq_len=seq, device="cpu")
            dtypes = sorted({(str(p.dtype), p.requires_grad) for p in model.parameters()})
            # A 16-bit checkpoint's estimate from its folder too (what a plan reads before anything is loaded).
            from_folder = (
                None
                if four_bit
                else estimate_memory(
                    tmp,
                    "bf16+ckpt",
                    batch_size=batch,
                    seq_len=seq,
                    device="cpu",
                    trainable=model.peft_config["default"],
                ).peak_bytes
            )
            real = memtracker_step(model, data, make_optimizer(model, lr=1e-4))
            row = {
                "case": name,
                "estimate": est.peak_bytes,
                "memtracker": real["peak"],
                "error": est.peak_bytes / real["peak"] - 1,
                "estimate_from_folder": from_folder,
                "fields": {k: [getattr(est, k), real[k]] for k in ("parameters", "gradients", "optimizer")},
                "weights_dtype": est.weights_dtype,
                "dtypes": [f"{d} {'trainable' if t else 'frozen'}" for d, t in dtypes],
            }
            rows.append(row)
            print(
                f"{name:40s} estimate {est.peak_bytes / 2**20:8.3f} MiB  MemTracker {real['peak'] / 2**20:8.3f} MiB  "
                f"error {row['error'] * 100:+.2f}%  from the folder {'-' if from_folder is None else f'{from_folder / 2**20:.3f} MiB'}  "
                f"parameters {row['fields']['parameters']}  "
                f"states equal: {all(a == b for a, b in row['fields'].values())}",
                flush=True,
            )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine(), "batch": batch, "seq": seq, "rows": rows}, indent=2))
    return rows


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
FSDP_CELLS = [  # model, policy, what trains, sequence length, batch size
    ("llama", "fp32+fsdp", "all", 320, 2),
    ("llama", "fp32+ckpt+fsdp", "all", 192, 2),
    ("llama", "fp32+fsdp+loss:chunked", "lora", 128, 2),
    ("llama", "fp32+ckpt+fsdp+loss:chunked", "lora", 512, 2),
    ("llama", "bf16+fsdp", "all", 192, 2),
    ("llama", "bf16+ckpt+fsdp", "all", 256, 2),
    ("llama", "bf16+fsdp", "all", 128, 2),
    ("llama", "bf16+ckpt+fsdp", "lora", 128, 2),
    ("llama", "bf16+fsdp+loss:chunked", "lora", 128, 2),
    ("llama", "bf16+ckpt+fsdp+loss:chunked", "all", 512, 1),
    # LoRA (all-linear) on these puts PEFT's ParamWrapper on the experts' grouped weights and the router.
    *(
        (arch, policy, trainable, seq, 2)
        for arch in ("mixtral", "qwen3_moe")
        for policy, trainable, seq in (
            ("bf16+fsdp", "all", 128),
            ("bf16+ckpt+fsdp", "all", 256),
            ("bf16+fsdp", "lora", 128),
            ("bf16+ckpt+fsdp", "lora", 256),
        )
    ),
]
# The mixtures of experts: the Llama's depth, heads and vocabulary, 128 wide, 4 experts of 256, 2 per token.
FSDP_MOE = {"hidden_size": 128, "intermediate_size": 256, "num_experts_per_tok": 2}
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


def _fsdp_config(arch: str):
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    moe = {**FSDP_SHAPE, **FSDP_MOE}
    if arch == "mixtral":
        return MixtralConfig(**moe, num_local_experts=4)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**moe, num_experts=4, moe_intermediate_size=256, head_dim=32)
    return LlamaConfig(**FSDP_SHAPE)


def _fsdp_cells(rank: int, world: int, cells: list) -> list:
    """Each cell measured on this rank (MemTracker through measure_step) and, on rank 0, estimated."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for arch, policy, trainable, seq, batch in cells:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_fsdp_config(arch)).train()
        if trainable == "lora":
            model = get_peft_model(model, peft_config_from("lora"))
        model = prepare_model(model, policy)
        ids = torch.randint(3, FSDP_SHAPE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(rank))
        real = measure_step(
            model, {"input_ids": ids, "labels": ids.clone()}, make_optimizer(model, lr=1e-4), timed=False
        )
        est = None
        if rank == 0:
            e = estimate_memory(
                _fsdp_config(arch), policy, batch_size=batch, seq_len=seq, world_size=world, trainable=trainable
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


def fsdp_section(out: Path, cells: list | None = None) -> None:
    """The FSDP rows (``cells``: those of FSDP_CELLS, all by default), each rank's against the estimate."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from dist_utils import run_ranks

    cells = FSDP_CELLS if cells is None else cells
    ranks = run_ranks(_fsdp_cells, cells, timeout=1800)
    rows = []
    for rank, measured in enumerate(ranks):
        for (arch, policy, trainable, seq, batch), cell, first in zip(cells, measured, ranks[0], strict=True):
            real, est = cell["real"], first["est"]  # estimated on rank 0: every rank's step is alike
            err = {k: (est[k] / real[k] - 1 if real[k] else None) for k in FSDP_FIELDS}
            rows.append(
                {
                    "model": arch,
                    "policy": policy,
                    "trainable": trainable,
                    "seq": seq,
                    "batch": batch,
                    "rank": rank,
                    "real": real,
                    "est": est,
                    "error": err,
                }
            )
            print(
                f"{arch:9s} {policy:30s} {trainable:4s} {batch} x {seq:3d} rank {rank}: peak "
                f"{est['peak_bytes'] / 2**20:7.2f} MiB vs {real['peak_bytes'] / 2**20:7.2f} ({err['peak_bytes'] * 100:+.2f}%)"
            )
    plans = []
    for seq in (4096, 8192, 32768):
        with tempfile.TemporaryDirectory() as tmp:
            plans.append(_plan_70b(seq, Path(tmp)))
        print(plans[-1])
    out.write_text(json.dumps({"machine": machine(), "fsdp_2_ranks": rows, "plan_70b_8x80gib": plans}, indent=2))


if __name__ == "__main__":
    main()
