"""Predicting a step before it runs: the estimator, the planner and the ladder's memory rungs.

    estimate.py       estimate_memory: the real prepare_model and step, traced on fake tensors
    depth.py          a deep stack traced at two shallow depths and extrapolated, equal to the full trace
    build_cache.py    the fake model and depth plan, built once per config and job
    weights_dtype.py  the dtype from_pretrained would give the weights (dtype="auto")
    eval_logits.py    the outputs Trainer.evaluate() keeps
    rungs.py          the memory rungs the planner walks (and the finder points to), with measured speeds
    planner.py        plan_policy: the cheapest rung that fits a budget
"""

from __future__ import annotations

from .estimate import MemoryEstimate, estimate_memory
from .planner import Plan, plan_policy

__all__ = ["MemoryEstimate", "Plan", "estimate_memory", "plan_policy"]
