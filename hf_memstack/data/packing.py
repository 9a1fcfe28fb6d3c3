"""Boundary-aware packing: samples of mixed lengths placed into rows of at most ``tokens_per_row``
tokens by best-fit decreasing (as TRL's ``pack_dataset`` with ``strategy="bfd"``), each sample kept
whole unless splitting is asked for, and the padding a batch spends before and after packing.

A packed row is a dict with the samples' ``input_ids`` (and ``labels``) concatenated, their
``seq_lengths`` and their ``position_ids`` (restarting at every sample);
:class:`hf_memstack.data.PackedCollator` turns rows into batches whose ``position_ids`` restart at
every sample, which is what keeps the samples of one row from attending to each other
(Transformers' packed-sequence detection). The row carries its boundaries twice because
``transformers.Trainer`` drops the dataset columns the model's forward does not take
(``remove_unused_columns``, on by default): ``seq_lengths`` goes, ``position_ids`` stays, and the
collator reads the boundaries from whichever is left.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Overflow", "PackingPlan", "PackingStats", "pack_dataset", "padding_stats", "plan_rows"]

Overflow = Literal["error", "truncate", "split"]
"""What to do with a sample longer than a row: refuse (``error``, the default: nothing is lost
silently), keep its first ``tokens_per_row`` tokens (``truncate``), or cut it into row-sized pieces
that are packed like samples (``split``; each piece restarts its positions)."""

_PER_TOKEN = ("input_ids", "labels")


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingStats:
    """Tokens against the slots a set of batches spends on them."""

    samples: int
    """Samples (pieces, with ``overflow="split"``) in the batches."""
    tokens: int
    """Real tokens."""
    slots: int
    """Token positions the batches compute: the tokens plus the padding."""

    @property
    def padding_fraction(self) -> float:
        """The share of the computed positions that are padding."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingPlan:
    """Which piece of which sample goes into which row."""

    tokens_per_row: int
    """The row width the plan was made for."""
    rows: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per row, its pieces as ``(sample index, start, stop)`` token offsets, in packing order."""
    dropped_tokens: int = 0
    """Tokens cut off by ``overflow="truncate"``."""

    @property
    def tokens(self) -> int:
        return sum(stop - start for row in self.rows for _, start, stop in row)

    def stats(self) -> PackingStats:
        """Padding when every row is padded to ``tokens_per_row`` (the collator's ``pad_to``; padding
        to the longest row of each batch spends at most this)."""
        pieces = sum(len(row) for row in self.rows)
        return PackingStats(samples=pieces, tokens=self.tokens, slots=len(self.rows) * self.tokens_per_row)


def plan_rows(lengths: Sequence[int], tokens_per_row: int, *, overflow: Overflow = "error") -> PackingPlan:
    """Best-fit decreasing: the longest piece first, each into the fullest row it still fits.

    Args:
        lengths: tokens of each sample (0-length samples are left out).
        tokens_per_row: the row width (the batch's sequence length).
        overflow: what to do with a sample longer than a row (see :data:`Overflow`).

    Raises:
        ValueError: ``tokens_per_row`` is not a positive integer, a length is negative, ``overflow``
            is unknown, or (``overflow="error"``) a sample is longer than a row.
    """
    _check_width(tokens_per_row)
    if overflow not in ("error", "truncate", "split"):
        raise ValueError(f"overflow={overflow!r} is not one of 'error', 'truncate', 'split'")
    pieces, dropped = _pieces(lengths, tokens_per_row, overflow)
    # Longest first; among equal lengths the earlier sample first, so the plan is deterministic.
    pieces.sort(key=lambda p: (p[1] - p[2], p[0], p[1]))
    rows: list[list[tuple[int, int, int]]] = []
    spaces: list[int] = []  # the distinct free spaces of open rows, sorted
    by_space: dict[int, deque[int]] = defaultdict(deque)  # free space -> open rows with it, oldest first
    for piece in pieces:
        size = piece[2] - piece[1]
        at = bisect.bisect_left(spaces, size)
        if at < len(spaces):  # the open row with the least space that still holds the piece
            space = spaces[at]
            row = by_space[space].popleft()
            if not by_space[space]:
                spaces.pop(at)
        else:
            space, row = tokens_per_row, len(rows)
            rows.append([])
        rows[row].append(piece)
        left = space - size
        if left > 0:
            if not by_space[left]:
                bisect.insort(spaces, left)
            by_space[left].append(row)
    return PackingPlan(tokens_per_row=tokens_per_row, rows=tuple(tuple(r) for r in rows), dropped_tokens=dropped)


def _pieces(lengths: Sequence[int], width: int, overflow: Overflow) -> tuple[list[tuple[int, int, int]], int]:
    pieces: list[tuple[int, int, int]] = []
    dropped = 0
    too_long = []
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"lengths[{i}]={n!r} must be a non-negative integer (a sample's token count)")
        if n > width and overflow == "error":
            too_long.append((i, n))
        elif n > width and overflow == "truncate":
            pieces.append((i, 0, width))
            dropped += n - width
        elif n > width:
            pieces += [(i, start, min(n, start + width)) for start in range(0, n, width)]
        elif n > 0:
            pieces.append((i, 0, n))
    if too_long:
        shown = ", ".join(f"sample {i} has {n}" for i, n in too_long[:3]) + (" ..." if len(too_long) > 3 else "")
        raise ValueError(
            f"{len(too_long)} sample(s) longer than tokens_per_row={width} ({shown} tokens): packing keeps every sample "
            "whole, so none of them fits a row. Truncate at tokenization (max_length), raise tokens_per_row, or pass "
            "overflow='truncate' (keep the first tokens) or overflow='split' (cut them into row-sized pieces)"
        )
    return pieces, dropped


def pack_dataset(samples: Any, tokens_per_row: int, *, overflow: Overflow = "error") -> Any:
    """Samples (dicts with ``input_ids`` and optionally ``labels`` of the same length; a list or a
    ``datasets.Dataset``) packed into rows: ``{"input_ids", "labels"?, "seq_lengths", "position_ids"}``.

    Other columns are dropped: an ``attention_mask`` in particular, which on a packed batch would
    make Transformers attend across samples. Returns a list of rows, or a ``datasets.Dataset`` when
    given one.

    Raises:
        ValueError: a sample has no ``input_ids`` or labels of another length, or see :func:`plan_rows`.
    """
    columns = _columns(samples)
    plan = plan_rows([len(ids) for ids in columns["input_ids"]], tokens_per_row, overflow=overflow)
    rows = [_row(columns, row) for row in plan.rows]
    try:
        import datasets
    except ImportError:  # the library's dependency, but a list works without it
        return rows
    return datasets.Dataset.from_list(rows) if isinstance(samples, datasets.Dataset) else rows


def _columns(samples: Any) -> dict[str, list[list[int]]]:
    """The per-token columns, as lists (a Dataset's columns are read whole: one pass, not one per row)."""
    names = getattr(samples, "column_names", None)
    if names is not None:
        if "input_ids" not in names:
            raise ValueError(
                f"pack_dataset: the dataset has no 'input_ids' column (columns: {names}); tokenize it first"
            )
        columns = {k: list(samples[k]) for k in _PER_TOKEN if k in names}
    else:
        if not isinstance(samples, Sequence):
            raise TypeError(
                f"pack_dataset: samples must be a list of dicts or a datasets.Dataset, got {type(samples).__name__}"
            )
        for i, s in enumerate(samples):
            if not isinstance(s, Mapping) or "input_ids" not in s:
                raise ValueError(
                    f"pack_dataset: sample {i} has no 'input_ids' (got {type(s).__name__}); tokenize the samples first"
                )
        keys = [k for k in _PER_TOKEN if all(k in s for s in samples)] if samples else ["input_ids"]
        columns = {k: [s[k] for s in samples] for k in keys}
    columns = {k: [list(v.tolist() if hasattr(v, "tolist") else v) for v in vs] for k, vs in columns.items()}
    for i, (ids, labels) in enumerate(zip(columns["input_ids"], columns.get("labels", columns["input_ids"]))):
        if len(labels) != len(ids):
            raise ValueError(
                f"pack_dataset: sample {i} has {len(ids)} input_ids but {len(labels)} labels; give one label per token"
            )
    return columns


def _row(columns: dict[str, list[list[int]]], pieces: tuple[tuple[int, int, int], ...]) -> dict[str, list[int]]:
    row: dict[str, list[int]] = {k: [] for k in columns}
    for i, start, stop in pieces:
        for k, values in columns.items():
            row[k] += values[i][start:stop]
    row["seq_lengths"] = [stop - start for _, start, stop in pieces]
    row["position_ids"] = [p for n in row["seq_lengths"] for p in range(n)]
    return row


def padding_stats(lengths: Sequence[int], batch_size: int, *, seed: int | None = 0) -> PackingStats:
    """Padding of the same samples batched *without* packing: ``batch_size`` samples a batch, each
    padded to the longest in its batch (``DataCollatorWithPadding``), in a shuffled order
    (``seed``; None keeps the given order)."""
    _check_width(batch_size, name="batch_size")
    order = [n for n in lengths if n > 0]
    if seed is not None:
        random.Random(seed).shuffle(order)
    slots = sum(len(b) * max(b) for b in (order[i : i + batch_size] for i in range(0, len(order), batch_size)))
    return PackingStats(samples=len(order), tokens=sum(order), slots=slots)


def _check_width(value: object, *, name: str = "tokens_per_row") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
