"""The batch-size search: which sizes to run, and when to stop.

Cold: two small probes (``probe_size`` and twice it) give one line per operator
(:mod:`.fit`); their prediction is run; when it fitted and the lines predicted its peak,
it is the answer (3 steps). Otherwise the lines are refitted through the two probes nearest the
answer - the largest that fitted and the smallest that did not, which bracket it, or the two
largest that fitted - and the next prediction runs. Every size that runs lies strictly between
the largest size that fitted and the smallest that did not, and the answer is a size that ran.

Warm: the cached size is run once; it is the answer if it fits and leaves no more room than it
did when it was found (a smaller stale entry that merely fits is searched again).

Every size is the minimum over the ranks' proposals and every outcome is agreed (``ranks``),
so all ranks run the same probes in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .cache import CachedStep, CacheEntry
from .fit import Lines, fit_lines
from .probe import Measured, ProbeKind, StepRunner
from .ranks import agree

__all__ = ["Found", "Search"]

# Steps a cold search aims at; past them, a step runs only if it may gain more than 5%.
TARGET_STEPS = 4
# A hard bound, met only when no fit is usable (every larger probe ran out of memory part-way).
MAX_STEPS = 12
# A line through two peaks under-predicts the slope (the peak is convex in the batch size): its
# prediction aims at this fraction of the remaining headroom.
PEAK_LINE_AIM = 0.9


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """What a search settled on."""

    best: Measured
    """The largest size that ran and fitted."""
    lines: Lines | None
    """The fit at the answer (None: the answer needed none - a cache hit, or the first probe was the cap)."""
    capped: bool
    """``best`` is ``max_batch_size``: larger sizes were not tried."""


class Search:
    """The sizes to run for one job; see the module docstring."""

    def __init__(self, runner: StepRunner, *, budget: int, cap: int, too_small: Callable[[Measured], Exception]):
        self.runner, self.budget, self.cap, self.too_small = runner, budget, cap, too_small

    def cold(self, first_size: int) -> Found:
        """Search from scratch, starting at ``first_size`` (and twice it)."""
        start = len(self.runner.steps)
        self._first_fitting(min(first_size, self.cap))
        while True:
            lo, hi = self._bracket()
            spent = len(self.runner.steps) - start
            if spent >= MAX_STEPS or hi - lo.batch_size <= 1:
                break
            n, kind = self._propose(lo, hi)
            n = min(agree("next batch size", n)[0], hi - 1)
            if n <= lo.batch_size or (spent >= TARGET_STEPS and 0.95 * n <= lo.batch_size):
                break
            self.runner.run(n, kind)
        lo, _ = self._bracket()
        return Found(best=lo, lines=self._lines(lo), capped=lo.batch_size == self.cap)

    def warm(self, entry: CacheEntry) -> Found | None:
        """One step at the cached size; None when the entry no longer holds (the caller searches)."""
        n = min(entry.batch_size, self.cap)
        m = self.runner.run(n, "cache")
        if not m.fits:
            return None
        if n < entry.batch_size:  # this call's max_batch_size is below the cached maximum
            return Found(best=m, lines=None, capped=True)
        if entry.capped:  # found under a cap: the maximum may be larger than this call allows
            return Found(best=m, lines=None, capped=True) if n == self.cap else None
        # Still the maximum: no more room left than when it was found (a larger size would have
        # fitted then), or not room for one more sample.
        room = self.budget - (m.peak_bytes or 0)
        still_max = (
            room < entry.bytes_per_sample or room <= self.budget - entry.peak_bytes + entry.bytes_per_sample // 2
        )
        if not agree("cached size still the maximum", int(still_max))[0]:
            return None
        return Found(best=m, lines=None, capped=False)

    def entry(self, found: Found) -> CacheEntry:
        """What to cache for ``found``, with the steps that found it (a later read checks the entry against them)."""
        per_sample = found.lines.binding(found.best.batch_size)[1] if found.lines is not None else 0
        steps = tuple(
            CachedStep(batch_size=m.batch_size, peak_bytes=m.peak_bytes, fits=m.fits)
            for m in self.runner.steps
            if m.kind != "warmup"
        )
        return CacheEntry(
            batch_size=found.best.batch_size,
            peak_bytes=found.best.peak_bytes or 1,
            bytes_per_sample=max(0, int(per_sample)),
            capped=found.capped,
            steps=steps,
        )

    # -- internals ---------------------------------------------------------------------------
    def _first_fitting(self, size: int) -> Measured:
        m = self.runner.run(size, "probe")
        while not m.fits and m.batch_size > 1:
            m = self.runner.run(max(1, m.batch_size // 2), "probe")
        if not m.fits:
            raise self.too_small(m)
        return m

    def _bracket(self) -> tuple[Measured, int]:
        """The largest size that fitted, and the smallest larger one that did not (or past the cap)."""
        ran = [m for m in self.runner.steps if m.kind != "warmup"]
        lo = max((m for m in ran if m.fits), key=_size)
        hi = min((m.batch_size for m in ran if not m.fits and m.batch_size > lo.batch_size), default=self.cap + 1)
        return lo, hi

    def _propose(self, lo: Measured, hi: int) -> tuple[int, ProbeKind]:
        lines = self._lines(lo)
        above = [m for m in self.runner.steps if m.batch_size > lo.batch_size and m.kind != "warmup"]
        # A probe above that ran out of memory part-way, with no complete one to refit through:
        # the lines from below under-predicted and there is nothing better to fit - bisect.
        distrusted = any(not m.complete for m in above) and not any(m.complete for m in above)
        if lines is None or distrusted:
            if hi > self.cap:
                return 2 * lo.batch_size, "probe"
            return _between(lo.batch_size, hi), "search"
        ratio = max(m.allocator_ratio for m in self.runner.steps if m.complete)
        budget = self.budget / ratio
        if lines.method == "peak-line" and hi > self.cap:  # an extrapolated peak line: aim short
            peak = lo.peak_bytes or 0
            budget = peak + PEAK_LINE_AIM * (budget - peak)
        kind: ProbeKind = "refine" if any(m.kind == "predict" for m in self.runner.steps) else "predict"
        return lines.max_batch(budget, hi - 1), kind

    def _lines(self, lo: Measured) -> Lines | None:
        """Lines through ``lo`` and the smallest complete probe above it that did not fit (they
        bracket the answer), else the largest complete probe below it."""
        complete = [m for m in self.runner.steps if m.complete and m.kind != "warmup" and m is not lo]
        above = [m for m in complete if not m.fits and m.batch_size > lo.batch_size]
        below = [m for m in complete if m.fits and m.batch_size < lo.batch_size]
        partner = min(above, key=_size) if above else max(below, key=_size) if below else None
        return fit_lines(lo, partner) if partner is not None else None


def _size(m: Measured) -> int:
    return m.batch_size


def _between(lo: int, hi: int) -> int:
    """The next size to try between a size that fitted and one that did not: the geometric mean
    while they are far apart (a bracket of 4 to 4096 closes in a few steps), else the middle."""
    mid = math.isqrt(lo * hi) if hi > 2 * lo else (lo + hi) // 2
    return min(max(mid, lo + 1), hi - 1)
