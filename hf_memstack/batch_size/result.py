"""BatchSizeResult: what find_batch_size returns - the size, every real step it ran, the line
that predicted it, the accumulation for a global batch, the cache's part - built from the search."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ..data.boundaries import is_packed
from ..record import MemstackRecord
from ..sizes import format_bytes
from .fit import Phase
from .probe import Measured, ProbeKind, StepRunner, seq_len_of
from .ranks import world_size
from .search import Found

__all__ = ["BatchSizeResult", "CacheStatus", "Fit", "Probe", "build_result"]

CacheStatus = Literal["off", "miss", "hit", "stale"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One real step run by the search."""

    batch_size: int
    """Samples in the step's batch."""
    kind: ProbeKind
    """Why it ran: ``probe`` (the small sizes the fit starts from), ``predict`` (the fit's answer),
    ``refine`` (a refitted answer), ``search`` (bisection, when no fit is usable), ``cache`` (the
    cached size, re-verified), ``warmup`` (creates the optimizer state when it cannot be created
    without a step)."""
    fits: bool
    """Ran to the end under the budget, on every rank."""
    peak_bytes: int | None
    """The step's measured peak on this rank; None when it ran out of memory part-way."""
    seconds: float
    """Wall time of the step."""

    @property
    def partial(self) -> bool:
        """Stopped by an out-of-memory error part-way through the step."""
        return self.peak_bytes is None


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """The line that holds the peak at the answer: ``peak ~ fixed_bytes + bytes_per_sample * batch``."""

    method: Literal["per-operator", "peak-line"]
    """``per-operator``: one line per operator of the step, exact when the probes ran the same
    operators; ``peak-line``: one line through two probes' peaks (the fallback)."""
    fixed_bytes: int
    """The binding line's bytes at batch size 0 (weights, gradients, optimizer state, buffers)."""
    bytes_per_sample: int
    """Its bytes per sample: about what one more sample would need."""
    binding_phase: Phase
    """Where the step peaks at the answer: ``forward``, ``backward`` or ``optimizer``."""
    from_sizes: tuple[int, int]
    """The two probe sizes the lines go through."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizeResult:
    """What :func:`find_batch_size` found, and how."""

    batch_size: int
    """The largest batch size whose real step fitted the budget (on every rank)."""
    peak_bytes: int
    """The measured peak of that step (this rank)."""
    budget: int
    """The budget in bytes."""
    mode: Literal["train", "eval"]
    """``train``: forward, backward and optimizer step; ``eval``: forward under no_grad."""
    probes: tuple[Probe, ...]
    """Every real step, in order."""
    fit: Fit | None
    """The prediction at the answer (None when none was needed: a cache hit, or the first probe was the cap)."""
    capped: bool
    """``batch_size`` is ``max_batch_size``: larger sizes were not tried."""
    world_size: int
    """Ranks that agreed on the size."""
    seq_len: int | None
    """The batches' sequence length (``input_ids``), when they have one."""
    tokens_per_batch: int | None
    """``batch_size * seq_len``."""
    global_batch_size: int | None
    """The requested samples per optimizer step over all ranks."""
    grad_accum: int
    """Gradient-accumulation steps for ``global_batch_size`` (1 without one)."""
    exact_global_batch: bool
    """``batch_size * grad_accum * world_size == global_batch_size``."""
    exact_batch_size: int | None
    """When not exact: the largest size below ``batch_size`` that gives ``global_batch_size`` exactly."""
    cache: CacheStatus
    """``off``; ``miss`` (searched, then stored); ``hit`` (one verifying step); ``stale`` (the
    entry no longer held: searched again)."""
    cache_file: str | None
    """The cache entry's path (None with ``cache=False``)."""
    snapshot_bytes: int
    """Host memory taken by the copy of what a step changes (frozen weights are not copied)."""
    notes: tuple[str, ...] = ()
    """Anything else worth knowing (compiled model, inexact global batch)."""
    packed: bool = False
    """The batches are packed rows (``position_ids`` restarting, :class:`hf_memstack.data.PackedCollator`):
    ``batch_size`` counts rows of ``seq_len`` tokens, each holding several samples, and
    ``tokens_per_batch`` is the token budget of a step (with SDPA or eager attention the probes
    measured the dense mask such rows make)."""

    @property
    def steps_run(self) -> int:
        """Real steps run, full or stopped part-way."""
        return len(self.probes)

    @property
    def over_budget_probes(self) -> int:
        """Steps that did not fit (ran out of memory, or peaked above the budget)."""
        return sum(not p.fits for p in self.probes)

    @property
    def cache_hit(self) -> bool:
        return self.cache == "hit"

    def summary(self) -> str:
        lines = [
            f"batch size {self.batch_size} ({self.mode}): peak {format_bytes(self.peak_bytes)} of a "
            f"{format_bytes(self.budget)} budget, {self.steps_run} real step(s)"
            + (f", {self.over_budget_probes} over budget" if self.over_budget_probes else "")
            + (" (cache hit)" if self.cache_hit else "")
            + (" (max_batch_size)" if self.capped else "")
        ]
        if self.tokens_per_batch and self.packed:
            lines.append(
                f"  {self.tokens_per_batch} tokens per batch: {self.batch_size} packed rows of {self.seq_len} tokens"
            )
        elif self.tokens_per_batch:
            lines.append(f"  {self.tokens_per_batch} tokens per batch at sequence length {self.seq_len}")
        if self.global_batch_size:
            lines.append(
                f"  global batch {self.global_batch_size} = {self.batch_size} x {self.grad_accum} accumulation x "
                f"{self.world_size} device(s)" + ("" if self.exact_global_batch else " (not exact)")
            )
        if self.fit is not None:
            lines.append(
                f"  fit ({self.fit.method}, probes {self.fit.from_sizes[0]} and {self.fit.from_sizes[1]}): "
                f"{format_bytes(self.fit.bytes_per_sample)} per {'packed row' if self.tokens_per_batch and self.packed else 'sample'}, "
                + (
                    f"peak in the {self.fit.binding_phase}"
                    if self.fit.binding_phase != "unknown"
                    else "peak phase not measured"
                )
            )
        lines.append(
            "  probes: "
            + ", ".join(
                f"{p.batch_size}:{'OOM' if p.partial else format_bytes(p.peak_bytes or 0)}{'' if p.fits else '(over)'}"
                for p in self.probes
            )
        )
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(steps_run=self.steps_run, over_budget_probes=self.over_budget_probes, cache_hit=self.cache_hit)
        return d


def build_result(
    found: Found,
    runner: StepRunner,
    status: CacheStatus,
    path: Path | None,
    *,
    sample: object,
    budget: int,
    mode: Literal["train", "eval"],
    record: MemstackRecord | None,
    global_batch_size: int | None,
    snapshot_bytes: int,
) -> BatchSizeResult:
    best, world = found.best, world_size()
    seq_len = seq_len_of(sample)
    fit = None
    if found.lines is not None:
        fixed, per_sample, phase = found.lines.binding(best.batch_size)
        fit = Fit(
            method=found.lines.method,
            fixed_bytes=fixed,
            bytes_per_sample=per_sample,
            binding_phase=phase,
            from_sizes=(found.lines.a, found.lines.b),
        )
    accum, exact, exact_size, notes = _global_batch(best.batch_size, global_batch_size, world)
    if record is not None and record.compile.regions:
        notes += (
            (
                "compiled model: the probes ran eagerly (Dynamo does not run compiled code under the finder's memory "
                "tracker), so the size comes from eager memory and no graph was compiled for the probe sizes"
            ),
        )
    return BatchSizeResult(
        batch_size=best.batch_size,
        peak_bytes=best.peak_bytes or 0,
        budget=budget,
        mode=mode,
        probes=tuple(_probe(m) for m in runner.steps),
        fit=fit,
        capped=found.capped,
        world_size=world,
        seq_len=seq_len,
        tokens_per_batch=best.batch_size * seq_len if seq_len else None,
        global_batch_size=global_batch_size,
        grad_accum=accum,
        exact_global_batch=exact,
        exact_batch_size=exact_size,
        cache=status,
        cache_file=str(path) if path is not None else None,
        snapshot_bytes=snapshot_bytes,
        notes=notes,
        packed=isinstance(sample, dict) and is_packed(sample.get("position_ids"), sample.get("attention_mask")),
    )


def _probe(m: Measured) -> Probe:
    return Probe(batch_size=m.batch_size, kind=m.kind, fits=m.fits, peak_bytes=m.peak_bytes, seconds=m.seconds)


def _global_batch(
    batch_size: int, global_batch: int | None, world: int
) -> tuple[int, bool, int | None, tuple[str, ...]]:
    """Accumulation steps for ``global_batch`` (and, when inexact, the largest size that is exact)."""
    if global_batch is None:
        return 1, True, None, ()
    per_step = batch_size * world
    accum = max(1, math.ceil(global_batch / per_step))
    if accum * per_step == global_batch:
        return accum, True, None, ()
    exact = next((b for b in range(batch_size, 0, -1) if global_batch % (b * world) == 0), None)
    note = (
        f"global batch {global_batch} is not a multiple of {batch_size} x {world}: {accum} accumulation steps give "
        f"{accum * per_step}"
        + (f"; batch size {exact} with {global_batch // (exact * world)} steps matches exactly" if exact else "")
    )
    return accum, False, exact, (note,)
