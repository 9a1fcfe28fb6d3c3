"""Sample boundaries in a packed batch: where they are (``position_ids`` restarting), what would
silently erase them, and the check that they hold.

Measured with Transformers 5.24 on Llama, Qwen2 and GPT-2, SDPA and eager: a packed row with
``position_ids`` restarting per sample, no attention mask and ``use_cache=False`` gives every
sample exactly the logits it has alone; with a 2-D attention mask (even all ones, transformers#46634),
or with ``use_cache`` on (the config's default, also in training, unless checkpointing forces it
off) Transformers skips its packed-sequence detection and the later samples attend to the earlier
ones - logits off by 0.2-0.6 on tiny models, and the loss still falls. :func:`check_packed_batch`
refuses both, and an attention implementation that ignores the boundaries (found by a probe: two
short samples packed against the second alone). :func:`compare_packed_to_separate` is ``verify``'s
check: the per-token losses of packed rows against each sample run alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .._device import device_of, module_mode, preserved_rng
from ..record import unwrap_model
from ..transforms.packed_attention import PACKED_SDPA
from ..transforms.sequence_parallel.attention import ULYSSES_ATTENTION

__all__ = [
    "PackedComparison",
    "packing_as_traced",
    "attention_respects_boundaries",
    "check_packed_batch",
    "compare_packed_to_separate",
    "is_packed",
    "segment_lengths",
]

# Attention implementations that Transformers 5.x points at packed position_ids: the mask
# functions of masking_utils (SDPA, eager, flex), flash-attention's variable-length kernels, and
# prepare_model's per-sample SDPA and Ulysses attention (sp:N: each sample from the whole rows' positions).
_BOUNDARY_AWARE = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    PACKED_SDPA,
    ULYSSES_ATTENTION,
)


def is_packed(position_ids: object, attention_mask: object = None) -> bool:
    """True when some row of ``position_ids`` (``[rows, tokens]``) restarts: several samples share it.

    A row that is one sample counting 0, 1, 2, ... is not packed, and neither is a padded row whose
    masked positions hold anything (left padding's ``[1, 1, 0, 1, 2]`` with mask ``[0, 0, 1, 1, 1]``):
    with a 2-D ``attention_mask``, the positions of the attended tokens are read in order, masked
    ones skipped - so samples separated by masked tokens (``attention_mask = input_ids != pad`` with
    the pad token also ending every sample) are packed too. One device sync on a GPU."""
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return False
    restarts = position_ids.diff(dim=-1) != 1
    if torch.is_tensor(attention_mask) and attention_mask.shape == position_ids.shape:
        attended = attention_mask.to(torch.bool)
        restarts &= attended[:, 1:] & attended[:, :-1]
        restarts |= _restarts_across_masked_tokens(position_ids, attended)
    return bool(restarts.any())


def _restarts_across_masked_tokens(position_ids: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """``[rows, tokens - 1]``: an attended token after masked ones whose position does not go on
    from the last attended token before them (it restarts, or repeats)."""
    index = torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
    last = torch.where(attended, index, -1).cummax(dim=1).values[:, :-1]  # the last attended token before each one
    before = position_ids.gather(1, last.clamp(min=0))
    return attended[:, 1:] & ~attended[:, :-1] & (last >= 0) & (position_ids[:, 1:] <= before)


def segment_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the lengths of its samples: the runs over which the positions count up by one."""
    out = []
    for row in position_ids.detach().cpu().tolist():
        starts = [0] + [i for i in range(1, len(row)) if row[i] - row[i - 1] != 1] + [len(row)]
        out.append([b - a for a, b in zip(starts, starts[1:])])
    return out


def check_packed_batch(model: nn.Module, batch: Mapping[str, object], *, probe: bool = True) -> bool:
    """Raise when a packed ``batch`` would let its samples attend to each other on ``model``.
    Returns whether the batch is packed (False: nothing to check).

    Raises:
        ValueError: the batch has a 2-D ``attention_mask`` (drop it); ``use_cache`` resolves to
            True or a ``past_key_values`` is given (pass ``use_cache=False``; ``prepare_model`` sets
            ``config.use_cache=False``); the model's attention ignores the boundaries (checked
            with a probe when ``probe``, else from the attention implementation's name).
    """
    if not isinstance(batch, Mapping) or not is_packed(batch.get("position_ids"), batch.get("attention_mask")):
        return False
    _check_no_2d_mask(batch.get("attention_mask"))
    _check_no_cache(model, batch)
    respects = attention_respects_boundaries(model) if probe else _known_boundary_aware(model)
    if not respects:
        raise ValueError(ignores_boundaries_message(model))
    return True


def ignores_boundaries_message(model: nn.Module) -> str:
    """The refusal for a model whose attention lets packed samples see each other."""
    head = (
        f"{type(_unwrapped(model)).__name__} (attn_implementation={_attn_implementation(model)!r}) lets the samples of a "
        "packed batch attend to each other: two samples packed in one row give the second other logits than it has "
        "alone. "
    )
    if _known_boundary_aware(model):  # the attention would keep them apart: the model's own code does not
        return head + (
            "Its attention implementation reads the boundaries, so the model's own code crosses them (it may build its "
            "positions or mask from the attention mask instead of position_ids, as OPT does): do not pack it (pad each "
            "sample: DataCollatorWithPadding)"
        )
    return head + (
        "Packed batches need a causal LM whose attention reads position_ids boundaries (Transformers 5: "
        f"{', '.join(_BOUNDARY_AWARE)}); load it with one, or do not pack (pad each sample: DataCollatorWithPadding)"
    )


def _check_no_2d_mask(mask: object) -> None:
    if torch.is_tensor(mask) and mask.dim() == 2:
        raise ValueError(
            "attention_mask: a packed batch (position_ids restart inside a row) has a 2-D attention_mask; with it Transformers "
            "skips its packed-sequence detection and every sample attends to the ones before it in the row - silently, the "
            "loss still falls (transformers#46634). Drop attention_mask from packed batches (hf_memstack.data.PackedCollator "
            "and DataCollatorWithFlattening make none), or pass a 4-D block-diagonal mask of your own"
        )


def _check_no_cache(model: nn.Module, batch: Mapping[str, object]) -> None:
    if batch.get("past_key_values") is not None:
        raise ValueError(
            "past_key_values: a packed batch with a KV cache attends across samples (Transformers skips its "
            "packed-sequence detection when a cache is given); do not pass a cache with packed batches"
        )
    use_cache = batch.get("use_cache")
    config = getattr(_unwrapped(model), "config", None)
    if use_cache is None:
        use_cache = bool(getattr(config, "use_cache", False))
    if use_cache:
        where = "use_cache=True in the call" if batch.get("use_cache") else "model.config.use_cache=True"
        raise ValueError(
            f"use_cache: a packed batch with {where}: Transformers then builds a KV cache, skips its packed-sequence detection "
            "and every sample attends to the ones before it in the row (logits off by ~0.2-2; hidden while checkpointing "
            "forces the cache off). Set model.config.use_cache=False (prepare_model does) or pass use_cache=False"
        )


def attention_respects_boundaries(model: nn.Module) -> bool:
    """Whether ``model`` keeps packed samples apart: two short samples packed in one row against
    the second one alone, in eval mode, without gradients (weights and RNG untouched). Models with
    fake or meta weights (the estimator) are judged by their attention implementation's name."""

    inner = _unwrapped(model)
    if not _has_values(inner):
        return _known_boundary_aware(model)
    device = device_of(inner)
    vocab = int(getattr(getattr(inner, "config", None), "vocab_size", 0) or 2)
    first, second = 5, 4
    ids = (torch.arange(first + second, device=device).unsqueeze(0) * 7919 + 11) % max(vocab, 2)
    positions = torch.cat([torch.arange(first), torch.arange(second)]).unsqueeze(0).to(device)
    with torch.no_grad(), preserved_rng(device), module_mode(inner, training=False):
        packed = _logits(inner, ids, positions, use_cache=False)
        alone = _logits(inner, ids[:, first:], positions[:, first:], use_cache=False)
    if packed is None or alone is None:
        return False
    scale = max(1.0, float(alone.abs().max()))
    return float((packed[:, first:] - alone).abs().max()) <= 5e-2 * scale


def _logits(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, **extra: object) -> torch.Tensor | None:
    out = model(input_ids=ids, position_ids=positions, **extra)
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if not torch.is_tensor(logits) or logits.dim() != 3:
        return None  # not a model with per-token outputs: packing does not apply
    return logits.float()


def _known_boundary_aware(model: nn.Module) -> bool:
    return _attn_implementation(model) in _BOUNDARY_AWARE


def _attn_implementation(model: nn.Module) -> str | None:
    config = getattr(_unwrapped(model), "config", None)
    return getattr(config, "_attn_implementation", None)


@contextlib.contextmanager
def packing_as_traced(packed: bool) -> Iterator[None]:
    """Within: Transformers' packed-sequence detection answers ``packed`` instead of reading the
    position ids - for the estimator, whose fake tensors have no values. Transformers takes every
    batch it cannot read for a packed one, and would build (and the estimate count) a dense
    ``[batch, 1, seq, seq]`` mask that the real run of an unpacked batch never makes. For a packed
    batch its own answer is kept (the mask, and its shape, are real). Restored on exit."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    if not packed:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedComparison:
    """``verify``'s packing check: the packed rows' per-token losses against each sample run alone."""

    rows: int
    """Packed rows compared."""
    samples: int
    """Samples run alone."""
    tokens: int
    """Labelled tokens compared."""
    max_abs_diff: float
    """The largest per-token loss difference."""
    worst: tuple[int, int] | None
    """``(row, sample in the row)`` of the largest difference."""
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def describe(self) -> str:
        where = f" (row {self.worst[0]}, sample {self.worst[1]})" if self.worst else ""
        text = (
            f"{self.samples} samples of {self.rows} packed row(s) run alone: per-token losses of {self.tokens} tokens "
            f"differ by at most {self.max_abs_diff:.2e}{where} (tolerance {self.tolerance:g})"
        )
        if not self.ok:
            text += (
                ": the samples of a packed row attend to each other. Drop any attention_mask from packed batches, keep "
                "use_cache=False, and use an attention implementation that reads position_ids (sdpa, eager, flash)"
            )
        return text


def compare_packed_to_separate(
    model: nn.Module, batch: Mapping[str, object], *, max_samples: int = 8, tolerance: float = 1e-3
) -> PackedComparison:
    """Run the packed ``batch`` and each of its first ``max_samples`` samples alone (positions from
    0, no mask), without gradients and in eval mode, and compare their per-token losses on the
    labelled tokens (labels default to the input ids)."""

    # The batch's token tensors (its other entries, such as use_cache, are passed on as they are).
    ids, positions = cast(torch.Tensor, batch["input_ids"]), cast(torch.Tensor, batch["position_ids"])
    labels = cast("torch.Tensor | None", batch.get("labels"))
    labels = ids if labels is None else labels
    device = device_of(model)
    worst, rows, samples, tokens, biggest = None, 0, 0, 0, 0.0
    with torch.no_grad(), preserved_rng(device), module_mode(model, training=False):
        # The packed rows as the batch has them (its mask, its use_cache: what is being checked).
        # Not fused_lm_head: TRL's fused head returns a loss, not the per-token logits compared here.
        extra = {
            k: v
            for k, v in batch.items()
            if k not in ("input_ids", "position_ids", "labels", "shift_labels", "num_items_in_batch", "fused_lm_head")
        }
        packed = _token_losses(model, ids, positions, labels, **extra)
        for r, lengths in enumerate(segment_lengths(positions)):
            if samples >= max_samples:
                break
            rows += 1
            start = 0
            for s, n in enumerate(lengths):
                span = slice(start, start + n)
                start += n
                counted = labels[r, span][1:] != -100
                if samples >= max_samples or not bool(counted.any()):
                    continue
                alone = _token_losses(
                    model,
                    ids[r : r + 1, span],
                    torch.arange(n, device=ids.device).unsqueeze(0),
                    labels[r : r + 1, span],
                    use_cache=False,
                )[0]
                diff = float((packed[r, span.start : span.stop - 1][counted] - alone[counted]).abs().max())
                samples, tokens = samples + 1, tokens + int(counted.sum())
                if worst is None or diff > biggest:
                    worst, biggest = (r, s), diff
    return PackedComparison(
        rows=rows, samples=samples, tokens=tokens, max_abs_diff=biggest, worst=worst, tolerance=tolerance
    )


def _token_losses(
    model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor, **extra: object
) -> torch.Tensor:
    """``[rows, tokens - 1]``: the loss of predicting each next token (0 where its label is -100)."""
    logits = _logits(model, ids, positions, **extra)
    if logits is None:
        raise ValueError(
            f"{type(model).__name__} returns no per-token logits: packed batches are for causal language models"
        )
    targets = labels[:, 1:].to(logits.device)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets.clamp(min=0), reduction="none")
    return losses.masked_fill(targets == -100, 0.0)


def _unwrapped(model: nn.Module) -> nn.Module:

    return unwrap_model(model)


def _has_values(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(p.is_meta or isinstance(p, FakeTensor) for p in model.parameters())
