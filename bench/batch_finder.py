"""Batch-size finders compared on one job, in one run: hf_memstack's find_batch_size (cold and
with a warm cache) and Accelerate's find_executable_batch_size (the real function, from 1024 and
from 128), against the true maximum.

On CPU a budget stands in for device memory: a step "runs out of memory" when the meter's
measured peak exceeds it. The true maximum is found exactly by a binary search over measured
steps. Accelerate's attempts above the true maximum raise the real OOM exception without running
(on a GPU they would fail part-way through a step), so its wall time here is a lower bound.

    python bench/batch_finder.py                  # Llama 4 layers, h=256, seq 256, bf16, budget 1 GiB
    python bench/batch_finder.py --budget 2GiB --seq 512
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, reference_batch, reference_model

from hf_memstack import find_batch_size, measure_step, parse_bytes, prepare_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--policy", default="bf16")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_finder.json"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = parse_bytes(args.budget)

    base = prepare_model(reference_model(args.layers, args.hidden, vocab=args.vocab).to(device), args.policy)

    def make_batch(n: int) -> dict:
        return reference_batch(n, args.seq, vocab=args.vocab, device=device)

    def fresh():
        """The job as a user has it: the prepared model and its optimizer, untouched by earlier runs."""
        model = copy.deepcopy(base)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    peaks: dict[int, int] = {}

    def peak(n: int) -> int:
        if n not in peaks:
            model, opt = fresh()
            peaks[n] = measure_step(model, make_batch(n), opt, timed=False).peak_bytes
        return peaks[n]

    # The true maximum, exactly: grow until over budget, then bisect on measured peaks.
    lo, hi = 1, 2
    while peak(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid)
    true_max = lo
    print(f"true maximum: {true_max} (peak {peaks[true_max] / 2**20:.0f} MiB; {true_max + 1}: {peaks[true_max + 1] / 2**20:.0f} MiB; "
          f"budget {budget / 2**20:.0f} MiB)", flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for name, use_cache in (("hf_memstack (cold)", False), ("hf_memstack (cold, fills cache)", True), ("hf_memstack (warm cache)", True)):
            if name.endswith("fills cache)"):
                model, opt = fresh()
                find_batch_size(model, make_batch, opt, budget=budget, cache_dir=cache_dir)
                continue
            model, opt = fresh()
            start = time.perf_counter()
            result = find_batch_size(model, make_batch, opt, budget=budget, cache=use_cache, cache_dir=cache_dir)
            rows.append({"finder": name, "found": result.batch_size, "steps": result.steps_run, "attempts": result.steps_run,
                         "seconds": time.perf_counter() - start, "probes": [p.batch_size for p in result.probes]})
            print(result.summary(), flush=True)

    from accelerate.utils import find_executable_batch_size

    for start_size in (1024, 128):
        model, opt = fresh()
        attempts = []

        @find_executable_batch_size(starting_batch_size=start_size)
        def train(batch_size: int) -> int:
            attempts.append(batch_size)
            if batch_size > true_max:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate (batch {batch_size} over the budget)")
            measure_step(model, make_batch(batch_size), opt, timed=False, warmup=False)
            return batch_size

        start = time.perf_counter()
        found = train()
        rows.append({"finder": f"accelerate find_executable_batch_size (start {start_size})", "found": found,
                     "steps": sum(a <= true_max for a in attempts), "attempts": len(attempts),
                     "seconds": time.perf_counter() - start, "probes": attempts})

    ours = next(r for r in rows if r["finder"] == "hf_memstack (cold)")
    print(f"\nmachine: {machine()}")
    print(f"job: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, policy {args.policy}, "
          f"AdamW; budget {budget / 2**20:.0f} MiB; true maximum {true_max}\n")
    print("| finder | found | found / true max | attempts | real steps run | wall s | time vs hf_memstack cold |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['finder']} | {r['found']} | {r['found'] / true_max:.2f} | {r['attempts']} | {r['steps']} | {r['seconds']:.1f} | "
              f"{r['seconds'] / ours['seconds']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "true_max": true_max, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
