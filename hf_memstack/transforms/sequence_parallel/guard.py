"""The check at the top of every ``sp:N`` forward (a forward pre-hook on the model): the ranks of a
sequence group got batches of the same shape, the call asks for no router loss, and no
``transformers.Trainer`` without hf_memstack's sequence-parallel hooks is feeding it.

A plain Trainer gives each process other whole rows; under ``sp:N`` each rank would then treat its
rows as its slice of rows it shares with its peers, and train on a wrong loss (silently, when the
shapes agree). It is found as the ``self`` of a frame above the forward (as the callback finds its
Trainer) and refused on every rank, before any exchange, unless ``add_memstack_callback`` (or
``MemstackCallback``) marked it (:data:`TRAINER_MARK`).

Ranks given different widths would hang or abort inside the first all-to-all (gloo: "Received data
size doesn't match expected size"); this gathers ``[rows, width]`` once per forward (not per layer)
and raises the same message on every rank. Different rows of the same shape cannot be told apart
here (each rank holds another slice of its rows): verify's ``sequence parallel`` line catches them.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from .attention import ULYSSES_ATTENTION, _is_fake, active_group

__all__ = ["TRAINER_MARK", "check_group_batch", "install_forward_guard"]

TRAINER_MARK = "_hf_memstack_sequence_parallel"
"""The attribute ``hf_memstack.integrations`` sets on a Trainer whose loader and batches it made sequence-parallel."""

_FRAMES = 64  # the Trainer's compute_loss is ~5-25 frames above the hook (DDP, PEFT, autocast wrappers)


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
    if tokens is not None and _is_fake(tokens):
        return  # the estimator's fake trace
    _refuse_unhooked_trainer()
    if tokens is None or tokens.dim() < 2:
        return  # nothing to compare (the attention refuses what it cannot shard)
    check_group_batch(tuple(tokens.shape[:2]), tokens.device)


@torch.compiler.disable  # frames and attributes: eager, outside any compiled graph
def _refuse_unhooked_trainer() -> None:
    """Raise when a ``transformers.Trainer`` (or a subclass: TRL's) runs this forward without the
    sequence-parallel hooks: the same decision on every rank, before any collective."""
    trainers = sys.modules.get("transformers.trainer")
    if trainers is None:
        return  # Transformers' Trainer was never imported: no Trainer can be calling
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, trainers.Trainer):
            if getattr(owner, TRAINER_MARK, None):
                return
            raise ValueError(trainer_message(type(owner).__name__, active_group().size))
        frame = frame.f_back


def trainer_message(cls: str, n: object) -> str:
    """What a Trainer run without the hooks is told (on every rank)."""
    return (
        f"sp:{n}: {cls} is training a sequence-parallel model without hf_memstack's hooks: its data loader gives each "
        "process other whole rows, while the ranks of a sequence group must each get their slice of the same rows, so "
        f"every rank would train on a wrong loss. Call hf_memstack.integrations.trainer.add_memstack_callback(trainer) "
        f"after building the {cls} (or pass callbacks=[MemstackCallback()] to it) before trainer.train(): they give the "
        "group's ranks the same rows and each rank its slice (shard_batch)"
    )


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
