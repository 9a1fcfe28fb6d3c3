"""PackedCollator: packed rows (or plain samples) into a batch whose ``position_ids`` restart at
every sample and which carries no attention mask - the padding-free format Transformers detects
as packed, so that no sample attends to another.

Each row goes through Transformers' own ``DataCollatorWithFlattening`` (positions from 0 per
sample, the first label of every sample set to -100 so that no sample predicts the next one's
first token). Rows are then padded to one width with a padding *segment*: pad tokens whose
positions restart at 0 and whose labels are -100, so the padding is a sample of its own that
nothing attends to and nothing learns from (padding position ids with zeros or with the row's
positions instead either splits it into one-token samples or glues it to the last sample).
With ``flatten=True`` the whole batch is one row, as ``DataCollatorWithFlattening`` makes it
(for flash-attention's variable-length kernels; an SDPA or eager model would build a dense mask
over all the batch's tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from .boundaries import segment_lengths

__all__ = ["PackedCollator"]


@dataclass(kw_only=True)
class PackedCollator:
    """Collate packed rows (``{"input_ids", "labels"?, "seq_lengths", "position_ids"}``, as
    :func:`hf_memstack.data.pack_dataset` makes them; the boundaries come from ``seq_lengths``, or
    from ``position_ids`` restarting when Trainer dropped ``seq_lengths``) or plain samples (one
    sample per feature) into ``{"input_ids", "labels", "position_ids"}`` of shape ``[rows, width]``.

    Labels default to the input ids; prompt tokens masked with -100 (prompt/response data) stay
    masked. No ``attention_mask`` is returned: on a packed batch it would make Transformers attend
    across samples (transformers#46634).
    """

    pad_token_id: int = 0
    """The token id of the padding segment (its labels are -100: it is never learnt)."""
    pad_to: int | None = None
    """Every batch this wide (one shape for ``torch.compile``); None: the longest row of the batch."""
    pad_to_multiple_of: int | None = None
    """Round the width up to a multiple of this (tensor-core friendly shapes)."""
    flatten: bool = False
    """One row holding every sample of the batch (flash-attention varlen), instead of one row per feature."""

    def __post_init__(self) -> None:
        for name in ("pad_to", "pad_to_multiple_of"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"PackedCollator.{name}={value!r} must be a positive integer or None")
        if not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool):
            raise TypeError(f"PackedCollator.pad_token_id={self.pad_token_id!r} must be an integer token id")

    def __call__(self, features: Sequence[Mapping[str, object]]) -> dict[str, torch.Tensor]:
        rows = [_samples_of(f, i) for i, f in enumerate(features)]
        if not rows:
            raise ValueError("PackedCollator got an empty batch")
        if self.flatten:
            rows = [[s for row in rows for s in row]]
        flat = [_flatten(row) for row in rows]
        width = self._width(max(r["input_ids"].shape[1] for r in flat))
        return {
            k: torch.cat([_pad(r[k], width, k, self.pad_token_id) for r in flat])
            for k in ("input_ids", "labels", "position_ids")
        }

    def _width(self, longest: int) -> int:
        width = longest if self.pad_to is None else self.pad_to
        if longest > width:
            raise ValueError(
                f"PackedCollator: a row holds {longest} tokens, more than pad_to={self.pad_to}; pack rows of at most "
                f"{self.pad_to} tokens (pack_dataset(..., tokens_per_row={self.pad_to})) or raise pad_to"
            )
        m = self.pad_to_multiple_of
        return width if m is None else -(-width // m) * m


def _samples_of(feature: Mapping[str, object], index: int) -> list[dict[str, list[int]]]:
    """A feature split into its samples (by ``seq_lengths``; a feature without them is one sample)."""
    if not isinstance(feature, Mapping) or "input_ids" not in feature:
        raise ValueError(
            f"PackedCollator: feature {index} has no 'input_ids' (got {type(feature).__name__}); "
            "pass tokenized samples or rows from pack_dataset"
        )
    ids = _as_list(feature["input_ids"])
    labels = _as_list(feature["labels"]) if feature.get("labels") is not None else list(ids)
    mask = feature.get("attention_mask")
    if mask is not None and 0 in _as_list(mask):
        raise ValueError(
            f"PackedCollator: feature {index} has padding inside it (attention_mask holds zeros): padded "
            "samples cannot be packed, their pad tokens would train as text. Tokenize without padding "
            "(padding=False), then pack"
        )
    lengths = (
        _as_list(feature["seq_lengths"])
        if feature.get("seq_lengths") is not None
        else _runs(feature.get("position_ids"), len(ids))
    )
    if len(labels) != len(ids) or sum(lengths) != len(ids) or any(n < 1 for n in lengths):
        raise ValueError(
            f"PackedCollator: feature {index} has {len(ids)} input_ids, {len(labels)} labels and seq_lengths "
            f"{lengths} (sum {sum(lengths)}): give one label per token and seq_lengths that add up to the row"
        )
    out, start = [], 0
    for n in lengths:
        out.append({"input_ids": ids[start : start + n], "labels": labels[start : start + n]})
        start += n
    return out


def _runs(positions: object, n: int) -> list[int]:
    """The sample lengths a row's ``position_ids`` give (:func:`segment_lengths`): the boundaries
    of a packed row whose ``seq_lengths`` Trainer dropped; one sample when there are none."""
    if positions is None:
        return [n]
    row = torch.as_tensor(positions).reshape(1, -1)
    if row.shape[1] != n:
        return [n, row.shape[1] - n]  # refused below: the lengths do not add up to the row
    return segment_lengths(row)[0]


def _flatten(samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    # Transformers' own: positions restart per sample, each sample's first label becomes -100.
    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)(samples, return_tensors="pt")


def _pad(t: torch.Tensor, width: int, key: str, pad_token_id: int) -> torch.Tensor:
    missing = width - t.shape[1]
    if missing == 0:
        return t
    if key == "position_ids":  # the padding is a segment of its own: its positions restart
        tail = torch.arange(missing, dtype=t.dtype).unsqueeze(0)
    else:
        tail = torch.full((1, missing), pad_token_id if key == "input_ids" else -100, dtype=t.dtype)
    return torch.cat([t, tail], dim=1)


def _as_list(value: object) -> list[int]:
    # A tensor or array (tolist), or a sequence of ids.
    return list(value.tolist() if hasattr(value, "tolist") else cast("Iterable[int]", value))
