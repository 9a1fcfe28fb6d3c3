"""The ladder benchmark: step time and peak memory per rung, as ratios against eager fp32, for
hf_memstack's prepare_model and the same rung hand-written in plain PyTorch - measured side by
side in one run - plus full-model vs regional compile time.

    python bench/ladder.py                     # 4-layer Llama h=1024, batch 4, seq 256 (~10 min on 2 CPU cores)
    python bench/ladder.py --layers 2 --hidden 256 --seq 128 --compile-layers 4   # a quick look

Writes bench/results/ladder.json and, with matplotlib installed, bench/results/ladder.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import machine, median, reference_batch, reference_model, timed

from hf_memstack import measure_step, prepare_model, train_step

RUNGS = ["fp32", "bf16", "bf16+ckpt:2", "bf16+ckpt", "bf16+compile", "bf16+compile+ckpt", "bf16+compile:regional+ckpt"]


def hand_prepare(model: torch.nn.Module, rung: str) -> torch.nn.Module:
    """The same rung written by hand with Transformers and PyTorch calls."""
    parts = rung.split("+")
    ckpt = next((p for p in parts if p.startswith("ckpt")), None)
    if ckpt:
        every = int(ckpt.split(":")[1]) if ":" in ckpt else 1
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every)
    if "compile" in parts:
        model.compile()
    elif "compile:regional" in parts:
        for layer in model.model.layers:
            layer.compile()
    return model


def hand_step(model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer, rung: str, device: str) -> float:
    with torch.autocast(device, dtype=torch.bfloat16, enabled=rung.startswith("bf16")):
        loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def run_rung(rung: str, args: argparse.Namespace, device: str) -> dict:
    torch._dynamo.reset()
    batch = reference_batch(args.batch, args.seq, device=device)
    ours = reference_model(args.layers, args.hidden).to(device)
    start = time.perf_counter()
    prepare_model(ours, rung)
    prepare_s = time.perf_counter() - start
    hand = hand_prepare(reference_model(args.layers, args.hidden).to(device), rung)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-5)
    opt_hand = torch.optim.AdamW(hand.parameters(), lr=1e-5)
    step_ours = lambda: train_step(ours, batch, opt_ours)  # noqa: E731
    step_hand = lambda: hand_step(hand, batch, opt_hand, rung, device)  # noqa: E731
    first_ours = timed(step_ours, device)  # includes compile
    first_hand = timed(step_hand, device)
    times_ours, times_hand = [], []
    for i in range(args.steps):
        # Interleaved, and each side goes first half the time: drift and cache effects hit both alike.
        pair = [(times_ours, step_ours), (times_hand, step_hand)]
        for times, step in pair if i % 2 == 0 else pair[::-1]:
            times.append(timed(step, device))
    mem_ours = measure_step(ours, batch, opt_ours, timed=False)
    mem_hand = measure_step(hand, batch, opt_hand, timed=False,
                            step_fn=lambda m, b, o: hand_step(m, b, o, rung, device))
    return {
        "rung": rung, "prepare_s": prepare_s,
        "first_step_s": first_ours, "first_step_hand_s": first_hand,
        "step_s": median(times_ours), "step_hand_s": median(times_hand),
        "peak_bytes": mem_ours.peak_bytes, "peak_hand_bytes": mem_hand.peak_bytes,
        "activation_bytes": mem_ours.saved_activations,
    }


def compile_times(args: argparse.Namespace, device: str) -> dict:
    """First-step time minus a steady step: the compile cost of whole-model vs regional compile."""
    out = {}
    batch = reference_batch(args.batch, args.seq, device=device)
    for mode in ("compile", "compile:regional"):
        torch._dynamo.reset()
        model = prepare_model(reference_model(args.compile_layers, args.hidden).to(device), f"bf16+{mode}")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        first = timed(lambda: train_step(model, batch, opt), device)
        steady = median([timed(lambda: train_step(model, batch, opt), device) for _ in range(2)])
        out[mode] = {"first_step_s": first, "steady_step_s": steady, "compile_s": first - steady,
                     "backend_compile_s": model.memstack.compile.compile_seconds}
    return out


def mfu(step_s: float, args: argparse.Namespace, params: int) -> float | None:
    """Model FLOPs utilisation on a GPU: 6 * params * tokens per step over the device's peak bf16 FLOPs."""
    if not torch.cuda.is_available():
        return None
    peak = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}.get(
        next((k for k in ("H200", "H100", "A100", "L4") if k in torch.cuda.get_device_name(0)), ""), None)
    if peak is None:
        return None
    return 6 * params * args.batch * args.seq / step_s / peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per rung and side (after one warm-up step)")
    ap.add_argument("--compile-layers", type=int, default=8, help="depth of the model for full vs regional compile time (0 skips)")
    ap.add_argument("--rungs", default=",".join(RUNGS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "ladder.json"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for rung in args.rungs.split(","):
        print(f"running {rung} ...", flush=True)
        rows.append(run_rung(rung, args, device))
    compile_cmp = compile_times(args, device) if args.compile_layers else {}
    params = sum(p.numel() for p in reference_model(args.layers, args.hidden).parameters())
    base = next(r for r in rows if r["rung"] == "fp32") if any(r["rung"] == "fp32" for r in rows) else rows[0]
    print(f"\nmachine: {machine()}")
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M params; batch {args.batch}, seq {args.seq}; "
          f"median of {args.steps} steps\n")
    header = "| rung | step s | speed vs fp32 | peak MiB | peak vs fp32 | activations after forward MiB | ours/hand speed | ours/hand peak | prepare ms |"
    if device == "cuda":
        header += " MFU |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        line = (f"| {r['rung']} | {r['step_s']:.3f} | {base['step_s'] / r['step_s']:.2f}x | {r['peak_bytes'] / 2**20:.0f} | "
                f"{r['peak_bytes'] / base['peak_bytes']:.2f} | {r['activation_bytes'] / 2**20:.0f} | "
                f"{r['step_hand_s'] / r['step_s']:.3f} | {r['peak_bytes'] / r['peak_hand_bytes']:.3f} | {r['prepare_s'] * 1000:.0f} |")
        if device == "cuda":
            m = mfu(r["step_s"], args, params)
            line += f" {m * 100:.1f}% |" if m is not None else " n/a |"
        print(line)
    by = {r["rung"]: r for r in rows}
    for ck, no in (("bf16+ckpt", "bf16"), ("bf16+compile+ckpt", "bf16+compile")):
        if ck in by and no in by:
            print(f"\n{ck} vs {no}: activations -{(1 - by[ck]['activation_bytes'] / by[no]['activation_bytes']) * 100:.0f}%, "
                  f"peak -{(1 - by[ck]['peak_bytes'] / by[no]['peak_bytes']) * 100:.0f}%, step time {by[ck]['step_s'] / by[no]['step_s'] - 1:+.0%}")
    if compile_cmp:
        full, reg = compile_cmp["compile"], compile_cmp["compile:regional"]
        print(f"\ncompile time, {args.compile_layers}-layer model (first step minus a steady step): whole model "
              f"{full['compile_s']:.1f} s, regional {reg['compile_s']:.1f} s -> regional/whole = {reg['compile_s'] / full['compile_s']:.2f}; "
              f"steady step whole {full['steady_step_s']:.3f} s, regional {reg['steady_step_s']:.3f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "params": params, "rungs": rows, "compile": compile_cmp}, indent=2))
    print(f"\nwrote {out}")
    _plot(rows, base, out.with_suffix(".png"))


def _plot(rows: list[dict], base: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return
    names = [r["rung"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.barh(names, [base["step_s"] / r["step_s"] for r in rows], color="tab:blue")
    a.set_xlabel("speed vs eager fp32 (x)")
    a.invert_yaxis()
    b.barh(names, [r["peak_bytes"] / 2**20 for r in rows], color="tab:orange", label="peak")
    b.barh(names, [r["activation_bytes"] / 2**20 for r in rows], color="tab:red", label="activations after forward")
    b.set_xlabel("MiB")
    b.invert_yaxis()
    b.legend()
    fig.suptitle(f"hf_memstack ladder - {machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
