"""Predicting a step before it runs: the estimator, the model it traces, and the planner.

estimate/  estimate_memory: the real prepare_model and step traced on fake tensors, one rank's peak
model/     the model an estimate is of: its config, the model on the meta device and on fake tensors,
           a VLM's pixel inputs (it borrows estimate/'s trainable and dtype helpers: the two folders are
           one layer, split by job)
plan/      plan_policy: the cheapest rung of the ladder that fits a budget; the rungs themselves
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .estimate.estimator import estimate_memory
    from .estimate.result import MemoryEstimate
    from .plan.planner import plan_policy
    from .plan.result import Plan

# public name -> the module that defines it
_EXPORTS = {
    "MemoryEstimate": ".estimate.result",
    "estimate_memory": ".estimate.estimator",
    "Plan": ".plan.result",
    "plan_policy": ".plan.planner",
}

__all__ = [
    "MemoryEstimate",
    "Plan",
    "estimate_memory",
    "plan_policy",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
