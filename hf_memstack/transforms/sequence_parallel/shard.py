"""The data side of ``sp:N``: one full batch -> this rank's contiguous slice of every row, with what
the sharded step needs to compute the unsharded loss.

On the **full** rows, before slicing: the targets are shifted (``shift_labels[i] = labels[i + 1]``,
-100 at a row's end and before every sample that starts inside a row - a packed sample is not
predicted from the one before it); the position ids are the rows' own (``0..S-1``, or the packing's,
restarting per sample) - the attention rebuilds each sample from them; the labelled targets are
counted (``num_items_in_batch``), so each rank's loss is its own sum over the whole batch's count and
the ranks' losses add up to the unsharded loss (and their gradients too, summed over the group). A
row whose length N does not divide gets a tail of ``p`` pad tokens as a sample of its own (positions
``0..p-1``, targets -100): it attends to nothing before it and is never learnt, instead of a padding
mask that the exchange cannot carry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SequenceShardCollator", "drop_right_padding", "shard_batch"]

IGNORE_INDEX = -100


def shard_batch(batch: Mapping[str, Any], *, sp_rank: int, sp_size: int, pad_token_id: int = 0) -> dict[str, Any]:
    """This rank's slice of ``batch`` (``input_ids`` ``[rows, S]``, optional ``labels`` and packing's
    ``position_ids``; an ``attention_mask`` only if all ones): ``input_ids``, ``position_ids``,
    ``labels`` and ``shift_labels`` (both the shifted targets, contiguous: Transformers' loss views
    them flat), ``num_items_in_batch`` (the whole batch's labelled targets) - and no ``attention_mask``.
    Flags without a sequence (a bool, number, string or None: TRL's ``use_cache=False``) pass unchanged;
    other keys are refused (they would not be sliced)."""
    _check_arguments(batch, sp_rank, sp_size)
    ids = batch["input_ids"]
    rows, width = ids.shape
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(width, device=ids.device).expand(rows, -1)
    positions = positions.expand(rows, -1).to(torch.long)
    labels = batch.get("labels")
    targets = shifted_targets(labels, positions) if labels is not None else None
    pad = -width % sp_size
    if pad:
        ids = torch.cat([ids, ids.new_full((rows, pad), pad_token_id)], dim=1)
        positions = torch.cat([positions, torch.arange(pad, device=ids.device).expand(rows, -1)], dim=1)
        if targets is not None:
            targets = torch.cat([targets, targets.new_full((rows, pad), IGNORE_INDEX)], dim=1)
    share = ids.shape[1] // sp_size
    mine = slice(sp_rank * share, (sp_rank + 1) * share)
    out = {k: v for k, v in batch.items() if _is_flag(v)}
    out.update(input_ids=ids[:, mine].contiguous(), position_ids=positions[:, mine].contiguous())
    if targets is not None:
        local = targets[:, mine].contiguous()
        out.update(labels=local, shift_labels=local, num_items_in_batch=(targets != IGNORE_INDEX).sum())
    return out


def shifted_targets(labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[rows, S]``: the target each token predicts - the next label, -100 at the row's end and at a
    token whose successor starts a sample (its positions do not go on by one)."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].clone()
    restarts = positions.diff(dim=-1) != 1  # [rows, S - 1]: token i + 1 starts a sample
    targets[:, :-1][restarts] = IGNORE_INDEX
    return targets


def drop_right_padding(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` without its ``attention_mask`` when that mask only pads rows on the right and every
    padded position is unlabelled (-100): under causal attention no real token attends to a later pad,
    and no target is a pad, so the loss and gradients are those of the masked batch (the mask the
    exchange cannot carry). Any other mask (left padding, a labelled pad) is kept, for
    :func:`shard_batch` to refuse."""
    mask = batch.get("attention_mask")
    if not torch.is_tensor(mask) or bool(mask.all()):
        return {k: v for k, v in batch.items() if k != "attention_mask"} if torch.is_tensor(mask) else dict(batch)
    right = bool((mask.cummin(dim=-1).values == mask).all())
    labels = batch.get("labels")
    unlabelled = labels is None or (
        torch.is_tensor(labels) and labels.shape == mask.shape and bool((labels[mask == 0] == IGNORE_INDEX).all())
    )
    return {k: v for k, v in batch.items() if k != "attention_mask"} if right and unlabelled else dict(batch)


_KNOWN = ("input_ids", "labels", "position_ids", "attention_mask")


def _is_flag(value: object) -> bool:
    """A value with no sequence to slice: the same on every rank of a group, passed through as it is."""
    return value is None or isinstance(value, (bool, int, float, str))


def _check_arguments(batch: Mapping[str, Any], sp_rank: int, sp_size: int) -> None:
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"shard_batch: sp_size={sp_size!r} must be a positive integer (the sp:N of the policy)")
    if not isinstance(sp_rank, int) or isinstance(sp_rank, bool) or not 0 <= sp_rank < sp_size:
        raise ValueError(
            f"shard_batch: sp_rank={sp_rank!r} must be from 0 to {sp_size - 1} (this rank's place in its group)"
        )
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError("shard_batch: the batch needs input_ids of shape [rows, tokens] (a tensor)")
    for key in ("labels", "position_ids", "attention_mask"):
        value = batch.get(key)
        if value is not None and (not torch.is_tensor(value) or value.shape[-1] != ids.shape[1]):
            raise ValueError(f"shard_batch: {key} must be a tensor as wide as input_ids ({ids.shape[1]} tokens)")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "shard_batch: the batch is padded (attention_mask has zeros); sequence parallelism cannot carry a padding "
            "mask: pack the rows (hf_memstack.data.PackedCollator) - shard_batch pads a row's tail as a sample of its own"
        )
    unknown = sorted(k for k, v in batch.items() if k not in _KNOWN and not _is_flag(v))
    if unknown:
        raise ValueError(
            f"shard_batch: keys {unknown} would not be sliced by sequence; pass only {', '.join(_KNOWN)} (drop the others "
            "from the collator's output)"
        )


@dataclass
class SequenceShardCollator:
    """A collator that collates as ``inner`` does (e.g. :class:`hf_memstack.data.PackedCollator`, or
    Transformers' ``default_data_collator``) and returns this rank's :func:`shard_batch` of it. Every
    rank of a sequence-parallel group must be given the same features (a sampler keyed by the
    data-parallel rank, ``rank // sp_size``)."""

    inner: Callable[[Sequence[Any]], Mapping[str, Any]]
    sp_rank: int
    sp_size: int
    pad_token_id: int = 0

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        return shard_batch(
            self.inner(features), sp_rank=self.sp_rank, sp_size=self.sp_size, pad_token_id=self.pad_token_id
        )
