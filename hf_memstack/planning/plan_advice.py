"""What the planner tells the user beside its choice: how to run the chosen policy's optimizer
rungs, and - when nothing fits - what would (more ranks, adapters, a smaller batch, a shorter sequence)."""

from __future__ import annotations

from typing import Literal

from ..policy import MemoryPolicy
from ..sizes import format_bytes
from .memory_estimate import MemoryEstimate
from .plan_estimates import Estimates

__all__ = ["optimizer_notes", "suggestions"]


def optimizer_notes(policy: MemoryPolicy) -> list[str]:
    notes = []
    if policy.quant.mode == "nf4":
        notes.append(
            "quant:nf4 keeps the blocks' frozen linear weights in 4 bits (torchao's NF4, about 4.1 bits each): the "
            "adapters train on the rounded weights; save the adapters, and merge them into a 16-bit model with "
            "hf_memstack.merge_adapters"
        )
    if policy.optimizer != MemoryPolicy().optimizer or policy.master_weights == "bf16":
        notes.append(
            "build the optimizer with hf_memstack.make_optimizer(model, lr=...): it follows the policy's optimizer rung"
        )
    if policy.optimizer.step == "in_backward":
        notes.append(
            "optim:in_backward updates each parameter inside the backward: no gradient accumulation and no "
            "global-norm clipping (make_optimizer refuses them)"
        )
    if policy.optimizer.state == "8bit":
        notes.append(
            "optim:8bit keeps AdamW's moments in 8 bits (torchao): slightly different updates, a slower step on CPUs"
        )
    if policy.master_weights == "bf16":
        notes.append(
            "weights:bf16 trains pure bf16 (weights, gradients and moments; hf_memstack's BF16AdamW with stochastic rounding, "
            "so that updates below bf16's resolution survive in expectation): 8 bytes per trainable parameter instead "
            "of 16; see bench/optimizer_curves.py for its loss curve beside fp32 master weights"
        )
    return notes


def suggestions(
    est: Estimates,
    closest: str,
    batch_size: int | Literal["max"],
    seq_len: int,
    world_size: int,
    usable: float,
    *,
    trainable: str = "all",
) -> list[str]:
    """What would make ``closest`` (the rung that came nearest to fitting) fit: more ranks for its
    model states, adapters instead of a full fine-tune, a smaller batch, a shorter sequence - with
    numbers from its batch-1 estimate. When the model states alone are over the budget, only what
    shrinks them is said (a shorter sequence or a smaller batch cannot help)."""
    base = est(closest, 1)
    states = base.parameters + base.gradients + base.optimizer
    activations = base.peak_bytes - states
    out = []
    states_over = states > usable
    if states_over:
        out.append(
            f"the weights, gradients and optimizer state of {closest} alone are {format_bytes(states)}, over the "
            f"{format_bytes(usable)} usable: no activation rung, smaller batch or shorter sequence can fit; shrink "
            "the model states"
        )
    ranks = max(2, world_size * 2)
    while ranks <= 4096 and states / ranks + activations > usable:
        ranks *= 2
    if ranks <= 4096:
        out.append(
            f"more ranks: FSDP over about {ranks} devices shards the {format_bytes(states)} of parameters, gradients and "
            f"optimizer state of {closest}"
        )
    else:  # what is not sharded (the activations) alone exceeds the budget: more ranks cannot help
        out.append(
            f"the activations alone ({format_bytes(activations)} at batch 1) exceed the budget: more ranks "
            "do not shard them"
        )
    if trainable == "all":
        out.append(
            "train LoRA adapters instead of every weight (trainable='lora', --trainable lora): the frozen base holds no "
            "gradients and no optimizer state"
        )
    if states_over:
        return out
    if isinstance(batch_size, int) and batch_size > 1:
        out.append(
            f"a smaller batch with gradient accumulation: batch 1 x {batch_size} accumulation steps keeps the global batch"
        )
    shorter = _shorter_sequence(est, closest, base, seq_len, usable)
    if shorter is not None:
        out.append(
            f"a shorter sequence: {shorter.seq_len} tokens instead of {seq_len} fits at batch 1 with {closest} "
            f"(estimated peak {format_bytes(shorter.peak_bytes)})"
        )
    else:
        out.append(f"a shorter sequence than {seq_len} (activations grow linearly with it)")
    return out


def _shorter_sequence(
    est: Estimates, policy: str, full: MemoryEstimate, seq_len: int, usable: float
) -> MemoryEstimate | None:
    """The estimate of the longest sequence (a multiple of 64, or of 8 below 256) that fits at
    batch 1, found on the line through the forward+backward peaks at ``seq_len`` and half of it
    (the optimizer step's peak does not depend on the sequence), then confirmed by estimating it;
    None when the line finds none or three tries do not fit."""
    if seq_len < 16:
        return None
    half = Estimates(est.config, **{**est.job, "seq_len": seq_len // 2})(policy, 1)
    slope = (full.forward_backward_peak - half.forward_backward_peak) / (seq_len - seq_len // 2)
    if slope <= 0:
        return None
    tokens = int((usable - (full.forward_backward_peak - slope * seq_len)) / slope)
    for _ in range(3):
        tokens = min(tokens, seq_len - 1)
        tokens = tokens // 64 * 64 if tokens >= 256 else tokens // 8 * 8
        if tokens < 8:
            return None
        guess = Estimates(est.config, **{**est.job, "seq_len": tokens})(policy, 1)
        if guess.peak_bytes <= usable:
            return guess
        tokens = int(tokens * 0.9)
    return None
