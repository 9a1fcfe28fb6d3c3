"""chunked_lm_loss: the next-token cross-entropy of a head over hidden states, a chunk of tokens at a
time (the fused path for a plain linear head, the checkpointed path for any other), equal to
Transformers' ``ForCausalLMLoss`` without the ``[tokens, vocab]`` logits; plus the id-range check
that names the bad id before an index error would."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint

from .fused_ce import _FusedLinearCrossEntropy

if TYPE_CHECKING:
    from peft.utils import ModulesToSaveWrapper
    from transformers import PretrainedConfig

__all__ = ["auto_chunk_tokens", "chunked_lm_loss", "head_rows", "labelled_as_traced"]

# Logits per chunk when chunk_tokens is None: about 16M (a 64 MiB fp32 chunk; with the
# compute-dtype copies about 130 MiB in flight, 4 bytes per logit more with a soft-cap): a few
# chunks for a batch worth chunking. Fewer, larger chunks are faster on CPU (each chunk adds one
# pass over the head's gradient), smaller ones hold less.
_AUTO_CHUNK_LOGITS = 2**24


def _check_ids_in_range(
    checks: list[tuple[str, Any, int, int | None]], *, model_name: str, where: str = "loss:chunked"
) -> None:
    """``(name, ids, vocabulary size, ignored id)``: one host sync for all of them together (a min/max
    per step, not per chunk); skipped while compiling, where it would break the graph. ``where``
    starts the message (who checked: the chunked loss, verify, measure_step)."""
    checks = [c for c in checks if torch.is_tensor(c[1]) and not c[1].is_floating_point() and c[1].numel()]
    # Fake and meta tensors (the estimator's trace) hold no values to check.
    if not checks or torch.compiler.is_compiling() or any(is_fake(t) or t.is_meta for _, t, _, _ in checks):
        return
    # The smallest and largest id of each tensor (ignored labels counted as 0), fetched together.
    device = checks[0][1].device
    ranges = torch.stack(
        [
            torch.stack(torch.aminmax(t if ignored is None else t.masked_fill(t == ignored, 0))).to(device)
            for _, t, _, ignored in checks
        ]
    ).tolist()
    failing = [c for c, (low, high) in zip(checks, ranges) if low < 0 or high >= c[2]]
    if not failing:
        return
    name, ids, size, ignored = failing[0]
    mask = (ids < 0) | (ids >= size)
    if ignored is not None:
        mask &= ids != ignored
    offending = ids[mask]
    hint = (
        f"; {ignored} (ignore_index) is the one label outside it, for positions without a loss"
        if ignored is not None
        else ""
    )
    raise ValueError(
        f"{where}: {name} holds id {int(offending.flatten()[0])} ({offending.numel()} id(s) in all) outside the "
        f"vocabulary of {model_name} ({size} ids: 0-{size - 1}){hint}. The tokenizer and the model disagree (after adding "
        "tokens, call model.resize_token_embeddings(len(tokenizer)) before prepare_model), or make_batch/the collator "
        f"builds ids outside 0-{size - 1}"
    )


# ------------------------------------------------------------------------------------------- loss
def chunked_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_tokens: int,
    softcap: float | None = None,
    logit_multiplier: float = 1.0,
    compiled: bool = False,
) -> torch.Tensor:
    """Next-token cross-entropy of ``head(hidden)`` without the full logits; equal to Transformers'
    ``ForCausalLMLoss`` (labels shifted left, ``ignore_index`` skipped, ``sum / num_items_in_batch``
    when given - gradient accumulation, as Trainer passes it - else the mean over counted tokens).
    Only the positions whose target is not ``ignore_index`` go through the head (a prompt-masked
    batch's head costs its labelled share; inside a compiled model every position does).

    Args:
        hidden: the backbone's last hidden states, ``[batch, seq, hidden]``.
        head: the output head (``model.get_output_embeddings()``).
        labels: ``[batch, seq]`` token ids (shifted here), or ``shift_labels`` already aligned with ``hidden``.
        chunk_tokens: tokens per chunk.
        softcap, logit_multiplier: the head's transform of its logits (``softcap * tanh(m * z / softcap)``).
        compiled: each chunk's softmax, loss and logit gradient run as one ``torch.compile``d function
            (Inductor fuses the passes over the ``[chunk, vocab]`` logits; the matmuls stay eager). A
            plain linear head only; the first call compiles (seconds).

    Raises:
        ValueError: a label (other than ``ignore_index``) outside the head's vocabulary.
    """
    vocab = _head_outputs(head)
    if vocab is not None:
        _check_ids_in_range(
            [(name, t, vocab, ignore_index) for name, t in (("labels", labels), ("shift_labels", shift_labels))],
            model_name=type(head).__name__,
        )
    return _chunked_lm_loss(
        hidden,
        head,
        labels=labels,
        shift_labels=shift_labels,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        chunk_tokens=chunk_tokens,
        softcap=softcap,
        logit_multiplier=logit_multiplier,
        compiled=compiled,
    )


def _chunked_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    *,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int,
    chunk_tokens: int,
    softcap: float | None,
    logit_multiplier: float,
    compiled: bool = False,
) -> torch.Tensor:
    _check_target_layout(hidden, labels, shift_labels)
    unlabelled = 0  # positions that carry no loss whatever the labels: each row's last, when shifted here
    if shift_labels is None:
        if labels is None:  # a TypeError, as F.pad(None) raised before this check
            raise TypeError("chunked_lm_loss: pass labels or shift_labels (the targets of the loss)")
        # As ForCausalLMLoss: position i predicts labels[i + 1]; the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        unlabelled = labels.shape[:-1].numel()
    targets = shift_labels.reshape(-1).to(hidden.device)
    counted = (targets != ignore_index).sum()
    flat, targets = _labelled_rows(hidden.reshape(-1, hidden.shape[-1]), targets, ignore_index, unlabelled)
    linear = _plain_linear(head)
    if linear is not None:
        weight, bias = _full(linear.weight), _full(linear.bias) if linear.bias is not None else None
        total = _FusedLinearCrossEntropy.apply(
            flat,
            weight,
            bias,
            targets,
            chunk_tokens,
            logit_multiplier,
            softcap,
            _compute_dtype(flat, weight),
            ignore_index,
            compiled,
        )
    else:
        total = _checkpointed_chunks(flat, head, targets, chunk_tokens, logit_multiplier, softcap, ignore_index)
    if num_items_in_batch is None:
        # Over zero counted items, as ForCausalLMLoss's mean: a nan loss whose gradients are 0 (not nan).
        return torch.where(counted > 0, total / counted.clamp(min=1), torch.nan)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _check_target_layout(hidden: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> None:
    """Targets of another shape than the positions the model ran would be matched to the wrong
    positions after flattening (Transformers' own loss stops on the count): refused, as are targets
    that are not integer token ids."""
    positions = list(hidden.shape[:-1])
    for name, t in (("labels", labels), ("shift_labels", shift_labels)):
        if not torch.is_tensor(t):
            continue
        if list(t.shape) != positions:
            raise ValueError(
                f"loss:chunked: {name} has shape {list(t.shape)}, but the model ran {positions} positions (batch, "
                f"sequence). Give {name} the shape of input_ids, {positions}: labels are shifted inside the loss "
                "(as Transformers does); targets you shifted yourself go in shift_labels, padded at the end with -100"
            )
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(
                f"loss:chunked: {name} has dtype {t.dtype}; it holds token ids, an integer dtype "
                f"(torch.long, as the tokenizer gives). Convert it with {name}.long()"
            )


def _labelled_rows(
    flat: torch.Tensor, targets: torch.Tensor, ignore_index: int, unlabelled: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose target carries loss, and their targets: only they go through the head (a masked
    row adds nothing to the loss nor to any gradient, so nothing is scattered back; the backward of
    the gather gives the masked rows their zero gradient). All rows when all count (no copy), and
    inside a compiled model (a data-dependent row count would break its graph). A batch without a
    counted row keeps its first row (ignored: it adds 0), so the loss still has its graph and its
    model's answer (nan over zero items, 0 with ``num_items_in_batch``)."""
    if torch.compiler.is_compiling():
        return flat, targets
    if is_fake(targets) or targets.is_meta:
        # The estimator's trace holds no label values: it runs the fraction it was told is labelled
        # of the positions that can carry loss (``unlabelled``: each row's last, which never does).
        rows = max(1, math.ceil((targets.shape[0] - unlabelled) * _TRACED_LABEL_FRACTION.get()))
        if rows >= targets.shape[0]:
            return flat, targets
        keep = torch.arange(rows, device=flat.device)
    else:
        keep = (targets != ignore_index).nonzero().squeeze(1)
        if keep.numel() == targets.shape[0]:
            return flat, targets
        if keep.numel() == 0:
            keep = keep.new_zeros(1)
    return flat.index_select(0, keep), targets.index_select(0, keep)


def head_rows(
    labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int = -100
) -> tuple[int, int]:
    """``(rows through the head, positions)`` for a batch's labels, as the chunked loss gathers them."""
    if shift_labels is None:
        if labels is None:
            return 0, 0
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    counted = int((shift_labels != ignore_index).sum())
    return max(1, counted), shift_labels.numel()


@contextlib.contextmanager
def labelled_as_traced(fraction: float) -> Iterator[None]:
    """Within: on fake tensors (the estimator's, whose labels have no values) the chunked loss runs
    the head over ``fraction`` of the positions, as it runs over the labelled ones on real data."""
    token = _TRACED_LABEL_FRACTION.set(fraction)
    try:
        yield
    finally:
        _TRACED_LABEL_FRACTION.reset(token)


_TRACED_LABEL_FRACTION: contextvars.ContextVar[float] = contextvars.ContextVar(
    "hf_memstack_traced_label_fraction", default=1.0
)


def _checkpointed_chunks(
    flat: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunk: int,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
) -> torch.Tensor:
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk):
        total = total + checkpoint(
            _head_chunk_loss,
            head,
            flat[start : start + chunk],
            targets[start : start + chunk],
            multiplier,
            softcap,
            ignore_index,
            use_reentrant=False,
        )
    return total


def _head_chunk_loss(
    head: nn.Module, h: torch.Tensor, y: torch.Tensor, multiplier: float, softcap: float | None, ignore_index: int
) -> torch.Tensor:
    z = head(h).float()  # the head runs under the caller's autocast: its matmul stays in the compute dtype
    if multiplier != 1.0:
        z = z * multiplier
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")


# ---------------------------------------------------------------------------------------- helpers
def _plain_linear(head: nn.Module | None) -> nn.Linear | None:
    """The ``nn.Linear`` that computes the head's output (through PEFT's ``modules_to_save`` copy), or None."""
    if type(head).__name__ == "ModulesToSaveWrapper":
        wrapper = cast("ModulesToSaveWrapper", head)  # seen by name: PEFT is optional
        # As ModulesToSaveWrapper.forward: the active adapter's copy, else the original module.
        active = list(getattr(wrapper, "active_adapters", []) or [])
        off = wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active)
        head = wrapper.original_module if off else wrapper.modules_to_save[active[0]]
    return head if type(head) is nn.Linear else None


def _full(t: torch.Tensor) -> torch.Tensor:
    # A head sharded on its own (a DTensor outside its FSDP unit's forward): gather it once per step.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _vocab_size(head: nn.Module | None, config: PretrainedConfig) -> int:
    return _head_outputs(head) or int(getattr(config, "vocab_size", 0) or 32000)


def _head_outputs(head: nn.Module | None) -> int | None:
    """The head's number of outputs (through PEFT's wrappers: a LoRA layer's base layer), or None."""
    linear = _plain_linear(head)
    if linear is not None:
        return int(linear.out_features)
    base = getattr(head, "base_layer", head)
    out = getattr(base, "out_features", None)
    return out if isinstance(out, int) else None


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk when ``chunk_tokens`` is None: about 16M logits per chunk."""
    return max(1, _AUTO_CHUNK_LOGITS // max(1, vocab_size))
