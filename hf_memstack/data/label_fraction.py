"""measure_label_fraction: the share of a dataset's token positions whose (shifted) label carries
loss, measured on a bounded, deterministic sample of its rows.

``loss:chunked`` runs its output head over the labelled positions only, so on prompt-masked data
(the prompt's labels are -100) the head costs that share of a full one. The estimator and the
planner take it as ``label_fraction=`` (default 1.0, every position); this module measures it from
the data the recipe and ``training_arguments`` already hold, as the estimator counts it: labelled
positions over each row's tokens but its last (the one that predicts nothing), so padding added
by a collator neither dilutes nor inflates it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sized
from dataclasses import dataclass
from itertools import islice
from typing import Any, cast

import torch

__all__ = ["LabelFraction", "measure_label_fraction"]


@dataclass(frozen=True, slots=True)
class LabelFraction:
    """What :func:`measure_label_fraction` counted."""

    fraction: float
    """``labelled / positions``, for ``estimate_memory(label_fraction=)`` and ``plan_policy(label_fraction=)``."""
    labelled: int
    """Positions whose shifted label is not the ignored id (the rows the chunked head runs over)."""
    positions: int
    """Positions that could carry a label: each row's tokens (padding excluded) but its last."""
    rows: int
    """Rows of the dataset measured."""

    def summary(self) -> str:
        return (
            f"label fraction {self.fraction:.2f} measured over {self.rows} rows "
            f"({self.labelled} of {self.positions} positions carry a label)"
        )


def measure_label_fraction(
    dataset: object,
    data_collator: Callable[[list[Any]], Mapping[str, object]] | None = None,
    *,
    max_rows: int = 512,
    batch_size: int = 16,
    columns: Collection[str] | None = None,
    ignore_index: int = -100,
) -> LabelFraction | None:
    """The share of ``dataset``'s positions whose (shifted) label is not ``ignore_index``.

    At most ``max_rows`` rows are read: evenly spread over an indexable dataset (a sorted dataset
    is sampled from end to end), the first ones of an iterable; the same rows every call. With a
    ``data_collator`` the labels are the ones it makes (``DataCollatorForLanguageModeling`` builds
    them from the input ids, TRL's masks the prompt), collated ``batch_size`` rows at a time after
    keeping only ``columns`` (as Trainer's ``remove_unused_columns`` does; None keeps all); without
    one, the rows' own ``labels`` (packed rows split at their ``seq_lengths``, each sample's first
    label unused, as :class:`~hf_memstack.data.PackedCollator` makes it) or ``shift_labels``.

    Returns:
        :class:`LabelFraction`, or None when the data carries no per-token labels (a classifier's
        one label per row, or no labels at all): no claim is made and estimates keep 1.0.

    Raises:
        ValueError: an empty dataset, a row that is not a mapping or has no ``input_ids``, labels
            of another length than the row's tokens, or a sample without any labelled position.
        TypeError: a ``dataset`` that is neither indexable nor iterable; a bad ``max_rows``/``batch_size``.
    """
    for name, value in (("max_rows", max_rows), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TypeError(f"measure_label_fraction: {name}={value!r} must be a positive integer")
    rows = _sample(dataset, max_rows)
    positions = sum(max(0, _tokens(row) - 1) for row in rows)
    if data_collator is None:
        counts = [_row_labelled(row, i, ignore_index) for i, row in enumerate(rows)]
        labelled = None if any(c is None for c in counts) else sum(cast("list[int]", counts))
    else:
        labelled = _collated_labelled(rows, data_collator, batch_size, columns, ignore_index)
    if labelled is None:
        return None
    if labelled == 0:
        raise ValueError(
            f"measure_label_fraction: none of the {positions} positions of the {len(rows)} rows measured carries a "
            f"label (every shifted label is {ignore_index}): training on them learns nothing; check the prompt "
            "masking (a prompt as long as the row masks all of it) or the collator's labels"
        )
    return LabelFraction(
        fraction=min(1.0, labelled / max(1, positions)), labelled=labelled, positions=positions, rows=len(rows)
    )


def _sample(dataset: object, max_rows: int) -> list[Mapping[str, object]]:
    if isinstance(dataset, Sized) and hasattr(dataset, "__getitem__"):
        n = len(dataset)
        if n == 0:
            raise ValueError("measure_label_fraction: the dataset is empty; pass the training rows")
        picks = sorted({i * n // min(n, max_rows) for i in range(min(n, max_rows))})
        rows = [cast("Any", dataset)[i] for i in picks]
    elif isinstance(dataset, Iterable):
        rows = list(islice(dataset, max_rows))
        if not rows:
            raise ValueError("measure_label_fraction: the dataset yielded no rows; pass the training rows")
    else:
        raise TypeError(
            f"measure_label_fraction: dataset is a {type(dataset).__name__}, neither indexable nor iterable; "
            "pass a datasets.Dataset, a list of rows or an iterable of rows"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "input_ids" not in row:
            got = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(
                f"measure_label_fraction: row {i} has no 'input_ids' (got {got}); pass tokenized rows "
                "(input_ids, and labels unless the collator makes them)"
            )
    return rows


def _ids(value: object) -> list[int]:
    if torch.is_tensor(value):
        return cast("list[int]", value.reshape(-1).tolist())
    return [int(v) for v in cast("Iterable[Any]", value)]


def _tokens(row: Mapping[str, object]) -> int:
    """The row's tokens, padding excluded (a row tokenized with padding has zeros in its mask)."""
    mask = row.get("attention_mask")
    return sum(1 for m in _ids(mask) if m) if mask is not None else len(_ids(row["input_ids"]))


def _row_labelled(row: Mapping[str, object], index: int, ignore_index: int) -> int | None:
    """Labelled shifted positions of one row (None: the row has no per-token labels)."""
    n = len(_ids(row["input_ids"]))
    for field in ("shift_labels", "labels"):
        value = row.get(field)
        if value is None or isinstance(value, (int, float, str)) or (torch.is_tensor(value) and value.ndim == 0):
            continue
        labels = _ids(value)
        if len(labels) != n:
            raise ValueError(
                f"measure_label_fraction: row {index} has {len(labels)} {field} for {n} input_ids; give one "
                "label per token (-100 where no loss is taken)"
            )
        if field == "shift_labels":
            return sum(t != ignore_index for t in labels)
        lengths = _ids(row["seq_lengths"]) if row.get("seq_lengths") is not None else [n]
        # Each sample's first label is never a target (the previous position belongs to another sample).
        starts = [sum(lengths[:k]) for k in range(len(lengths))]
        return sum(sum(t != ignore_index for t in labels[s + 1 : s + m]) for s, m in zip(starts, lengths))
    return None


def _collated_labelled(
    rows: list[Mapping[str, object]],
    collator: Callable[[list[Any]], Mapping[str, object]],
    batch_size: int,
    columns: Collection[str] | None,
    ignore_index: int,
) -> int | None:
    """Labelled shifted positions of the batches ``collator`` makes (None: no per-token labels)."""
    kept = [dict(r) if columns is None else {k: v for k, v in r.items() if k in columns} for r in rows]
    labelled = 0
    for start in range(0, len(kept), batch_size):
        batch = collator(kept[start : start + batch_size])
        shifted, labels, ids = batch.get("shift_labels"), batch.get("labels"), batch.get("input_ids")
        if torch.is_tensor(shifted):
            labelled += int((shifted != ignore_index).sum())
        elif torch.is_tensor(labels) and torch.is_tensor(ids) and labels.shape == ids.shape and labels.ndim >= 2:
            labelled += int((labels[..., 1:] != ignore_index).sum())
        else:
            return None  # a classifier's labels, or none: the chunked head does not apply
    return labelled
