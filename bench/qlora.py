"""4-bit base weights (QLoRA) against 16-bit LoRA, side by side in one run.

    python bench/qlora.py                  # bytes, peaks, step times and the estimator, ~150M Llama
    python bench/qlora.py --part curves    # the recipe's default job, LoRA r=16 with and without quant:nf4, two seeds
    python bench/qlora.py --part plan      # the planner's answer for 7B- and 70B-shaped configs (LoRA r=16)

``memory``: a Llama-style model (8 layers, hidden 1024, vocabulary 32k: 153M parameters) saved in
bf16, loaded fresh for each variant - LoRA r=16 on every linear layer but the head, bf16 autocast
and full checkpointing, the same batch - with the frozen base (a) 16-bit (plain LoRA), (b) 4-bit
by ``quant:nf4`` (torchao), (c) the same with PEFT's fp32 upcast (``quant:nf4:upcast``), (d) loaded
4-bit by bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True)``), plus (e) the library's usual
fp32 load with ``quant:nf4``. Per variant: the quantized layers' bytes and bits per weight, the
meter's peak and parameters, the step time (interleaved rounds, median), the first losses, and the
estimator's peak against the meter's. Writes bench/results/qlora*.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    FINETUNE,
    LLAMA_SHAPES,
    ROOT,
    last_quarter_loss,
    machine,
    median,
    recipe_run,
    reference_batch,
    reference_model,
    run_dir,
)

from hf_memstack import estimate_memory, measure_step, plan_policy, prepare_model, record_of
from hf_memstack.transforms.precision.apply import cpu_has_native_bf16

RESULTS = ROOT / "bench" / "results"
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
# name: (how the base is loaded, policy)
VARIANTS = {
    "lora (16-bit base)": ("bf16", "bf16+ckpt"),
    "qlora quant:nf4": ("bf16", "bf16+ckpt+quant:nf4"),
    "qlora quant:nf4:upcast": ("bf16", "bf16+ckpt+quant:nf4:upcast"),
    "qlora bitsandbytes": ("bnb", "bf16+ckpt"),
    "qlora quant:nf4, fp32 load": ("fp32", "bf16+ckpt+quant:nf4"),
}


def _load(saved: Path, how: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict[str, Any] = {"dtype": torch.float32 if how == "fp32" else torch.bfloat16}
    if how == "bnb":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    model = AutoModelForCausalLM.from_pretrained(saved, **kwargs).train()
    return get_peft_model(model, LoraConfig(**LORA))


def _quantized_layer_bytes(model: torch.nn.Module) -> tuple[int, int, int]:
    """(bytes now, bytes in bf16, weights) of the blocks' linear layers, 4-bit or not."""
    from hf_memstack import tensor_bytes

    record = record_of(model)
    if record.quant.layers:
        q = record.quant
        return q.bytes_4bit, 2 * q.weights, q.weights
    layers = [
        m for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".layers." in n and "lora_" not in n
    ]
    weights = sum(m.weight.numel() for m in layers)
    return sum(tensor_bytes(m.weight) for m in layers), 2 * weights, weights


def _train_step(model: torch.nn.Module, optimizer: Any, batch: dict) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def memory(args: argparse.Namespace) -> dict:
    batch = reference_batch(args.batch, args.seq)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "model"
        reference_model(args.layers, args.hidden).to(torch.bfloat16).save_pretrained(saved)
        models, optimizers = {}, {}
        for name, (how, policy) in [
            (n, v) for n, v in VARIANTS.items() if args.variants == "all" or n in args.variants.split(",")
        ]:
            torch.manual_seed(0)
            model = prepare_model(_load(saved, how), policy)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            now, bf16, weights = _quantized_layer_bytes(model)
            m = measure_step(model, batch, optimizer, timed=False)  # a warm-up step, then the measured one
            est = estimate_memory(saved, policy, batch_size=args.batch, seq_len=args.seq, trainable=LORA)
            rows[name] = {
                "load": how,
                "policy": policy,
                "layer_bytes": now,
                "layer_bytes_bf16": bf16,
                "bits_per_weight": 8 * now / weights,
                "meter_peak": m.peak_bytes,
                "meter_parameters": m.parameters,
                "meter_activations": m.saved_activations,
                "estimate_peak": est.peak_bytes,
                "estimate_parameters": est.parameters,
                "step_s": [],
                "losses": [],
            }
            models[name], optimizers[name] = model, optimizer
            print(f"  {name}: {m.summary()}", flush=True)
        for _ in range(args.rounds):  # interleaved: each round steps every variant once, on the same batch
            for name, model in models.items():
                start = time.perf_counter()
                rows[name]["losses"].append(_train_step(model, optimizers[name], batch))
                rows[name]["step_s"].append(time.perf_counter() - start)
    return rows


def _print_memory(rows: dict) -> None:
    base = rows["lora (16-bit base)"]
    print(
        "\n| base weights | layers' bytes (vs bf16) | bits/weight | step peak MiB (vs LoRA) | step s, median (vs LoRA) | "
        "loss after the rounds | estimate / meter |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        step, base_step = median(r["step_s"]), median(base["step_s"])
        print(
            f"| {name} | {r['layer_bytes'] / 2**20:.1f} MiB ({r['layer_bytes'] / r['layer_bytes_bf16']:.3f}) | {r['bits_per_weight']:.2f} | "
            f"{r['meter_peak'] / 2**20:.0f} ({r['meter_peak'] / base['meter_peak']:.2f}) | {step:.2f} ({step / base_step:.2f}) | "
            f"{r['losses'][-1]:.4f} | {r['estimate_peak'] / r['meter_peak']:.3f} |"
        )


def curves(args: argparse.Namespace) -> dict:
    """The recipe's default job (pretrained MiniLM-L6, topic classification), LoRA r=16, with and without 4-bit base weights."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in (f"{args.curve_precision}+ckpt", f"{args.curve_precision}+ckpt+quant:nf4"):
            for seed in range(args.seeds):
                runs.append(
                    recipe_run(FINETUNE, policy, seed, args.steps, run_dir(tmp, policy, seed), "--lora-r", "16")
                )
                print(f"  {policy} seed {seed}: {runs[-1]['seconds']:.0f} s, final {runs[-1]['final']}", flush=True)

    print("\n| base weights | seed | train loss, last quarter | final eval loss | final accuracy | s/run |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['policy']} | {r['seed']} | {last_quarter_loss(r):.4f} | {r['final'].get('eval_loss', float('nan')):.4f} | "
            f"{r['final'].get('eval_accuracy', float('nan')):.3f} | {r['seconds']:.0f} |"
        )
    return {"steps": args.steps, "runs": runs}


CONFIGS = {"7b": (LLAMA_SHAPES["llama-2-7b"], "16GiB"), "70b": (LLAMA_SHAPES["llama-3-70b"], "48GiB")}


def plan(args: argparse.Namespace) -> dict:
    from transformers import LlamaConfig

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            shape, budget = CONFIGS[name]
            # Saved as the real checkpoints are, in bf16 (Transformers 5 loads them so): the plan counts bf16 weights.
            LlamaConfig(
                **shape, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, dtype="bfloat16"
            ).save_pretrained(Path(tmp) / name)
            start = time.perf_counter()
            p = plan_policy(
                Path(tmp) / name,
                budget=budget,
                seq_len=args.plan_seq,
                batch_size=args.plan_batch,
                device="cuda",
                trainable={"r": 16, "lora_alpha": 32},
            )
            print(
                f"\n{name}-shaped, {budget}, seq {args.plan_seq}, LoRA r=16 ({time.perf_counter() - start:.0f} s):\n{p.table()}",
                flush=True,
            )
            out[name] = {"budget": budget, "seconds": time.perf_counter() - start, **p.as_dict()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["memory", "curves", "plan"], default="memory")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed steps per variant")
    ap.add_argument("--steps", type=int, default=100, help="--part curves: steps per run")
    ap.add_argument("--variants", default="all", help="--part memory: comma-separated variant names (default all)")
    ap.add_argument(
        "--curve-precision",
        default="bf16",
        choices=["bf16", "fp32"],
        help="--part curves: the runs' precision (fp32 on a CPU without native bf16, where bf16 runs ~2x slower)",
    )
    ap.add_argument("--seeds", type=int, default=2, help="--part curves: seeds per policy")
    ap.add_argument("--configs", default="7b,70b", help="--part plan: which shapes")
    ap.add_argument("--plan-seq", type=int, default=2048)
    ap.add_argument("--plan-batch", default="max", help="--part plan: a batch size, or max")
    args = ap.parse_args()
    if args.plan_batch != "max":
        args.plan_batch = int(args.plan_batch)
    cpu = f"{machine()}; native bf16: {'yes' if cpu_has_native_bf16() else 'no (bf16 emulated, ~2x slower)'}"
    print(cpu, flush=True)
    result = {"memory": memory, "curves": curves, "plan": plan}[args.part](args)
    if args.part == "memory":
        _print_memory(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("qlora.json" if args.part == "memory" else f"qlora_{args.part}.json")
    path.write_text(json.dumps({"machine": cpu, "args": vars(args), "result": result}, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
