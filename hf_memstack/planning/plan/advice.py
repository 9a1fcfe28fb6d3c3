"""What the planner tells the user beside its choice: how to run the chosen policy's optimizer
rungs, and - when nothing fits - what would (more ranks, adapters, a smaller batch, a shorter sequence)."""

from __future__ import annotations

from typing import Literal

from ...policy import MemoryPolicy
from ...sizes import format_bytes
from ..estimate.result import MemoryEstimate
from .estimates import Estimates
from .sequence_rungs import sp_degrees

__all__ = ["more_ranks", "optimizer_notes", "suggestions"]


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
    trainable: object = "all",
    sharded: str | None = None,
) -> list[str]:
    """What would make ``closest`` (the rung that came nearest to fitting) fit: more ranks for the
    model states, adapters instead of a full fine-tune, a smaller batch, a shorter sequence - with
    numbers from batch-1 estimates, each of the rung it names. When the model states alone are over
    the budget, only what shrinks them is said (a shorter sequence or a smaller batch cannot help).
    More ranks are said with ``sharded`` (the planner gives the ladder's FSDP rung; default: ``closest``
    sharded), estimated at the number of ranks advised."""
    base = est(closest, 1)
    states = base.parameters + base.gradients + base.optimizer
    out = []
    states_over = states > usable
    if states_over:
        out.append(
            f"the weights, gradients and optimizer state of {closest} alone are {format_bytes(states)}, over the "
            f"{format_bytes(usable)} usable: no activation rung, smaller batch or shorter sequence can fit; shrink "
            "the model states"
        )
    out.append(more_ranks(est, sharded or _sharded(closest), world_size, usable))
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


_MAX_RANKS = 4096
_TRIES = 3  # estimates at the number of ranks advised and its doublings, before saying none fits


def more_ranks(est: Estimates, sharded: str, world_size: int, usable: float) -> str:
    """More ranks for ``sharded`` (an FSDP policy), at batch 1: the number of ranks read off its
    estimate at twice ``world_size`` (what it holds per rank of the model states shrinks with the
    ranks, the rest does not), then confirmed by its estimate there - or why none is advised."""
    ranks = start = max(2, world_size * 2)
    try:
        probe = _at_ranks(est, sharded, start)
    except ValueError as refused:  # a shape the ranks do not divide (4-bit weights), ...
        return f"more ranks: FSDP over {start} devices is refused for {sharded}: {refused}"
    per_rank = probe.parameters + probe.gradients + probe.optimizer
    rest = probe.peak_bytes - per_rank  # activations and scratch: each rank holds its own
    if rest > usable:
        return _more_sequence_ranks(est, sharded, world_size, usable) or (
            f"the activations of {sharded} alone ({format_bytes(rest)} at batch 1) exceed the budget: more ranks "
            "do not shard them"
        )
    while ranks < _MAX_RANKS and per_rank * start / ranks + rest > usable:
        ranks *= 2
    last = probe
    for _ in range(_TRIES):
        if ranks > _MAX_RANKS:
            break
        try:
            last = probe if ranks == start else _at_ranks(est, sharded, ranks)
        except ValueError as refused:
            return f"more ranks: FSDP over {ranks} devices is refused for {sharded}: {refused}"
        if last.peak_bytes <= usable:
            return (
                f"more ranks: FSDP over {ranks} devices (--world-size {ranks}) with {sharded} holds "
                f"{format_bytes(last.parameters + last.gradients + last.optimizer)} of parameters, gradients and "
                f"optimizer state per rank, an estimated peak of {format_bytes(last.peak_bytes)} at batch 1"
            )
        ranks *= 2
    return (
        f"more ranks: FSDP over {last.world_size} devices with {sharded} is still estimated at "
        f"{format_bytes(last.peak_bytes)} per rank at batch 1, over the {format_bytes(usable)} usable"
    )


def _more_sequence_ranks(est: Estimates, sharded: str, world_size: int, usable: float) -> str | None:
    """More ranks that shard the sequence further (sp:N over them, N dividing the heads) for activations
    no FSDP sharding divides, at batch 1: the fewest of 2, 4 and 8 times ``world_size`` that fits; None
    where the ladder offered no sequence parallelism (``sharded`` has none: one device, short rows)."""
    policy = MemoryPolicy.coerce(sharded)
    if policy.sequence_parallel.size == 1:
        return None
    for ranks in (world_size * 2, world_size * 4, world_size * 8):
        if ranks not in sp_degrees(est.config, ranks):
            continue
        wider = MemoryPolicy.from_dict({**policy.to_dict(), "sequence_parallel": {"size": ranks}}).to_string()
        last = _at_ranks(est, wider, ranks)
        if last.peak_bytes <= usable:
            return (
                f"more ranks: sequence parallelism over {ranks} devices (--world-size {ranks}) with {wider}: "
                f"{last.sp_tokens_per_rank} tokens per rank, an estimated peak of {format_bytes(last.peak_bytes)} at batch 1"
            )
    return None


def _at_ranks(est: Estimates, policy: str, ranks: int) -> MemoryEstimate:
    return Estimates(est.config, **{**est.job, "world_size": ranks})(policy, 1)


def _sharded(policy: str) -> str:
    """``policy`` sharded with FSDP (full_shard), its checkpointing kept - offloaded checkpointing,
    which FSDP refuses, as every block checkpointed."""
    d = MemoryPolicy.coerce(policy).to_dict()
    if d["checkpointing"]["mode"] == "offload":
        d["checkpointing"]["mode"] = "full"
    if d["fsdp"]["mode"] == "none":
        d["fsdp"] = {**d["fsdp"], "mode": "full_shard"}
    return MemoryPolicy.from_dict(d).to_string()


def _shorter_sequence(
    est: Estimates, policy: str, full: MemoryEstimate, seq_len: int, usable: float
) -> MemoryEstimate | None:
    """The estimate of the longest sequence (a multiple of 64, or of 8 below 256) that fits at
    batch 1, found on the line through the forward+backward peaks at ``seq_len`` and half of it
    (the optimizer step's peak does not depend on the sequence), then confirmed by estimating it;
    None when the line finds none or three tries do not fit."""
    if seq_len < 16:
        return None
    try:
        half = Estimates(est.config, **{**est.job, "seq_len": seq_len // 2})(policy, 1)
    except ValueError:  # a vision-language model's image tokens alone take more than half the sequence
        return None
    slope = (full.forward_backward_peak - half.forward_backward_peak) / (seq_len - seq_len // 2)
    if slope <= 0:
        return None
    tokens = int((usable - (full.forward_backward_peak - slope * seq_len)) / slope)
    for _ in range(3):
        tokens = min(tokens, seq_len - 1)
        tokens = tokens // 64 * 64 if tokens >= 256 else tokens // 8 * 8
        if tokens < 8:
            return None
        try:
            guess = Estimates(est.config, **{**est.job, "seq_len": tokens})(policy, 1)
        except ValueError:  # shorter than the image tokens of a sample
            return None
        if guess.peak_bytes <= usable:
            return guess
        tokens = int(tokens * 0.9)
    return None
