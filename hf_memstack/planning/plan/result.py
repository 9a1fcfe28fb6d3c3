"""The planner's answer: the policy chosen (or none), every rung it considered, and how it prints
(the markdown table ``hf-memstack plan`` shows) and serialises (``--json``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...policy import MemoryPolicy
from ...sizes import format_bytes
from ..estimate.result import MemoryEstimate

__all__ = ["Plan", "PlanRow"]


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One rung the planner considered."""

    policy: str
    """The rung's policy string."""
    peak_bytes: int
    """Its estimated peak at the plan's batch size (batch 1 for ``batch_size="max"``)."""
    fits: bool
    """Under the budget minus the margin."""
    relative_speed: float
    """Step speed relative to eager fp32 (from the ladder benchmark)."""
    max_batch_size: int | None = None
    """With ``batch_size="max"``: the largest batch whose estimate fits."""
    traced: bool = True
    """False: not traced, because its weights and optimizer state alone hold more than the budget -
    counted from the model's parameters, or as a traced rung with the same states held them
    (``peak_bytes`` is then that floor)."""
    interpolated: bool = False
    """A ``ckpt:N`` rung not traced: ``peak_bytes`` is read between the same policy without
    checkpointing and with every block checkpointed, by the share of blocks each holds, and lies
    far enough above the budget (see ``plan_screen.SCREEN``) that the rung cannot fit."""
    below: bool = False
    """With ``interpolated``: read with the weights and optimizer state in place of full
    checkpointing's peak (not traced), below the interpolation: a lower bound."""
    bound_by: str = ""
    """Not traced: another rung (``bound_by``) is the same policy saving strictly more (the chunked
    loss added, selective checkpointing's alternate variant, more blocks checkpointed) and was over
    the budget: ``peak_bytes`` is that rung's peak (traced, or read between its neighbours), a lower
    bound of this one's."""
    shifted_from: str = ""
    """Not traced: the walk's row of ``shifted_from`` (the same rung without this one's state
    savings) less the weights and optimizer state those savings remove, far above the budget."""


@dataclass(slots=True)
class Plan:
    """The cheapest policy that fits (None when nothing does), and every rung considered."""

    policy: MemoryPolicy | None
    batch_size: int
    budget: int
    rows: list[PlanRow] = field(default_factory=list)
    estimate: MemoryEstimate | None = None
    shortfall_bytes: int = 0
    suggestions: list[str] = field(default_factory=list)
    weights_dtype: str = "fp32"
    """The dtype every rung counted the weights at (see :attr:`MemoryEstimate.weights_dtype`)."""
    weights_dtype_source: str = ""
    usable_bytes: int = 0
    """The budget minus the margin: what a rung's estimated peak must fit in (``fits``)."""
    images: str = ""
    """A vision-language model: the images each sample was planned with (sizes, tokens, where from)."""
    head_speed: str = ""
    """With a label fraction below 1: the chunked head's speed over the labelled positions ('' else)."""
    chunked_for_speed: str = ""
    """Why ``loss:chunked`` was added to a policy that fits without it: its head over the labelled
    positions is faster (:func:`hf_memstack.planning.plan.head_speed.add_chunked_for_speed`; '' else)."""

    @property
    def fits(self) -> bool:
        return self.policy is not None

    def table(self) -> str:
        lines = [
            "| policy | estimated peak | fits | relative speed |"
            + (" max batch |" if any(r.max_batch_size for r in self.rows) else ""),
            "|---|---|---|---|" + ("---|" if any(r.max_batch_size for r in self.rows) else ""),
        ]
        for r in self.rows:
            peak = (
                format_bytes(r.peak_bytes)
                if r.traced
                else f">= {format_bytes(r.peak_bytes)} (interpolated, to the states)"
                if r.interpolated and r.below
                else f"~{format_bytes(r.peak_bytes)} (interpolated)"
                if r.interpolated
                else f">= {format_bytes(r.peak_bytes)} (as {r.bound_by})"
                if r.bound_by
                else f"~{format_bytes(r.peak_bytes)} ({r.shifted_from} less the states saved)"
                if r.shifted_from
                else f">= {format_bytes(r.peak_bytes)} (weights + optimizer state)"
            )
            line = f"| {r.policy} | {peak} | {'yes' if r.fits else 'no'} | {r.relative_speed:.2f}x |"
            if any(x.max_batch_size for x in self.rows):
                line += f" {r.max_batch_size or 0} |"
            lines.append(line)
        lines.append(
            f"\nweights counted in {self.weights_dtype} ({self.weights_dtype_source}); --dtype / dtype= to plan another load"
        )
        lines += [self.images] if self.images else []
        lines += [self.head_speed] if self.head_speed else []
        budget = format_bytes(self.budget) + (
            f", {format_bytes(self.usable_bytes)} usable after the margin" if self.usable_bytes < self.budget else ""
        )
        if self.policy is not None:  # self.fits, spelled out so the type checker sees the policy
            lines.append(f"choose: {self.policy.to_string()} at batch size {self.batch_size} (budget {budget})")
            lines += [f"  - {self.chunked_for_speed}"] if self.chunked_for_speed else []
            lines += [f"  - {s}" for s in self.suggestions]
        else:
            lines.append(
                f"nothing fits {format_bytes(self.usable_bytes)} (budget {budget}): short by "
                f"{format_bytes(self.shortfall_bytes)} at best"
            )
            lines += [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.to_string() if self.policy else None,
            "batch_size": self.batch_size,
            "budget": self.budget,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "shortfall_bytes": self.shortfall_bytes,
            "suggestions": self.suggestions,
            "weights_dtype": self.weights_dtype,
            "weights_dtype_source": self.weights_dtype_source,
            "images": self.images,
            "head_speed": self.head_speed,
            "chunked_for_speed": self.chunked_for_speed,
            "estimate": self.estimate.as_dict() if self.estimate else None,
        }
