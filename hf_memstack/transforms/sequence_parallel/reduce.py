"""How a sequence-parallel step's loss and gradients are reduced, under DDP, FSDP2, Accelerate or none.

Each rank of a sequence group (``sp:N``: N contiguous ranks holding slices of the same rows) computes
its tokens' share of the group's loss: the sum of its tokens' losses over the count of the group's
labelled tokens (``shard_batch``'s ``num_items_in_batch``). The group's loss is the SUM of its ranks'
losses, so its gradient is the SUM of theirs. DDP, FSDP2 (full_shard over the flattened dp x sp ranks,
which with SP innermost is every rank in rank order, and hybrid_shard) and Accelerate all AVERAGE
gradients over the W = dp * N ranks. Backpropagating N x the loss (:func:`backward_loss`) turns that
average into the sum over each group averaged over the dp groups, on every mesh and backend, with no
extra collective and nothing set on the FSDP modules. (The other way, FSDP2's
``set_gradient_divide_factor`` with ``set_force_sum_reduction_for_comms`` - gloo has no PREMUL_SUM -
must be set on every ``fully_shard``'ed module and covers FSDP alone; both give the unsharded step's
gradients on 2 gloo ranks, tests/distributed/test_sequence_parallel_reduce.py.)

A model that nothing wraps (no DDP, no FSDP) in a group of several ranks averages its gradients with
:func:`average_gradients` after the backward, as DDP would have. The loss to report is
:func:`reported_loss`: the group's sum, averaged over the dp groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...distributed._ranks import runs_collectives, world_size
from ...record import record_of

__all__ = ["average_gradients", "backward_loss", "reported_loss", "sequence_parallel_size"]


def sequence_parallel_size(model: nn.Module) -> int:
    """N of the ``sp:N`` policy ``model`` was prepared with (through DDP, compile, PEFT wrappers); 1 without it."""
    record = record_of(model)
    if record is None:
        return 1
    return int(record.policy.sequence_parallel.size)


def backward_loss(loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The loss to backpropagate: N x this rank's loss under ``sp:N`` (``loss`` itself otherwise).

    DDP, FSDP2 and Accelerate average gradients over every rank; the sequence group's gradient is the
    sum of its N ranks', which the scaled loss makes that average give (see the module's docstring).
    For a model nothing wraps, :func:`average_gradients` after the backward does the averaging."""
    n = sequence_parallel_size(model)
    return loss * n if n > 1 else loss


def average_gradients(model: nn.Module) -> None:
    """After the backward of :func:`backward_loss`, average the gradients over every rank as DDP
    would (one all-reduce of all of them, flattened) - for a model neither DDP nor FSDP wraps, in a
    group of several ranks. Does nothing on one rank or for a model whose step already reduces
    (DDP, FSDP2): a second reduction would scale its gradients by the world size."""
    world = world_size()
    if world == 1 or runs_collectives(model):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    # One flat buffer per dtype: one collective each, not one per parameter.
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in same:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def reported_loss(loss: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The step's loss to log, equal to the unsharded step's: each sequence group's sum over its
    ranks, averaged over the dp groups (one all-reduce over every rank), detached. Without ``sp:N``
    (or on one rank) the loss averaged over the ranks, as a data-parallel run logs it."""
    value = loss.detach().float().clone()
    world = world_size()
    if world == 1:
        return value
    dist.all_reduce(value)
    # sum over all W ranks = sum over dp groups of each group's sum; dp = W / N
    return value * sequence_parallel_size(model) / world
