"""Batch-size finders raced on one job, in one run, under a simulated device budget: hf_memstack's
find_batch_size (cold, and with a warm cache), Accelerate's real find_executable_batch_size (from
1024 and from 128), Transformers Trainer's auto_find_batch_size, and brute force.

The device is hf_memstack.simulated_memory_limit: every allocation that would take the live
tensor bytes above the budget raises the real torch.OutOfMemoryError where it happens, so an
oversized attempt runs until that allocation, as on a GPU. Every finder gets a fresh copy of the
prepared model and a fresh AdamW, and the limit counts them plus everything allocated after.

The question each answers: the largest batch size that trains. Accelerate's decorated function
and the Trainer run 2 training steps (the second holds the optimizer state through its backward:
the steady state a run must survive); the true maximum is the largest size whose steady-state
step fits, by bisection over real steps. Wall times are measured side by side in this run.

    python bench/batch_finder.py                       # Llama 4 layers, h=256, seq 128, precision auto, 512 MiB
    python bench/batch_finder.py --budget 2GiB --seq 512 --skip trainer
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _common import machine, reference_batch, reference_model

from hf_memstack import (
    find_batch_size,
    parse_bytes,
    prepare_model,
    simulated_memory_limit,
)
from hf_memstack.measure.step import train_step
from hf_memstack.transforms.precision.apply import cpu_has_native_bf16, resolve_precision

FINDERS = ("ours", "accelerate", "trainer", "brute")


@dataclass(kw_only=True)
class Row:
    finder: str
    found: int
    full_steps: int
    partial_steps: int
    over_budget: int
    seconds: float
    """Wall time (ours: the median of its runs)."""
    cpu_seconds: float
    """This process's CPU time: steadier than wall time on a machine shared with other jobs."""
    sizes: list[int]


@dataclass
class Clock:
    """Wall and process CPU time of a :func:`timed` block (set when it ends)."""

    wall: float = 0.0
    cpu: float = 0.0


@contextlib.contextmanager
def timed() -> Iterator[Clock]:
    clock, wall, cpu = Clock(), time.perf_counter(), time.process_time()
    yield clock
    clock.wall, clock.cpu = time.perf_counter() - wall, time.process_time() - cpu


class Job:
    """The prepared model, its batches, the budget; a fresh copy per finder."""

    def __init__(self, args: argparse.Namespace, policy: str):
        self.args, self.policy = args, policy
        self.budget = parse_bytes(args.budget)
        self.base = prepare_model(reference_model(args.layers, args.hidden, vocab=args.vocab), policy)

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        return reference_batch(n, self.args.seq, vocab=self.args.vocab, seed=n)

    def fresh(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        gc.collect()
        model = copy.deepcopy(self.base)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    def counted_step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, counts: dict[str, int]) -> None:
        """One training step; counts it as full, or partial when it runs out of memory."""
        try:
            train_step(model, self.batch(n), opt)
        except torch.OutOfMemoryError:
            counts["partial"] += 1
            raise
        counts["full"] += 1


def brute_force(job: Job) -> Row:
    """The true maximum: double until a steady-state step runs out of memory, then bisect."""
    model, opt = job.fresh()
    train_step(model, job.batch(1), opt)  # the optimizer state exists: every step below is steady-state
    counts = {"full": 0, "partial": 0}
    sizes: list[int] = []

    def fits(n: int) -> bool:
        sizes.append(n)
        ok = True
        with simulated_memory_limit(job.budget, count=[model, opt]):
            try:
                job.counted_step(model, opt, n, counts)
            except torch.OutOfMemoryError:
                ok = False
        if not ok:  # outside the except block: the traceback no longer holds the step's tensors
            opt.zero_grad(set_to_none=True)
            gc.collect()
        return ok

    with timed() as clock:
        lo, hi = 0, 1
        while fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return Row(
        finder="brute force (bisection)",
        found=lo,
        full_steps=counts["full"],
        partial_steps=counts["partial"],
        over_budget=counts["partial"],
        seconds=clock.wall,
        cpu_seconds=clock.cpu,
        sizes=sizes,
    )


def ours(job: Job, *, warm: bool, repeats: int = 3) -> Row:
    """find_batch_size on fresh copies, ``repeats`` times (medians): cold, each with an empty
    cache; warm, after one cold run filled it."""
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as root:
        if warm:
            _ours_once(job, root)
        for i in range(repeats):
            result, clock = _ours_once(job, root if warm else f"{root}/{i}")
            walls.append(clock.wall)
            cpus.append(clock.cpu)
    print(result.summary(), flush=True)
    partial = sum(p.partial for p in result.probes)
    return Row(
        finder=f"hf_memstack find_batch_size ({'warm cache' if warm else 'cold'}, median of {repeats})",
        found=result.batch_size,
        full_steps=result.steps_run - partial,
        partial_steps=partial,
        over_budget=result.over_budget_probes,
        seconds=statistics.median(walls),
        cpu_seconds=statistics.median(cpus),
        sizes=[p.batch_size for p in result.probes],
    )


def _ours_once(job: Job, cache_dir: str) -> tuple[Any, Clock]:
    model, opt = job.fresh()
    with simulated_memory_limit(job.budget, count=[model, opt]), timed() as clock:
        result = find_batch_size(model, job.batch, opt, cache_dir=cache_dir)  # the budget is the simulated device's
    return result, clock


def accelerate(job: Job, start_size: int) -> Row:
    from accelerate.utils import find_executable_batch_size

    model, opt = job.fresh()
    counts = {"full": 0, "partial": 0}
    sizes: list[int] = []

    @find_executable_batch_size(starting_batch_size=start_size)
    def train(batch_size: int) -> int:
        sizes.append(batch_size)
        for _ in range(2):
            job.counted_step(model, opt, batch_size, counts)
        return batch_size

    with simulated_memory_limit(job.budget, count=[model, opt]), timed() as clock:
        found = train()
    return Row(
        finder=f"accelerate find_executable_batch_size (start {start_size})",
        found=found,
        full_steps=counts["full"],
        partial_steps=counts["partial"],
        over_budget=len(sizes) - 1,
        seconds=clock.wall,
        cpu_seconds=clock.cpu,
        sizes=sizes,
    )


def trainer(job: Job, start_size: int) -> Row:
    """Transformers' Trainer with auto_find_batch_size=True, 2 steps, on the same model and batches."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, _ = job.fresh()
    sizes: list[int] = []
    counts = {"full": 0}

    class Count(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sizes.append(state.train_batch_size)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            counts["full"] += 1

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2 * start_size

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {k: v[0] for k, v in reference_batch(1, job.args.seq, vocab=job.args.vocab, seed=i).items()}

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=start_size,
            auto_find_batch_size=True,
            max_steps=2,
            learning_rate=1e-5,
            optim="adamw_torch",
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            dataloader_drop_last=True,
            disable_tqdm=True,
        )
        t = Trainer(model=model, args=targs, train_dataset=Samples(), callbacks=[Count()])
        with simulated_memory_limit(job.budget, count=[model]) as mem, timed() as clock:
            t.train()
        found = t._train_batch_size
    return Row(
        finder=f"Trainer auto_find_batch_size (start {start_size})",
        found=found,
        full_steps=counts["full"],
        partial_steps=mem.out_of_memory_errors,
        over_budget=len(sizes) - 1,
        seconds=clock.wall,
        cpu_seconds=clock.cpu,
        sizes=sizes,
    )


def overhead(job: Job, n: int, reps: int = 3) -> float:
    """Step time under the simulated limit over step time without it: interleaved rounds of
    ``steps`` steps each (enough to time small batches), median over rounds."""
    model, opt = job.fresh()
    batch = job.batch(n)
    steps = max(1, 4 // n)
    for _ in range(2):  # warm-up: allocator, kernels, optimizer state
        train_step(model, batch, opt)
    plain, limited = [], []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            train_step(model, batch, opt)
        plain.append(time.perf_counter() - start)
        with simulated_memory_limit("1TiB", count=[model, opt]):
            start = time.perf_counter()
            for _ in range(steps):
                train_step(model, batch, opt)
            limited.append(time.perf_counter() - start)
    return statistics.median(limited) / statistics.median(plain)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--precision", default="auto", help="fp32, bf16 or auto (bf16 only where this CPU runs it natively)"
    )
    ap.add_argument("--ckpt", action="store_true", help="add full activation checkpointing to the policy")
    ap.add_argument("--budget", default="512MiB")
    ap.add_argument("--skip", nargs="*", default=[], choices=FINDERS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_finder.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    resolved = resolve_precision(args.precision, "cpu")
    policy = resolved.name + ("+ckpt" if args.ckpt else "")
    cpu = f"{machine()}; native bf16: {'yes' if cpu_has_native_bf16() else 'no (bf16 emulated, ~2x slower)'}"
    print(f"{cpu}\nprecision {args.precision} -> {resolved.name} ({resolved.reason}); policy {policy}", flush=True)
    job = Job(args, policy)
    truth = brute_force(job)
    print(f"true maximum {truth.found} ({truth.full_steps + truth.partial_steps} steps: {truth.sizes})", flush=True)
    rows = []
    if "ours" not in args.skip:
        rows += [ours(job, warm=False), ours(job, warm=True)]
    for start_size in (1024, 128):
        if "accelerate" not in args.skip:
            rows.append(accelerate(job, start_size))
            print(f"{rows[-1].finder}: {rows[-1].sizes}", flush=True)
    if "trainer" not in args.skip:
        rows.append(trainer(job, 128))
        print(f"{rows[-1].finder}: {rows[-1].sizes}", flush=True)
    rows.append(truth)
    ratios = {n: overhead(job, n) for n in (1, max(1, truth.found // 3))}
    report(args, cpu, policy, job.budget, truth.found, rows, ratios)


def report(
    args: argparse.Namespace,
    cpu: str,
    policy: str,
    budget: int,
    true_max: int,
    rows: list[Row],
    ratios: dict[int, float],
) -> None:
    ours_cold = next((r for r in rows if "(cold" in r.finder), rows[0])
    print(f"\nmachine: {cpu}")
    print(
        f"job: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, policy {policy}, "
        f"AdamW; simulated budget {budget / 2**20:.0f} MiB; true maximum {true_max}"
    )
    print(
        "simulated_memory_limit overhead (step time inside / outside, median of 3 interleaved rounds): "
        + ", ".join(f"x{r:.2f} at batch {n}" for n, r in ratios.items())
        + "\n"
    )
    print(
        "| finder | found | found / true max | real steps (full + partial) | over-budget attempts | wall s | CPU s "
        "| hf_memstack cold / this (wall, CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.finder} | {r.found} | {r.found / true_max:.2f} | {r.full_steps + r.partial_steps} "
            f"({r.full_steps} + {r.partial_steps}) | {r.over_budget} | {r.seconds:.1f} | {r.cpu_seconds:.1f} | "
            f"{ours_cold.seconds / r.seconds:.2f}, {ours_cold.cpu_seconds / r.cpu_seconds:.2f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": cpu,
                "args": vars(args),
                "policy": policy,
                "budget": budget,
                "true_max": true_max,
                "simulated_limit_overhead": ratios,
                "rows": [asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
