"""verify's ``sequence parallel`` line: the sharded step's loss and gradients against the same step unsharded.

Every rank of a sequence group passes verify the same whole rows. The sharded step is what a training
loop runs: this rank's slice (``shard_batch``), the model's loss backpropagated through
:func:`~.reduce.backward_loss` and reduced as :mod:`.reduce` says. The reference is the same step on
the whole rows with the attention unsharded (``shard_batch`` with one rank: the same shifted labels and
token count), its gradients reduced as the model's wrapper (DDP, FSDP2) or :func:`~.reduce.average_gradients`
reduce them. Every rank runs both (under FSDP2 the reference holds collectives too) and compares its own
gradients (its shards under FSDP2); one all-reduce gives every rank the largest differences, so all
ranks print the same line and agree on its verdict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ...distributed._ranks import world_size
from ...record import record_of, unwrap_model
from .attention import ULYSSES_ATTENTION
from .reduce import average_gradients, backward_loss, reported_loss, sequence_parallel_size
from .shard import shard_batch

__all__ = ["dropout_off", "shard_for_rank", "unsharded_attention", "verify_sequence_parallel"]

# fp32: the same sums in another order (the all-to-all splits the heads, the loss is summed over ranks);
# bf16/fp16: their rounding, as verify's packing line allows.
_FP32_TOLERANCE = 1e-3
_MIXED_TOLERANCE = 5e-2


def shard_for_rank(model: nn.Module, batch: dict[str, object]) -> dict[str, object]:
    """This rank's slice of ``batch`` under the model's ``sp:N`` (its rank in its group of N contiguous ranks)."""
    n = sequence_parallel_size(model)
    rank = dist.get_rank() if world_size() > 1 else 0
    return dict(shard_batch(batch, sp_rank=rank % n, sp_size=n))


def verify_sequence_parallel(
    model: nn.Module, batch: dict[str, object], params: list[nn.Parameter], *, mixed: bool
) -> tuple[bool, str]:
    """Run the sharded step and the unsharded one on ``batch`` (the group's whole rows); compare.
    Leaves the parameters' gradients at None (verify restores the caller's afterwards)."""
    # Dropout off for both: its masks differ between a rank's slice and the whole rows (a model trained
    # with attention_dropout=0.1 differed by 1.6e-3 in the loss), and only the arithmetic is compared.
    with dropout_off(model):
        sharded_loss, sharded = _step(model, shard_for_rank(model, batch), params, unsharded=False)
        reference_loss, reference = _step(model, _whole(batch), params, unsharded=True)
    scale = max((float(g.abs().max()) for g in reference if g.numel()), default=0.0)
    dgrad = max((float((a - b).abs().max()) for a, b in zip(sharded, reference) if a.numel()), default=0.0)
    dloss = abs(float(sharded_loss) - float(reference_loss))
    ranks = torch.tensor([dloss, dgrad, scale], dtype=torch.float64, device=sharded_loss.device)
    if world_size() > 1:  # every rank reports the largest differences and the same verdict
        dist.all_reduce(ranks, op=dist.ReduceOp.MAX)
    dloss, dgrad, scale = (float(v) for v in ranks)
    tolerance = _MIXED_TOLERANCE if mixed else _FP32_TOLERANCE
    loss_ok = dloss <= tolerance * max(1.0, abs(float(reference_loss)))
    grads_ok = dgrad <= tolerance * max(scale, 1e-12)
    n = sequence_parallel_size(model)
    detail = (
        f"sp:{n}: the sharded step's loss {float(sharded_loss):.6g} against the unsharded step's "
        f"{float(reference_loss):.6g} (|difference| {dloss:.2e}); its gradients' largest |difference| {dgrad:.2e} "
        f"against a largest |gradient| {scale:.2e} ({len(params)} tensors, tolerance {tolerance:g} relative; "
        "dropout off for both)"
    )
    if not (loss_ok and grads_ok):
        detail += (
            ". The sharded step computes another loss than the model: check that every rank of a sequence group "
            "got the same rows (rows of the same shape are not caught before this line), that the loop shards them "
            "with shard_batch and backpropagates backward_loss(loss, model), and that nothing changed the model "
            "after prepare_model (its attention implementation; a config made bidirectional, given a router loss or "
            "a sequence-dependent RoPE, which prepare_model refuses under sp:N)"
        )
    return loss_ok and grads_ok, detail


def _whole(batch: dict[str, object]) -> dict[str, object]:
    """The whole rows as one rank of one: the same shifted labels, global positions and token count."""
    return dict(shard_batch(batch, sp_rank=0, sp_size=1))


def _step(
    model: nn.Module, batch: dict[str, object], params: list[nn.Parameter], *, unsharded: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward, reduced as training reduces it: the reported loss and each
    parameter's gradient (its local shard under FSDP2)."""
    for p in params:
        p.grad = None
    if unsharded:
        # The backward inside too: checkpointed blocks run their forward again there.
        with unsharded_attention(model):
            loss = model(**batch).loss
            loss.backward()  # the whole rows on every rank: DDP/FSDP's average over the ranks is the dp average
        average_gradients(model)
        reported = loss.detach().float().clone()
        if world_size() > 1:
            dist.all_reduce(reported)
            reported /= world_size()
    else:
        loss = model(**batch).loss
        backward_loss(loss, model).backward()
        average_gradients(model)
        reported = reported_loss(loss, model)
    grads = [_local(p.grad) for p in params]
    for p in params:
        p.grad = None
    return reported, grads


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Every ``nn.Dropout`` at p=0 and every module's float ``attention_dropout``/``dropout`` (what
    Transformers' attention modules pass the attention function in training) at 0, restored afterwards."""
    saved: list[tuple[nn.Module, str, float]] = []
    for module in model.modules():
        for attr in ("p",) if isinstance(module, nn.Dropout) else ("attention_dropout", "dropout"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value:
                saved.append((module, attr, value))
                setattr(module, attr, 0.0)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


@contextlib.contextmanager
def unsharded_attention(model: nn.Module) -> Iterator[None]:
    """The model's attention as it was before ``sp:N`` (``record.sequence_parallel.previous``), for the
    reference step on the whole rows; switched back to Ulysses afterwards, whatever happened."""
    record = record_of(model)
    previous = record.sequence_parallel.previous if record is not None else None
    inner = unwrap_model(model)
    if previous is None:  # nothing was switched: the model attends unsharded already
        yield
        return
    inner.set_attn_implementation(previous)  # type: ignore[operator]
    try:
        yield
    finally:
        inner.set_attn_implementation(ULYSSES_ATTENTION)  # type: ignore[operator]


def _local(grad: torch.Tensor | None) -> torch.Tensor:
    if grad is None:
        return torch.zeros(0)
    to_local = getattr(grad, "to_local", None)  # a DTensor's shard under FSDP2
    return (to_local() if to_local is not None else grad).detach().float().clone()
