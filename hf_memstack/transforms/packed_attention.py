"""Per-sample attention for packed rows: ``prepare_model`` points an SDPA model at
``hf_memstack_sdpa``, Transformers' own SDPA attention run once per sample of a packed row.

Why: on a packed row (``position_ids`` restarting per sample, no 2-D mask) Transformers' SDPA path
builds the row's block-diagonal ``[rows, 1, tokens, tokens]`` mask and attends over the whole row:
the attention costs what one sample of the row's full length costs, however short its samples.
Flash-attention's variable-length kernels skip the masked blocks, but they need a GPU. Here each
sample's queries attend to its own keys only: ``sum(L_i^2)`` instead of ``(sum L_i)^2``, the
same numbers (each sample's block of the mask is the mask it has alone).

How: the name is registered in Transformers' ``AttentionInterface`` (this function) and
``AttentionMaskInterface`` (Transformers' ``sdpa_mask``, unchanged: the model builds the mask it
builds under ``sdpa``), so every model whose attention dispatches through the interface picks it
up, sliding windows and all. A call is split only when it is exact to do so:

* its ``position_ids`` (which Transformers passes down to the attention) restart inside a row,
  and the mask is the boolean 4-D mask ``sdpa_mask`` makes (its block of each sample is then that
  sample's own mask: causal, or with a sliding window; a sample whose block is plain causal runs
  SDPA's ``is_causal`` kernel, as it does alone);
* no cache, not under ``torch.compile`` (the samples are data-dependent: the call runs as
  Transformers' SDPA does, over the whole row with its mask), and the mask keeps the samples apart
  (checked at each sample's first token: a 4-D mask of the caller's own that lets samples see
  each other runs as given).

Everything else - unpacked batches, padded batches, decoding - is Transformers' ``sdpa_attention_forward``
itself. On a GPU the split reads the boundaries once per forward (a device sync, as Transformers'
packed-sequence detection makes) and checks each sample's block (a sync per sample and layer):
use flash-attention's varlen kernels there.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .._quiet import quiet_imports

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "PACKED_SDPA",
    "PackedAttentionResult",
    "apply_packed_attention",
    "packed_sdpa_attention_forward",
    "per_sample_as_traced",
    "register_packed_attention",
]

PACKED_SDPA = "hf_memstack_sdpa"
"""The attention implementation's name in Transformers' interfaces."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedAttentionResult:
    """Which attention implementations ``prepare_model`` switched to :data:`PACKED_SDPA`."""

    switched: tuple[str, ...] = ()
    """``("model",)`` when the model's config was switched from ``sdpa``; empty when it runs as loaded."""
    compiled: bool = False
    """The policy compiles the model: compiled graphs run packed rows whole (as Transformers' SDPA)."""
    config: PretrainedConfig | None = field(default=None, repr=False, compare=False)
    """The switched config, read again by :meth:`describe`: a later ``set_attn_implementation`` replaces it."""

    @property
    def applied(self) -> bool:
        return bool(self.switched)

    def describe(self) -> str:
        if not self.switched:
            return "as loaded"
        now = getattr(self.config, "_attn_implementation", PACKED_SDPA)
        if now != PACKED_SDPA:
            return f"{now} (set after prepare_model, which had switched sdpa to {PACKED_SDPA})"
        if self.compiled:
            return (
                f"{PACKED_SDPA}: packed rows run whole inside compiled graphs (their samples' lengths are not "
                "read there), per sample where the model runs eagerly"
            )
        return f"sdpa, run per sample on packed rows where its attention is given their position_ids ({PACKED_SDPA})"


@quiet_imports()  # the first Transformers import loads torchao: its import-time noise only
def register_packed_attention() -> None:
    """Register :data:`PACKED_SDPA` in Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def apply_packed_attention(model: nn.Module, *, compiled: bool = False) -> PackedAttentionResult:
    """Switch ``model`` (a Transformers model, in place) from ``sdpa`` to :data:`PACKED_SDPA`. Kept as
    loaded: any other implementation (eager, flash, flex), a model whose attention does not dispatch
    through Transformers' ``AttentionInterface`` (its own code may test for the name ``"sdpa"``), and
    a composite model (sub-configs with attention of their own, such as a vision tower)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or _sub_configs_with_attention(config):
        return PackedAttentionResult()
    compatible = getattr(model, "is_backend_compatible", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not (callable(compatible) and compatible() and callable(can_set) and can_set()):
        return PackedAttentionResult()
    model.set_attn_implementation(PACKED_SDPA)  # type: ignore[operator]
    if getattr(config, "_attn_implementation", None) != PACKED_SDPA:
        return PackedAttentionResult()  # Transformers declined it: the model runs as loaded
    return PackedAttentionResult(switched=("model",), compiled=compiled, config=config)


def _sub_configs_with_attention(config: object) -> bool:
    subs = (getattr(config, key, None) for key in (getattr(config, "sub_configs", None) or {}))
    return any(sub is not None and hasattr(sub, "_attn_implementation") for sub in subs)


def packed_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, run per sample on packed rows (see the module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = _segments(query, key, attention_mask, kwargs)
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    assert attention_mask is not None
    kwargs.pop("is_causal", None)
    fake = _is_fake(query)
    parts = []
    for r, lengths in enumerate(segments):
        start = 0
        for n in lengths:
            span = slice(start, start + n)
            start += n
            block = attention_mask[r if attention_mask.shape[0] > 1 else 0, :, span, span]
            # Under the estimator's fake tensors the block cannot be read: a layer without a
            # sliding window has a causal one.
            causal = getattr(module, "sliding_window", None) is None if fake else _is_causal_block(block)
            out, _ = sdpa_attention_forward(
                module,
                query[r : r + 1, :, span],
                key[r : r + 1, :, span],
                value[r : r + 1, :, span],
                None if causal else block.unsqueeze(0),
                dropout,
                scaling,
                is_causal=causal,
                **kwargs,
            )
            parts.append(out)  # [1, n, heads, head_dim]
    # The rows follow each other: one concatenation of every sample, then the batch's shape.
    rows, tokens = query.shape[0], query.shape[2]
    whole = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return whole.view(rows, tokens, *whole.shape[2:]), None


@contextlib.contextmanager
def per_sample_as_traced(on: bool) -> Iterator[None]:
    """Within: on fake tensors (the estimator's, whose position ids have no values) packed rows are
    traced per sample, as two samples of half the row each - the memory of the per-sample run
    (each sample's output and softmax statistics saved, no float copy of the mask), whatever the
    samples' lengths. Outside (and when ``on`` is False: a compiled run, whose attention runs
    whole) fake rows run whole, as Transformers' SDPA does."""
    token = _TRACE_PER_SAMPLE.set(on)
    try:
        yield
    finally:
        _TRACE_PER_SAMPLE.reset(token)


_TRACE_PER_SAMPLE: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_memstack_trace_per_sample", default=False)


def _segments(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, kwargs: Mapping[str, object]
) -> list[list[int]] | None:
    """Per row, its samples' lengths when this call may be split per sample; None when it runs whole."""
    positions = kwargs.get("position_ids")
    if (
        not torch.is_tensor(positions)
        or positions.dim() != 2
        or not torch.is_tensor(mask)
        or mask.dim() != 4
        or mask.dtype != torch.bool
        or torch.compiler.is_compiling()
    ):
        return None
    rows, tokens = query.shape[0], query.shape[2]
    if key.shape[2] != tokens or positions.shape[-1] != tokens or mask.shape[-2:] != (tokens, tokens):
        return None  # a cache, cross-attention or a mask of other keys: not a packed training row
    if positions.shape[0] not in (1, rows):
        return None
    if _is_fake(positions):
        return [[tokens // 2, tokens - tokens // 2]] * rows if _TRACE_PER_SAMPLE.get() and tokens > 1 else None
    if _LAST.answers(positions, mask, rows):  # every layer of one forward gets the same two tensors
        return _LAST.segments
    positions = positions.expand(rows, -1)
    starts = positions.diff(dim=-1) != 1  # [rows, tokens - 1]: token i + 1 begins a sample
    segments = _lengths(starts, rows, tokens) if bool(starts.any()) and _keeps_apart(mask, starts) else None
    _LAST.keep(cast(torch.Tensor, kwargs["position_ids"]), mask, rows, segments)  # a tensor: checked above
    return segments


class _LastSplit:
    """The last call's answer, for the same position ids and mask (weak references: a tensor freed
    and another made at its address is not taken for it) at the same versions."""

    def __init__(self) -> None:
        # (positions, their version, mask, its version, rows); empty before the first call
        self.refs: tuple[weakref.ref[torch.Tensor], int, weakref.ref[torch.Tensor], int, int] | tuple[()] = ()
        self.segments: list[list[int]] | None = None

    def answers(self, positions: torch.Tensor, mask: torch.Tensor, rows: int) -> bool:
        if not self.refs:
            return False
        p, pv, m, mv, r = self.refs
        return p() is positions and m() is mask and (pv, mv, r) == (positions._version, mask._version, rows)

    def keep(self, positions: torch.Tensor, mask: torch.Tensor, rows: int, segments: list[list[int]] | None) -> None:
        self.refs = (weakref.ref(positions), positions._version, weakref.ref(mask), mask._version, rows)
        self.segments = segments


_LAST = _LastSplit()


def _keeps_apart(mask: torch.Tensor, starts: torch.Tensor) -> bool:
    """Whether no token of ``mask`` attends to a token of another sample: every entry outside the
    samples' diagonal blocks is False. Transformers' packed masks are so; a 4-D mask of the caller's
    own may not be (a prompt shared by two responses: ``[prompt][chosen][rejected]``), and then the
    row runs whole. Bytes compared once per forward, against the attention's work per layer."""
    sample = torch.nn.functional.pad(starts, (1, 0)).cumsum(-1)  # [rows, tokens]: each token's sample
    same = sample[:, :, None] == sample[:, None, :]  # [rows, tokens, tokens]
    return not bool((mask & ~same[:, None]).any())


def _lengths(starts: torch.Tensor, rows: int, tokens: int) -> list[list[int]]:
    row_index, token_index = starts.nonzero(as_tuple=True)
    out: list[list[int]] = [[] for _ in range(rows)]
    begin = [0] * rows
    for r, i in zip(row_index.tolist(), token_index.tolist()):
        out[r].append(i + 1 - begin[r])
        begin[r] = i + 1
    for r in range(rows):
        out[r].append(tokens - begin[r])
    return out


def _is_causal_block(block: torch.Tensor) -> bool:
    """Whether a sample's mask block (``[heads or 1, n, n]``, boolean) is plain causal: ``torch.equal``
    on bytes, far cheaper than the attention it lets run with SDPA's ``is_causal`` kernel."""
    n = block.shape[-1]
    if n == 1:
        return bool(block.all())
    causal = torch.ones(n, n, dtype=torch.bool, device=block.device).tril_()
    return bool((block == causal).all())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.is_meta


# Registered when hf_memstack is imported, so that a model whose config names it (a prepared
# model's, copied into another process) finds it there too.
register_packed_attention()
