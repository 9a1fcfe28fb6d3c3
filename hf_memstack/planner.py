"""plan_policy: walk the ladder, cheapest rung first, and return the first policy whose estimated
peak fits the budget with a margin - with the table of every rung considered."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .estimate import MemoryEstimate, estimate_memory, load_config
from .memory import format_bytes, parse_bytes
from .policy import MemoryPolicy

__all__ = ["Plan", "PlanRow", "plan_policy"]

# Speed relative to eager fp32. bf16 (1.52x) and full checkpointing (x0.86 of the same rung) were
# measured by bench/ladder.py (4-layer Llama h=1024, batch 4, seq 256, 2-core Xeon with AMX-BF16; see
# the README). Offload and FSDP factors are assumptions, not measured here. They only order rungs
# that fit, so they only need to be roughly right.
MEASURED_SPEED = {"bf16": 1.52, "ckpt": 0.86, "offload": 0.8, "fsdp": 0.8, "fsdp_offload": 0.2}


@dataclass(frozen=True, slots=True)
class PlanRow:
    policy: str
    peak_bytes: int
    fits: bool
    relative_speed: float
    max_batch_size: int | None = None


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

    @property
    def fits(self) -> bool:
        return self.policy is not None

    def table(self) -> str:
        lines = ["| policy | estimated peak | fits | relative speed |" + (" max batch |" if any(r.max_batch_size for r in self.rows) else ""),
                 "|---|---|---|---|" + ("---|" if any(r.max_batch_size for r in self.rows) else "")]
        for r in self.rows:
            line = f"| {r.policy} | {format_bytes(r.peak_bytes)} | {'yes' if r.fits else 'no'} | {r.relative_speed:.2f}x |"
            if any(x.max_batch_size for x in self.rows):
                line += f" {r.max_batch_size or 0} |"
            lines.append(line)
        if self.fits:
            lines.append(f"\nchoose: {self.policy.to_string()} at batch size {self.batch_size} (budget {format_bytes(self.budget)})")
            lines += [f"  - {s}" for s in self.suggestions]
        else:
            lines.append(f"\nnothing fits {format_bytes(self.budget)}: short by {format_bytes(self.shortfall_bytes)} at best")
            lines += [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_string() if self.policy else None, "batch_size": self.batch_size, "budget": self.budget,
                "fits": self.fits, "rows": [dataclasses.asdict(r) for r in self.rows], "shortfall_bytes": self.shortfall_bytes,
                "suggestions": self.suggestions, "estimate": self.estimate.as_dict() if self.estimate else None}


def _ladder(precision: str, num_blocks: int, world_size: int) -> list[tuple[str, float]]:
    """The memory rungs, cheapest first, from the device's mixed precision. fp32 is the correctness
    rung, not a memory one, and compile changes speed rather than memory: both stay out of the walk."""
    mixed = MEASURED_SPEED["bf16"] if precision != "fp32" else 1.0
    rungs = [(precision, mixed)]
    # Checkpointing: the least checkpointing that fits first (every 4th block, 3rd, 2nd), then every block.
    for n in (4, 3, 2):
        if n < num_blocks:
            rungs.append((f"{precision}+ckpt:{n}", mixed * (1 - (1 - MEASURED_SPEED["ckpt"]) / n)))
    rungs.append((f"{precision}+ckpt", mixed * MEASURED_SPEED["ckpt"]))
    rungs.append((f"{precision}+ckpt:offload", mixed * MEASURED_SPEED["offload"]))
    if world_size > 1:
        rungs.append((f"{precision}+ckpt+fsdp", mixed * MEASURED_SPEED["ckpt"] * MEASURED_SPEED["fsdp"]))
        rungs.append((f"{precision}+ckpt+fsdp:offload", mixed * MEASURED_SPEED["ckpt"] * MEASURED_SPEED["fsdp_offload"]))
    return rungs


def plan_policy(
    model: Any,
    *,
    budget: int | str,
    seq_len: int,
    batch_size: int | Literal["max"] = 1,
    world_size: int = 1,
    margin: float = 0.1,
    task: str = "causal-lm",
    device: str | None = None,
) -> Plan:
    """The cheapest rung of the ladder whose estimated peak fits ``budget`` with ``margin``.

    Args:
        model: hub id (local cache), local directory, config or model.
        budget: per-device memory, bytes or ``"80GiB"``.
        seq_len: tokens per sample.
        batch_size: per-device batch, or ``"max"``: the largest batch each rung fits (the first rung
            that fits at least one sample is chosen, at its largest batch).
        world_size: devices; FSDP rungs are considered when > 1.
        margin: fraction of the budget kept free (allocator fragmentation, the CUDA context).
        device: where it will train (``cuda``/``cpu``; default: this machine) - picks bf16, fp16 or fp32.

    Returns:
        :class:`Plan`. When nothing fits: the shortfall, and what would (more ranks, shorter
        sequences, a smaller batch with gradient accumulation).
    """
    budget_bytes = parse_bytes(budget, field="budget")
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be in [0, 1)")
    if batch_size != "max" and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer or 'max'")
    usable = budget_bytes * (1 - margin)
    config = load_config(model)
    import torch

    from .precision import resolve_precision

    precision = resolve_precision("auto", device or ("cuda" if torch.cuda.is_available() else "cpu")).name
    blocks = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or getattr(config, "num_layers", 4)
    cache: dict[tuple[str, int], MemoryEstimate] = {}

    def est(policy: str, b: int) -> MemoryEstimate:
        # Compile is estimated as eager: rungs that differ only by compile share one trace.
        key = (policy.replace("+compile", ""), b)
        if key not in cache:
            cache[key] = estimate_memory(config, policy, batch_size=b, seq_len=seq_len, world_size=world_size, task=task)
        return cache[key]

    plan = Plan(policy=None, batch_size=0 if batch_size == "max" else batch_size, budget=budget_bytes)
    best_short = None
    for policy, speed in _ladder(precision, int(blocks), world_size):
        if batch_size == "max":
            one, two = est(policy, 1), est(policy, 2)
            slope = max(1, two.peak_bytes - one.peak_bytes)
            fit_b = int((usable - one.peak_bytes) // slope) + 1 if one.peak_bytes <= usable else 0
            e, fits = one, fit_b >= 1
            plan.rows.append(PlanRow(policy, one.peak_bytes, fits, speed, max(fit_b, 0)))
            if fits and plan.policy is None:
                plan.policy, plan.batch_size, plan.estimate = MemoryPolicy.coerce(policy), fit_b, one
        else:
            e = est(policy, batch_size)
            fits = e.peak_bytes <= usable
            plan.rows.append(PlanRow(policy, e.peak_bytes, fits, speed))
            if fits and plan.policy is None:
                plan.policy, plan.estimate = MemoryPolicy.coerce(policy), e
        short = int(e.peak_bytes - usable)
        best_short = short if best_short is None else min(best_short, short)
        if plan.policy is not None:
            break
    if plan.policy is None:
        plan.shortfall_bytes = max(0, best_short or 0)
        plan.suggestions = _suggestions(est, precision, batch_size, seq_len, world_size, usable)
    else:
        plan.suggestions = [f"add compile ('{plan.policy.to_string()}+compile') for speed: it needs no more memory"]
    return plan


def _suggestions(est: Any, precision: str, batch_size: Any, seq_len: int, world_size: int, usable: float) -> list[str]:
    base = est(f"{precision}+ckpt", 1)
    states = base.parameters + base.gradients + base.optimizer
    out = []
    ranks = max(2, world_size * 2)
    while ranks <= 4096 and states / ranks + (base.peak_bytes - states) > usable:
        ranks *= 2
    out.append(f"more ranks: FSDP over about {ranks} devices shards the {format_bytes(states)} of parameters, gradients and optimizer state")
    if isinstance(batch_size, int) and batch_size > 1:
        out.append(f"a smaller batch with gradient accumulation: batch 1 x {batch_size} accumulation steps keeps the global batch")
    out.append(f"a shorter sequence than {seq_len} (activations grow linearly with it)")
    return out
