"""What Trainer feeds the model, read the way Trainer reads it: the columns it keeps (the forward's
arguments and the label names) and the dataset's samples, longest first - shared by the batch-size
finder (:mod:`.trainer_args`) and the evaluation check (:mod:`.trainer_eval`)."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Protocol, cast

import torch
from torch import nn

from .._unwrap import PeftWrapper


class MapDataset(Protocol):
    """A map-style dataset, as Trainer reads one: its length, and the sample at an index."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> object: ...


class _ColumnDataset(Protocol):
    """A ``datasets.Dataset`` read by column: ``dataset["input_ids"]`` is every row's ``input_ids``."""

    def __getitem__(self, column: str) -> Sequence[Sized]: ...


def _longest_first(dataset: MapDataset) -> list[int]:
    """The dataset's indices, longest sample first (ties in dataset order)."""
    column = getattr(dataset, "column_names", None)
    if isinstance(column, list) and "input_ids" in column:  # a datasets.Dataset: one column read, not every row
        lengths = [len(ids) for ids in cast(_ColumnDataset, dataset)["input_ids"]]
    else:
        lengths = [_length(dataset[i]) for i in range(len(dataset))]
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def _length(sample: object) -> int:
    """A sample's length: its ``input_ids``, else its longest sequence field (a collator pads to those)."""
    if not isinstance(sample, dict):
        return 0
    if sample.get("input_ids") is not None:
        return len(sample["input_ids"])
    return max(
        (
            len(v) if not torch.is_tensor(v) else v.numel()
            for v in sample.values()
            if isinstance(v, (list, tuple)) or torch.is_tensor(v)
        ),
        default=0,
    )


def _signature_columns(model: nn.Module) -> set[str]:
    """The columns Trainer keeps (``Trainer._set_signature_columns_if_needed``): the forward's
    arguments (a PEFT model's base model's), plus the label names."""
    import inspect

    from transformers.utils import find_labels

    inner = cast(PeftWrapper, model).get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(inner.forward).parameters) | {"label", "label_ids"} | set(find_labels(type(inner)))


def _trainer_columns(sample: object, keep: set[str] | None) -> object:
    return {k: v for k, v in sample.items() if k in keep} if keep is not None and isinstance(sample, dict) else sample
