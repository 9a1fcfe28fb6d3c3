"""A lower bound of the bytes a policy's model states hold at every moment of a step - the weights
and the optimizer's moments - counted on the model built on meta, without a trace.

The planner skips every rung whose weights and moments alone exceed the budget: whatever a rung
saves of the activations cannot bring the peak below them. A traced estimate gives that floor
exactly, but a plan then spends a trace (two shallow ones) to learn that a full fine-tune of a
Qwen2-1.5B holds 18.5 GB of fp32 master weights and moments before its first activation. The
parameters' count and dtypes give it for the price of one meta build.

A bound, not an estimate: what is not known without the trace counts 0 - LoRA's adapters and their
moments (a frozen base in its dtype stays), 4-bit base weights (no bound: None), buffers - so a rung
skipped here could never have fit, and a rung kept is traced as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from ...policy import MemoryPolicy
from ..estimate import build_cache
from ..model.config import build_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["parameter_count", "states_floor"]

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def states_floor(
    config: PretrainedConfig,
    policy: MemoryPolicy,
    *,
    task: str,
    dtype: torch.dtype,
    trains_all: bool,
    world_size: int = 1,
    optimizer: str = "adamw",
) -> int | None:
    """Bytes no rank goes below during a step under ``policy``: parameters (trainable ones in the
    dtype ``prepare_model`` leaves them in: fp32 master weights under a mixed precision, bf16 under
    ``weights:bf16``) and buffers, plus AdamW's two moments of each trainable parameter (in its dtype, one byte
    each with ``optim:8bit``), divided across ``world_size`` under FSDP. ``trains_all`` False (a
    LoRA run): the frozen base alone. None where no bound is known (4-bit base weights)."""
    if policy.quant.mode != "none":
        return None
    # "auto" may resolve to fp32 (a CPU): no master-weight cast then, the smaller count.
    mixed = policy.precision in ("bf16", "fp16")
    by_dtype, weights = _counts(config, task, dtype)  # the buffers first
    moments = 0
    for param_dtype, numel in by_dtype.items():
        if not trains_all:
            weights += numel * param_dtype.itemsize  # the frozen base as loaded; the adapters count 0
            continue
        kept = _trained_dtype(param_dtype, policy.master_weights, mixed)
        weights += numel * kept.itemsize
        if optimizer == "adamw":
            moments += 2 * numel * (1 if policy.optimizer.state == "8bit" else kept.itemsize)
    shards = world_size if policy.fsdp.mode != "none" and world_size > 1 else 1
    return (weights + moments) // shards


def parameter_count(config: PretrainedConfig, *, task: str, dtype: torch.dtype) -> int:
    """The model's floating parameters (a tied one once), from the same meta build as :func:`states_floor`."""
    return sum(_counts(config, task, dtype)[0].values())


def _trained_dtype(dtype: torch.dtype, master_weights: str, mixed: bool) -> torch.dtype:
    """A trainable floating parameter's dtype after prepare_model (transforms/precision/master_weights.py):
    bf16 under pure bf16; fp32 for a 16-bit one under a mixed precision; else as loaded."""
    if master_weights == "bf16":
        return torch.bfloat16
    return torch.float32 if (dtype in _SIXTEEN_BIT and mixed) else dtype


def _counts(config: PretrainedConfig, task: str, dtype: torch.dtype) -> tuple[Counter[torch.dtype], int]:
    """The model's floating parameters (a tied one once) counted by dtype, as ``from_pretrained``
    in ``dtype`` builds them, and its buffers' bytes (the rotary tables: held, with no moments);
    built on meta once per config, task and dtype."""

    def count() -> tuple[Counter[torch.dtype], int]:
        with torch.device("meta"):
            net = build_model(config, task, dtype=dtype)
        counts: Counter[torch.dtype] = Counter()
        for p in net.parameters():
            if p.is_floating_point():
                counts[p.dtype] += p.numel()
        return counts, sum(b.numel() * b.element_size() for b in net.buffers())

    key: tuple[Hashable, ...] = (*build_cache.config_key(config), task, str(dtype))
    return build_cache.cached("parameter_counts", key, count)
