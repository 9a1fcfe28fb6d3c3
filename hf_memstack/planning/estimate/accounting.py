"""The traced step accounted as one rank's estimate: FSDP's shards taken off the model states,
eval's kept logits added, and a note on the dtypes the weights were counted at."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...measure.memory import StepMemory
from ...policy import MemoryPolicy
from ...sizes import format_bytes
from .result import MemoryEstimate
from .weights_dtype import WeightsDtype, short_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["dtype_note", "per_rank", "with_kept_logits"]


def with_kept_logits(est: MemoryEstimate, counts: dict[str, int], samples: int) -> MemoryEstimate:
    """The eval estimate: the forward's peak, nothing saved for a backward, and the outputs kept for ``samples``."""
    per_sample, per_sample_host = counts["kept"] // est.batch_size, counts["kept_host"] // est.batch_size
    kept = per_sample * samples
    note = (
        f"eval: Trainer.evaluate() with compute_metrics (and predict()) keeps {format_bytes(kept)} of logits for {samples} samples "
        f"on the device until the loop ends: its peak there is about {format_bytes(est.peak_bytes + kept)} (the forward's peak "
        "plus them; concatenating a batch copies what is kept so far). prediction_loss_only=True keeps none, "
        "eval_accumulation_steps=N moves them to host memory every N batches, preprocess_logits_for_metrics="
        f"lambda logits, labels: logits.argmax(-1) keeps one id a token; in host memory they take {format_bytes(per_sample_host * samples)}"
    )
    return dataclasses.replace(
        est,
        mode="eval",
        peak_phase="forward",
        activations=0,
        temporaries=est.activations + est.temporaries,
        forward_backward_peak=est.peak_bytes,
        eval_samples=samples,
        eval_logits_bytes=kept,
        eval_logits_host_bytes=per_sample_host * samples,
        notes=(*est.notes, note),
    )


def dtype_note(weights: WeightsDtype, net: nn.Module, policy: MemoryPolicy, *, training: bool = True) -> str:
    """The weights' dtype, where it came from, and (training) what trains in which dtype."""
    trainable = sorted({short_name(p.dtype) for p in net.parameters() if p.requires_grad and p.is_floating_point()})
    frozen = sorted({short_name(p.dtype) for p in net.parameters() if not p.requires_grad and p.is_floating_point()})
    held = f"trainable parameters {'/'.join(trainable) or 'none'}" + (f", frozen {'/'.join(frozen)}" if frozen else "")
    note = (
        f"weights counted in {weights.name} ({weights.source}): {held}; pass dtype= (--dtype) to estimate another load"
    )
    if training and policy.master_weights == "bf16":
        note += ". Pure bf16 (weights:bf16): the trainable weights, their gradients and AdamW's moments in bf16, updated with stochastic rounding"
    elif training and policy.precision != "fp32" and weights.dtype != torch.float32:
        # prepare_model casts the 16-bit trainable weights to fp32 master weights (policy.master_weights='fp32').
        note += (
            ". prepare_model casts 16-bit trainable weights to fp32 master weights (weights:fp32, counted here); "
            "'weights:bf16' keeps them in bf16 with stochastic rounding (8 bytes per trainable parameter instead of 16)"
        )
    return note


def per_rank(
    m: StepMemory,
    net: nn.Module,
    policy: MemoryPolicy,
    world: int,
    config: PretrainedConfig,
    batch: int,
    seq: int,
    trainable: int,
    total: int,
    notes: list[str],
    model: object,
) -> MemoryEstimate:
    # The step as one rank holds it: under FSDP the trace was accounted part by part (fsdp_shards.py).
    params, grads, opt = m.parameters, m.gradients, m.optimizer
    # What the peak holds beyond the model states: activations and temporaries (logits, their gradients, buffers).
    rest = max(0, m.peak_bytes - params - grads - opt)
    if policy.fsdp.mode != "none" and world > 1 and policy.fsdp.cpu_offload:
        notes.append("fsdp cpu_offload: sharded parameters, gradients and optimizer state live in host memory")
    fb_peak = m.forward_backward_peak
    name = getattr(config, "_name_or_path", "") or type(net).__name__
    return MemoryEstimate(
        model=str(model) if isinstance(model, (str, Path)) else name,
        policy=policy.to_string(),
        batch_size=batch,
        seq_len=seq,
        world_size=world,
        parameters=params,
        gradients=grads,
        optimizer=opt,
        activations=min(m.saved_activations, rest),
        temporaries=rest - min(m.saved_activations, rest),
        peak_bytes=params + grads + opt + rest,
        peak_phase=m.peak_phase,
        forward_backward_peak=fb_peak,
        trainable_parameters=trainable,
        total_parameters=total,
        notes=tuple(notes),
    )
