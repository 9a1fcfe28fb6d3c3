"""The estimates a plan draws on, each policy and batch size traced once, and the search for a
rung's largest batch (``batch_size="max"``) that spends as few traces as it can."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ...policy import MemoryPolicy
from ...sizes import format_bytes
from ..estimate.estimator import estimate_memory
from ..estimate.result import MemoryEstimate
from .states_floor import states_floor

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Estimates", "max_batch", "with_activation_floor"]


class Estimates:
    """Estimates for one model and job, each policy and batch size traced once."""

    def __init__(self, config: PretrainedConfig, **job: Any) -> None:
        self.config, self.job = config, job
        self.cache: dict[tuple[str, int], MemoryEstimate] = {}

    def __call__(self, policy: str, batch_size: int) -> MemoryEstimate:
        key = self._key(policy, batch_size)
        if key not in self.cache:
            self.cache[key] = with_activation_floor(
                estimate_memory(self.config, policy.replace("+compile", ""), batch_size=batch_size, **self.job)
            )
        return self.cache[key]

    def states_floor(self, policy: str) -> int | None:
        """A lower bound of the policy's weights and optimizer moments, without a trace
        (:func:`hf_memstack.planning.plan.states_floor.states_floor`; None: none known)."""
        trainable = self.job.get("trainable", "all")
        return states_floor(
            self.config,
            MemoryPolicy.coerce(policy),
            task=self.job["task"],
            dtype=self.job["dtype"],
            trains_all=isinstance(trainable, str) and trainable == "all",
            world_size=self.job.get("world_size", 1),
        )

    def has(self, policy: str, batch_size: int) -> bool:
        return self._key(policy, batch_size) in self.cache

    @staticmethod
    def _key(policy: str, batch_size: int) -> tuple[str, int]:
        # Compile is estimated as eager: rungs that differ only by compile share one trace; the
        # policy's own spelling, so bf16+loss:chunked+ckpt and bf16+ckpt+loss:chunked do too.
        return MemoryPolicy.coerce(policy.replace("+compile", "")).to_string(), batch_size


def with_activation_floor(e: MemoryEstimate) -> MemoryEstimate:
    """A sanity floor on what the planner chooses from: when the forward ends, the parameters, the
    optimizer state and the activations every block leaves (its per-block reading times the blocks) are
    all alive, so the forward+backward peak holds at least them; an estimate reading less is read at that
    floor (raised, and said in its notes): an estimate reading less than its blocks alone leave (as FSDP's
    once did for a 70B) would have the plan choose a run without checkpointing that cannot fit."""
    saved = e.activations_per_block * e.blocks
    floor = e.parameters + e.optimizer + saved
    if e.mode != "train" or e.forward_backward_peak >= floor:
        return e
    note = (
        f"forward+backward peak raised from {format_bytes(e.forward_backward_peak)} to {format_bytes(floor)}: the "
        f"parameters and optimizer state with the activations of {e.blocks} blocks x {format_bytes(e.activations_per_block)}"
    )
    if floor <= e.peak_bytes:  # the step's peak (the optimizer's) already holds it: its categories stand
        return dataclasses.replace(e, forward_backward_peak=floor, notes=(*e.notes, note))
    rest = floor - e.parameters - e.gradients - e.optimizer  # above e.activations + e.temporaries
    activations = max(e.activations, min(saved, rest))
    return dataclasses.replace(
        e,
        activations=activations,
        temporaries=rest - activations,
        forward_backward_peak=floor,
        peak_bytes=floor,
        peak_phase="forward+backward",
        notes=(*e.notes, note),
    )


_MAX_TRACES = 16  # per rung: a linear peak needs 4 (batch 1, 2, the answer, the answer + 1)


def max_batch(est: Estimates, policy: str, usable: float) -> tuple[int, MemoryEstimate]:
    """The largest batch whose estimated peak fits ``usable`` - that batch fits and the next one
    does not - and its estimate (0 and batch 1's when none fits).

    The forward+backward peak grows about linearly with the batch, the optimizer step's does
    not (the finder's model): a line through the *total* peaks would mostly measure the fixed
    optimizer cost, so the next size is read off the forward+backward peaks; bisection takes over
    where the line misses. Stops when the answer's neighbour was estimated and does not fit.
    """
    points = {1: est(policy, 1)}
    if points[1].peak_bytes > usable:
        return 0, points[1]
    good, bad = 1, None
    for _ in range(_MAX_TRACES):
        if bad == good + 1:
            break
        size = _next_size(points, good, bad, usable)
        points[size] = est(policy, size)
        if points[size].peak_bytes <= usable:
            good = size
        else:
            bad = size
    return good, points[good]


def _next_size(points: dict[int, MemoryEstimate], good: int, bad: int | None, usable: float) -> int:
    """The next batch to estimate, strictly between ``good`` (fits) and ``bad`` (does not; None: none
    seen yet): where the line through the forward+backward peaks of the two nearest sizes reaches
    ``usable``; the midpoint when that line points outside the bracket."""
    if len(points) == 1:
        return 2
    lo = max(b for b in points if b < good) if bad is None else good
    hi = good if bad is None else bad
    slope = (points[hi].forward_backward_peak - points[lo].forward_backward_peak) / (hi - lo)
    if bad is None:
        if slope <= 0:  # nothing grows with the batch here: look further out
            return good * 2
        reach = good + int((usable - points[good].forward_backward_peak) // slope)
        return min(max(reach, good + 1), good * 64)
    reach = good + int((usable - points[good].forward_backward_peak) // slope) if slope > 0 else good
    return reach if good < reach < bad else (good + bad) // 2
