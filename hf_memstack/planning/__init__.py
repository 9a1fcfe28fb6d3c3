"""Predicting a step before it runs: the estimator, the planner and the ladder's memory rungs.

estimate.py       estimate_memory: the real prepare_model and step, traced on fake tensors
memory_estimate.py  MemoryEstimate: the estimate's record and its summary line
estimate_trace.py   one job traced on fake tensors (train step or eval forward); the depths to trace
estimate_accounting.py  the trace as one rank's numbers: FSDP shards, eval's kept logits, the dtype note
estimate_checks.py  what it refuses before tracing (arguments, a model without blocks, the chunked loss's head)
model_config.py   the config and task from what was given; the model built from it
trainable.py      what trains: everything, LoRA, a PEFT config, or what a PEFT model says
fake_model.py     the model on fake tensors and the meter's step traced on it
depth.py          a deep stack traced at two shallow depths and extrapolated, equal to the full trace
build_cache.py    the fake model and depth plan, built once per config and job
weights_dtype.py  the dtype from_pretrained would give the weights (dtype="auto")
eval_logits.py    the outputs Trainer.evaluate() keeps
rungs.py          the memory rungs the planner walks (and the finder points to), with measured speeds
planner.py        plan_policy: the cheapest rung that fits a budget (the rung walk and its bounds)
plan.py           Plan and PlanRow: the answer, its table and its dict
plan_estimates.py each estimate traced once; a rung's largest batch
plan_advice.py    notes on the chosen policy; what would fit when nothing does
"""

from __future__ import annotations

from .estimate import MemoryEstimate, estimate_memory
from .planner import Plan, plan_policy

__all__ = ["MemoryEstimate", "Plan", "estimate_memory", "plan_policy"]
