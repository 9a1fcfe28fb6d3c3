"""The exchanges of Ulysses sequence parallelism: the all-to-all that turns sequence-sharded q/k/v
into head-sharded ones (and back), and the all-gather of the position ids, each a
``torch.library.custom_op`` with a fake (shape) implementation and, for the all-to-all, its backward.

Why custom ops and not ``autograd.Function``s: ``torch.compile`` inlines an autograd Function whose
forward fills a preallocated buffer with a collective, and the traced graph's output then does not
depend on its input - the backward silently yields zero gradients (DeepSpeed's
``deepspeed/sequence/layer.py`` documents it and moved to an operator). An operator with a declared
backward is opaque to the tracer. Its fake implementation also gives shapes without a process group,
so the estimator can trace one rank of an ``sp:N`` step on fake tensors.

A process group cannot appear in an operator's schema: the ops take a group's name, and
:func:`register_group` maps the name back to the group (or, for shapes only, to nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SequenceParallelGroup", "gather_positions", "head_to_seq", "register_group", "seq_to_head"]


@dataclass(frozen=True, slots=True)
class SequenceParallelGroup:
    """One sequence-parallel group as the exchanges address it."""

    name: str
    """The key the ops look the group up by (the process group's ``group_name``)."""
    size: int
    """Ranks in the group (N of ``sp:N``)."""
    rank: int
    """This rank's place in the group: it holds tokens ``[rank * s, (rank + 1) * s)`` of each row."""
    group: dist.ProcessGroup | None
    """The process group; None for a shapes-only group (fake tensors: the estimator)."""


_GROUPS: dict[str, SequenceParallelGroup] = {}


def register_group(group: dist.ProcessGroup | None, *, size: int | None = None) -> SequenceParallelGroup:
    """Make ``group`` reachable by name from inside the ops (outside any compiled region). ``group``
    None with ``size``: a group of that size for fake tensors only (running a real exchange on it raises)."""
    if group is None:
        if size is None or size < 2:
            raise ValueError(f"register_group(None, size={size!r}): a shapes-only group needs size >= 2")
        entry = SequenceParallelGroup(name=f"hf_memstack_sp_shapes_{size}", size=size, rank=0, group=None)
    else:
        entry = SequenceParallelGroup(
            name=group.group_name, size=dist.get_world_size(group), rank=dist.get_rank(group), group=group
        )
    _GROUPS[entry.name] = entry
    return entry


def _process_group(name: str) -> dist.ProcessGroup:
    entry = _GROUPS.get(name)
    if entry is None or entry.group is None:
        raise RuntimeError(
            f"sequence parallelism: no process group registered as {name!r} (a shapes-only group runs on fake "
            "tensors only); prepare the model with an sp:N policy under torchrun"
        )
    return entry.group


@torch.library.custom_op("hf_memstack::sp_all_to_all", mutates_args=())
def _all_to_all(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (whose size is the group's): slice i goes to rank i."""
    x = x.contiguous()
    out = torch.empty_like(
        x
    )  # x is contiguous: empty_like keeps a permuted input's strides, the op writes memory order
    dist.all_to_all_single(out, x, group=_process_group(group_name))
    return out


@_all_to_all.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_to_all_context(ctx: object, inputs: tuple[torch.Tensor, str], output: torch.Tensor) -> None:
    ctx.group_name = inputs[1]  # type: ignore[attr-defined]


def _all_to_all_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # The exchange over dim 0 is its own transpose: rank j's slice i came from rank i's slice j.
    return _all_to_all(grad.contiguous(), ctx.group_name), None  # type: ignore[attr-defined]


torch.library.register_autograd("hf_memstack::sp_all_to_all", _all_to_all_backward, setup_context=_all_to_all_context)


@torch.library.custom_op("hf_memstack::sp_all_gather", mutates_args=())
def _all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[N, *x.shape]``: every rank's ``x``, in rank order (integer tensors: no gradient)."""
    group = _process_group(group_name)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


@_all_gather.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty((_GROUPS[group_name].size, *x.shape))


def seq_to_head(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[b, h, s, d]`` (this rank's s tokens, every head) -> ``[b, h/N, N*s, d]`` (its heads, every token)."""
    n = sp.size
    b, h, s, d = x.shape
    x = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # [N (the head group each rank gets), b, h/N, s, d]
    y = _all_to_all(x, sp.name)  # [N (the rank, i.e. the token chunk, each came from), b, h/N, s, d]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def head_to_seq(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """``[b, h/N, S, d]`` (this rank's heads, every token) -> ``[b, h, S/N, d]`` (its tokens, every head)."""
    n = sp.size
    b, hl, total, d = x.shape
    x = x.reshape(b, hl, n, total // n, d).permute(2, 0, 1, 3, 4)  # [N (the token chunk each rank gets), b, h/N, s, d]
    y = _all_to_all(x, sp.name)  # [N (the head group each came from), b, h/N, s, d]
    return y.permute(1, 0, 2, 3, 4).reshape(b, n * hl, total // n, d)


def gather_positions(positions: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """This rank's ``[b, s]`` position ids -> the whole rows' ``[b, N*s]`` (the ranks' chunks in order)."""
    gathered = _all_gather(positions.contiguous(), sp.name)  # [N, b, s]
    return gathered.permute(1, 0, 2).reshape(positions.shape[0], -1)
