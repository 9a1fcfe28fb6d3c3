"""The check at the top of every ``sp:N`` forward (a forward pre-hook on the model): the ranks of a
sequence group got batches of the same shape, and the call asks for no router loss.

Ranks given different widths would hang or abort inside the first all-to-all (gloo: "Received data
size doesn't match expected size"); this gathers ``[rows, width]`` once per forward (not per layer)
and raises the same message on every rank. Different rows of the same shape cannot be told apart
here (each rank holds another slice of its rows): verify's ``sequence parallel`` line catches them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from .attention import ULYSSES_ATTENTION, _is_fake, active_group

__all__ = ["check_group_batch", "install_forward_guard"]


def install_forward_guard(model: nn.Module) -> RemovableHandle:
    """Register :func:`_guard` on ``model`` (the unwrapped Transformers model) as a forward pre-hook."""
    return model.register_forward_pre_hook(_guard, with_kwargs=True)


def _guard(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if getattr(getattr(module, "config", None), "_attn_implementation", None) != ULYSSES_ATTENTION:
        return  # verify's unsharded reference step: the whole rows on every rank, nothing exchanged
    if kwargs.get("output_router_logits"):
        raise ValueError(
            "sequence parallelism: the forward was called with output_router_logits=True: the router's "
            "load-balancing loss is a product of means over the whole rows' tokens, and each rank holds a slice; "
            "call the model without it (output_router_logits=False) under sp:N"
        )
    tokens = next(
        (t for t in (*args[:1], kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if torch.is_tensor(t)), None
    )
    if tokens is None or tokens.dim() < 2 or _is_fake(tokens):
        return  # nothing to compare (the attention refuses what it cannot shard), or the estimator's fake trace
    check_group_batch(tuple(tokens.shape[:2]), tokens.device)


@torch.compiler.disable  # a collective and a Python comparison: eager, outside any compiled graph
def check_group_batch(shape: tuple[int, ...], device: torch.device) -> None:
    """All-gather this rank's ``(rows, width)`` over the sequence group; raise on every rank when they differ."""
    sp = active_group()
    if sp.group is None:  # a shapes-only group (the estimator): no peers to ask
        return
    mine = torch.tensor(shape, dtype=torch.int64, device=device)
    parts = [mine.clone() for _ in range(sp.size)]
    dist.all_gather(parts, mine, group=sp.group)
    shapes = [tuple(int(v) for v in p.tolist()) for p in parts]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(group_batch_message(shapes, sp.size))


def group_batch_message(shapes: list[tuple[int, ...]], n: int) -> str:
    """The message every rank raises: each rank's (rows, width), and how to feed a sequence group."""
    listed = ", ".join(f"rank {i} {s[0]} rows x {s[1]} tokens" for i, s in enumerate(shapes))
    return (
        f"sp:{n}: the ranks of a sequence group got slices of different shapes ({listed}; ranks within the group): "
        "every rank of a sequence group must get its slice of the same rows - "
        f"shard_batch(batch, sp_rank=rank % {n}, sp_size={n}) on the same batch; give the group's ranks the same "
        f"rows (a sampler keyed by rank // {n})"
    )
