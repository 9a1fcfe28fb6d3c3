"""When the planner offers sequence parallelism (``sp:N``), and which degrees.

Sequence parallelism divides what scales with the sequence by N at the cost of four all-to-alls a
block each way. The planner offers it only where the activation rungs of one device cannot: several
ranks, a causal LM (packed rows or not: the estimator traces both), and the heaviest activation rung
of one device (every block checkpointed, the tiled MLP, the chunked loss) over the budget even with
the model states sharded over every rank - then no rung without it fits, and FSDP alone would not
help. The degrees: every N >= 2 that divides the world size (groups of contiguous ranks) and the
attention heads (each rank gets H/N of them), smallest first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from ..estimate.sequence_shards import heads_of
from .estimates import Estimates
from .rungs import Requirement, RungContext, rungs_for

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["sp_context", "sp_degrees"]


def sp_degrees(config: PretrainedConfig, world_size: int) -> tuple[int, ...]:
    """Every N >= 2 dividing ``world_size`` and the model's attention heads, ascending."""
    shape = heads_of(config)
    if shape is None:
        return ()
    return tuple(n for n in range(2, world_size + 1) if world_size % n == 0 and shape[0] % n == 0)


def sp_context(
    context: RungContext,
    config: PretrainedConfig,
    est: Estimates,
    *,
    task: str,
    world_size: int,
    batch_size: int | Literal["max"],
    usable: float,
) -> RungContext:
    """``context`` with sequence parallelism's fact and degrees stated where the job needs it (one
    estimate of the heaviest activation rung, which the walk reuses)."""
    degrees = sp_degrees(config, world_size) if task == "causal-lm" else ()
    heaviest = [r for r in rungs_for(context) if r.step in ("full", "tiled_mlp")]
    if not degrees or not heaviest:
        return context
    e = est(heaviest[-1].policy, 1 if batch_size == "max" else int(batch_size))
    states = e.parameters + e.gradients + e.optimizer
    if e.forward_backward_peak - states + states / world_size <= usable:
        return context  # the activations fit one device: FSDP (or nothing) is what the job needs
    return dataclasses.replace(
        context, satisfied=context.satisfied | {Requirement.SEQUENCE_OVER_ONE_DEVICE}, sp_degrees=degrees
    )
