"""Ulysses attention as a Transformers attention implementation, ``hf_memstack_ulysses``.

Each rank of the sequence-parallel group holds ``s = S/N`` tokens of every row. In each attention
layer q/k/v go ``[b, H, s, d]`` -> all-to-all -> ``[b, H/N, S, d]``: the rank's heads over the whole
row. Those heads attend as Transformers' SDPA does, and the output goes back the same way. Norms,
MLPs and the loss never see another rank's tokens.

* **Masks** come from the whole rows' position ids (all-gathered in each layer - a few bytes, and
  every rank makes the same collectives whatever it has seen before), not from Transformers' mask
  builders: those build the *local* ``[s, s]`` mask, wrong once the heads see all S tokens. A row's
  samples are the runs where the positions count up by one (Transformers' packed-sequence rule):
  each sample attends to itself, causally, within the layer's ``sliding_window`` if it has one
  (``q - k < window``, Transformers' window). Run eagerly, each sample is its own SDPA call
  (``sum(L_i^2)``, as ``hf_memstack_sdpa``); under ``torch.compile`` a packed row or a window shorter
  than the row runs with one ``[b, 1, S, S]`` boolean mask (one graph for every packing). On the
  estimator's fake tensors (no positions to read) the rows are the samples :func:`rows_as_traced` gives.
* **GQA/MQA**: when N does not divide the key/value heads, each is repeated
  ``N / gcd(KV, N)`` times before the exchange; N dividing the query heads is then enough.
* **Refused at run time**, naming the fix: a padding mask (Transformers hands the mask function
  registered here the local 2-D mask), a 4-D mask of the caller's own, a KV cache (keys longer
  than the queries), a position bias, missing position ids, an attention module with
  ``is_causal=False``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from ..._quiet import quiet_imports
from .exchange import SequenceParallelGroup, gather_positions, head_to_seq, seq_to_head

__all__ = [
    "ULYSSES_ATTENTION",
    "active_group",
    "kv_replication",
    "register_ulysses_attention",
    "rows_as_traced",
    "set_active_group",
    "ulysses_attention_forward",
    "ulysses_mask",
]

ULYSSES_ATTENTION = "hf_memstack_ulysses"
"""The attention implementation's name in Transformers' interfaces."""

_ACTIVE: list[SequenceParallelGroup] = []  # the group the attention exchanges over (one per process)


def set_active_group(sp: SequenceParallelGroup) -> None:
    """The group :data:`ULYSSES_ATTENTION` exchanges over from now on, in this process."""
    _ACTIVE[:] = [sp]


def active_group() -> SequenceParallelGroup:
    if not _ACTIVE:
        raise RuntimeError(
            f"the model's attention is {ULYSSES_ATTENTION!r} but no sequence-parallel group is set in this process: "
            "prepare the model with an sp:N policy (prepare_model) in this process"
        )
    return _ACTIVE[0]


def kv_replication(num_heads: int, num_kv_heads: int, n: int) -> int:
    """How many times each key/value head is repeated before the exchange so that N divides them and
    each rank's query heads find their key/value heads on the same rank (1: none). Whenever N
    divides ``num_heads``, ``N / gcd(KV, N)`` divides the query heads per key/value head."""
    if num_heads % n:
        raise ValueError(
            f"sequence parallelism sp:{n}: the model's {num_heads} attention heads are not divisible by {n} "
            f"(each rank attends with heads/{n} of them); use an sp size that divides {num_heads}"
        )
    r = n // math.gcd(num_kv_heads, n)
    if num_heads % num_kv_heads or (num_heads // num_kv_heads) % r:
        raise ValueError(
            f"sequence parallelism sp:{n}: {num_kv_heads} key/value heads cannot be spread with {num_heads} query heads "
            f"over {n} ranks; use an sp size that divides {num_kv_heads}"
        )
    return r


class _Shim:
    """What ``sdpa_attention_forward`` reads from ``module``: the local query heads per key/value head
    (a class, not a SimpleNamespace: dynamo traces it)."""

    is_causal = True

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention signature: ``query`` ``[b, H, s, d]``, ``key``/``value`` ``[b, KV, s, d]``
    (this rank's tokens); returns ``[b, s, H, d]`` (see the module docstring)."""
    sp = active_group()
    if getattr(module, "is_causal", True) is False:  # switched to bidirectional after prepare_model
        raise ValueError(
            f"sequence parallelism: {type(module).__name__}.is_causal is False (bidirectional attention); "
            f"{ULYSSES_ATTENTION!r} attends causally and sp:N shards causal LMs only: drop sp:N for this model"
        )
    _refuse(query, key, attention_mask, kwargs)
    positions = kwargs.pop("position_ids")
    window = kwargs.pop("sliding_window", None)
    for name in ("is_causal", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    whole = gather_positions(positions.expand(query.shape[0], -1), sp)  # [b, S]
    r = kv_replication(query.shape[1], key.shape[1], sp.size)
    if r > 1:
        key, value = key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)
    q, k, v = seq_to_head(query, sp), seq_to_head(key, sp), seq_to_head(value, sp)
    shim = cast(nn.Module, _Shim(q.shape[1] // k.shape[1]))  # duck-typed: what sdpa_attention_forward reads
    out = _inner(shim, q, k, v, whole, window, dropout, scaling, kwargs)  # [b, S, H/N, d]
    out = head_to_seq(out.transpose(1, 2), sp)  # [b, H, s, d]
    return out.transpose(1, 2).contiguous(), None


def _refuse(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
        raise ValueError(
            f"sequence parallelism: an attention_mask of shape {tuple(mask.shape)} reached {ULYSSES_ATTENTION!r}; it "
            "builds the mask from the whole rows' position_ids and cannot carry padding or a mask of your own: pack "
            "the rows (hf_memstack.data.PackedCollator) and shard them with shard_batch, with no attention_mask"
        )
    if key.shape[2] != query.shape[2] or kwargs.get("past_key_values") is not None:
        raise ValueError(
            f"sequence parallelism: {ULYSSES_ATTENTION!r} got {query.shape[2]} queries and {key.shape[2]} keys (a KV "
            "cache, or cross-attention): it trains without a cache; pass use_cache=False, and generate with an "
            "unprepared copy of the model"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"sequence parallelism: {ULYSSES_ATTENTION!r} cannot shard a position bias (T5-style models); drop sp:N"
        )
    if not torch.is_tensor(kwargs.get("position_ids")):
        raise ValueError(
            f"sequence parallelism: {ULYSSES_ATTENTION!r} needs the rows' global position_ids (this rank's slice); "
            "pass position_ids in the batch (shard_batch makes them)"
        )


def _inner(
    shim: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    whole: torch.Tensor,
    window: int | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The head-sharded attention over whole rows (``[b, H/N, S, d]`` each), ``[b, S, H/N, d]`` out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    total = q.shape[2]
    # Fake tensors (the estimator) have no positions to read: their rows as traced. A compiled graph
    # reads one bool (a graph per answer, not per packing) and masks densely.
    fake = _is_fake(whole)
    samples = _traced_samples(whole) if fake else None if torch.compiler.is_compiling() else _samples(whole)
    plain = all(len(row) == 1 for row in samples) if samples is not None else not fake and _plain(whole)
    if plain and (window is None or window >= total):
        return sdpa_attention_forward(shim, q, k, v, None, dropout, scaling, is_causal=True, **kwargs)[0]
    if samples is None:
        dense = _dense_mask(whole, window)
        return sdpa_attention_forward(shim, q, k, v, dense, dropout, scaling, is_causal=False, **kwargs)[0]
    rows = (
        [slice(None)] if all(row == samples[0] for row in samples) else [slice(r, r + 1) for r in range(len(samples))]
    )
    outs = []
    for i, rows_of in enumerate(rows):
        parts, start = [], 0
        for length in samples[i]:
            span = slice(start, start + length)
            start += length
            mask = None if window is None or window >= length else _window_mask(length, window, q.device)
            out, _ = sdpa_attention_forward(
                shim, q[rows_of, :, span], k[rows_of, :, span], v[rows_of, :, span], mask, dropout, scaling,
                is_causal=mask is None, **kwargs,
            )  # fmt: skip
            parts.append(out)  # [rows, length, H/N, d]
        outs.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


_TRACED_ROWS: contextvars.ContextVar[tuple[tuple[int, ...], ...] | None] = contextvars.ContextVar(
    "hf_memstack_ulysses_traced_rows", default=None
)


@contextlib.contextmanager
def rows_as_traced(rows: tuple[tuple[int, ...], ...] | None) -> Iterator[None]:
    """Within: on fake tensors (the estimator's, whose position ids have no values) row ``i`` of the
    whole rows holds samples of the lengths ``rows[i % len(rows)]`` (each summing to the row's tokens,
    the padded tail included) and runs as a real row of them does: per sample, or whole when it is
    one sample. ``()``: rows of several samples that are not read (a compiled run's): masked densely.
    ``None`` (and outside): every fake row one sample."""
    token = _TRACED_ROWS.set(rows)
    try:
        yield
    finally:
        _TRACED_ROWS.reset(token)


def _traced_samples(whole: torch.Tensor) -> list[list[int]] | None:
    """The fake rows' samples as :func:`rows_as_traced` says (None: masked densely)."""
    rows, total = whole.shape
    layout = _TRACED_ROWS.get()
    if layout is None:
        return [[total]] * rows
    out = [list(layout[i % len(layout)]) for i in range(rows)] if layout else None
    if out is not None and any(sum(row) != total for row in out):
        raise RuntimeError(
            f"rows_as_traced({layout}): the traced rows hold {total} tokens each, not these lengths' sums"
        )
    return out


@torch.compiler.disable
def _samples(whole: torch.Tensor) -> list[list[int]]:
    """Per row, its samples' lengths (runs of positions counting up by one); read eagerly."""
    from ..packed_attention import _lengths

    starts = whole.diff(dim=-1) != 1
    return _lengths(starts, whole.shape[0], whole.shape[1])


@torch.compiler.disable
def _plain(whole: torch.Tensor) -> bool:
    """Whether every row is one sample (its positions count up by one)."""
    return not bool((whole.diff(dim=-1) != 1).any())


def _dense_mask(whole: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[b, 1, S, S]``: causal, within a sample, and within the window - from the positions alone."""
    total = whole.shape[1]
    sample = torch.nn.functional.pad(whole.diff(dim=-1) != 1, (1, 0)).cumsum(-1)  # [b, S]
    index = torch.arange(total, device=whole.device)
    mask = (index[:, None] >= index[None, :])[None] & (sample[:, :, None] == sample[:, None, :])
    if window is not None:
        mask = mask & ((whole[:, :, None] - whole[:, None, :]) < window)
    return mask[:, None]


def _window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return ((distance >= 0) & (distance < window))[None, None]


def ulysses_mask(*, attention_mask: torch.Tensor | None = None, **_ignored: Any) -> None:
    """The mask function registered for :data:`ULYSSES_ATTENTION`. Without one Transformers returns no
    mask for an implementation it does not know, and a padding mask would be dropped silently; with
    it the local 2-D mask arrives here and padding is refused. The attention builds its own mask."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(
            "sequence parallelism: a padded batch (attention_mask with zeros) cannot be sharded by sequence: "
            "pack the rows instead (hf_memstack.data.PackedCollator) and shard them with shard_batch, which pads a "
            "row's tail as a sample of its own, with no attention_mask"
        )
    return None


@quiet_imports()  # the first Transformers import loads torchao: its import-time noise only
def register_ulysses_attention() -> None:
    """Register :data:`ULYSSES_ATTENTION` in Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, ulysses_mask)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta
