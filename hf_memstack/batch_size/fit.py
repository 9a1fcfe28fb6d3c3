"""The finder's prediction: one straight line per operator of the training step.

Why per operator. After each operator, the live bytes are a sum of tensor sizes, and each size is
affine in the batch size ``n`` (activations, logits and attention scores grow with it; weights,
gradients and optimizer state do not). So the live bytes after operator ``i`` are exactly
``L_i(n) = fixed_i + per_sample_i * n`` as long as the step runs the same operators at every
size, and two probes give every line. The step's peak, ``max_i L_i(n)``, is then known at every
size. A line through the two probes' *peaks* is not: it follows the operator that peaks at the
small sizes and misses the one that overtakes it later (checkpointing's recompute in the backward
overtaking the forward, the logits' gradient overtaking the optimizer step), so it under-predicts
the slope and the prediction overshoots - issue 13's Qwen2 case (probes 2, 4, then 40, over).

When two probes ran different operator sequences (a kernel chosen by size), the fallback is the
line through their peaks (``peak-line``), which the search aims short of the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .probe import Measured

__all__ = ["Lines", "Phase", "fit_lines"]

Phase = Literal["forward", "backward", "optimizer", "unknown"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Lines:
    """``live_i(n) = start_i + rise_i * (n - a) / (b - a)`` for every operator ``i``."""

    a: int
    """The smaller batch size the lines were measured at."""
    b: int
    """The larger one."""
    start: np.ndarray
    """Live bytes after each operator at batch size ``a`` (int64)."""
    rise: np.ndarray
    """Live bytes at ``b`` minus at ``a``, per operator (int64)."""
    method: Literal["per-operator", "peak-line"]
    """``per-operator``: one line per operator; ``peak-line``: one line through the two peaks."""
    phase_ends: tuple[int, ...]
    """Operator counts at the end of the forward and of the backward."""

    def peak(self, n: int) -> int:
        """The predicted peak at batch size ``n`` (bytes, rounded down)."""
        i = self._argmax(n)
        return self._value(i, n)

    def max_batch(self, budget: float, cap: int) -> int:
        """The largest ``n <= cap`` whose predicted peak fits ``budget`` (0 when none does)."""
        span = self.b - self.a
        grows = self.rise > 0
        if not grows.any():
            return cap if float(self.start.max()) <= budget else 0
        bound = self.a + (budget - self.start[grows]) * span / self.rise[grows]
        # Operators whose bytes do not grow bind only if they are over already.
        if (self.start[~grows] > budget).any():
            return 0
        n = max(0, min(cap, math.floor(float(bound.min()) + 1e-6)))
        while n > 0 and self.peak(n) > budget:  # float rounding at an exact boundary
            n -= 1
        return n

    def binding(self, n: int) -> tuple[int, int, Phase]:
        """The line that holds the peak at ``n``: its bytes at size 0, its bytes per sample, its phase."""
        i = self._argmax(n)
        per_sample = int(self.rise[i]) / (self.b - self.a)
        fixed = int(self.start[i]) - per_sample * self.a
        phase: Phase
        if self.method == "peak-line":
            phase = "unknown"
        elif not self.phase_ends:  # an evaluation step: a forward only
            phase = "forward"
        else:
            phase = "forward" if i < self.phase_ends[0] else "backward" if i < self.phase_ends[-1] else "optimizer"
        return round(fixed), round(per_sample), phase

    def _argmax(self, n: int) -> int:
        values = self.start.astype(np.float64) + self.rise.astype(np.float64) * ((n - self.a) / (self.b - self.a))
        return int(np.argmax(values))

    def _value(self, i: int, n: int) -> int:
        span = self.b - self.a
        return (int(self.start[i]) * span + int(self.rise[i]) * (n - self.a)) // span


def fit_lines(x: Measured, y: Measured) -> Lines | None:
    """Lines through two complete probes of different sizes: per operator when both ran the same
    operators, else through their peaks. None when a probe did not run to the end."""
    if not (x.complete and y.complete) or x.batch_size == y.batch_size:
        return None
    lo, hi = (x, y) if x.batch_size < y.batch_size else (y, x)
    if len(lo.timeline) == len(hi.timeline) and len(lo.timeline) > 0:
        return Lines(
            a=lo.batch_size,
            b=hi.batch_size,
            start=lo.timeline,
            rise=hi.timeline - lo.timeline,
            method="per-operator",
            phase_ends=lo.phase_ends,
        )
    low, high = int(lo.peak_bytes or 0), int(hi.peak_bytes or 0)
    return Lines(
        a=lo.batch_size,
        b=hi.batch_size,
        start=np.array([low], dtype=np.int64),
        rise=np.array([high - low], dtype=np.int64),
        method="peak-line",
        phase_ends=(),
    )
