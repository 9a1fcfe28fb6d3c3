"""loss_head_verify: verify's ``loss`` check - the chunked loss head computes the model's own loss.

The chunked head replaces the model's loss arithmetic (chunks of the vocabulary projection, each
recomputed in the backward); a head that computed a different loss would train silently wrong, so
verify compares the two on one sample. Under a trainer that computes the loss itself (TRL's DPO and
KTO: verify runs its ``compute_loss``, the model gets no labels) the chunked head never runs, so
there is nothing to compare: the check says so and passes.
"""

from __future__ import annotations

import contextlib
import math
from typing import cast

import torch
from torch import nn

from ..._device import module_mode
from ..._unwrap import unwrap_model
from ...distributed._ranks import on_every_rank
from ...measure.step import LossFn, forward_loss
from .._wrappers import forward_wrapper, fused_lm_head_installed
from .chunked import head_rows
from .forward import ChunkedLossForward

__all__ = ["verify_loss_head"]


def verify_loss_head(
    model: nn.Module, batch: object, loss_fn: LossFn | None, *, mixed: bool, shared: bool
) -> tuple[bool, str]:
    """The chunked loss against the model's own, on the first sample (the model's own forward
    materialises its logits: one sample keeps that small); ``mixed``: the policy's precision is bf16/fp16."""
    if getattr(model, "computes_loss_itself", False):
        return True, _trainer_loss_detail(model)
    one = _first_sample(batch)
    chunked = forward_wrapper(unwrap_model(model), ChunkedLossForward)
    # In eval mode: the check compares the head's arithmetic, so no dropout draws different masks
    # in the two forwards (nor per chunk, for a LoRA head with dropout).
    with torch.no_grad(), module_mode(model, training=False):
        # without gradients, the model's own forward runs
        theirs = on_every_rank("verify: the model's own loss", lambda: forward_loss(model, one, loss_fn), shared=shared)
        with chunked.without_gradients() if chunked is not None else contextlib.nullcontext():
            ours = on_every_rank("verify: the chunked loss", lambda: forward_loss(model, one, loss_fn), shared=shared)
    a, b = float(ours.detach()), float(theirs)
    # fp32: the same sums in another order; bf16/fp16: the head's matmul rounds differently per chunk.
    tolerance = 2e-2 if mixed else 1e-4
    ok = abs(a - b) <= tolerance * max(1.0, abs(b))
    where = "the first sample with a labelled token" if one is not batch else "the whole batch (not batch-major)"
    detail = f"chunked loss {a:.5f}, the model's own {b:.5f} on {where}"
    if not math.isfinite(b):  # nan against nan is no difference of the heads: the sample gives no loss to compare
        detail += ": the model's own loss is not finite, so the heads cannot be compared; check the weights and labels"
    elif not ok:
        detail += ": they differ; prepare the model without loss:chunked"
    return ok and math.isfinite(a), detail + _head_rows_detail(model, one)


def _trainer_loss_detail(model: nn.Module) -> str:
    """Why the heads are not compared when ``model`` is a trainer's ``compute_loss`` (the callback's
    ``TrainerLoss``). Running it on one sample breaks DPO (its batch is [chosen; rejected], split in
    two), and on the whole batch both runs would compute the same loss, TRL's, in the same head: a
    comparison that cannot fail checks nothing."""
    trainer = type(getattr(model, "trainer", None)).__name__
    detail = (
        f"skipped: {trainer}'s compute_loss computes the loss from the model's outputs without giving it labels, "
        "so hf_memstack's chunked loss head does not run in training and there is no second loss to compare"
    )
    if fused_lm_head_installed(unwrap_model(model)):
        detail += " (TRL's own chunked LM head takes its place)"
    return detail


def _head_rows_detail(model: nn.Module, sample: object) -> str:
    """How many of the sample's positions went through the head (those with a label to predict)."""
    if not isinstance(sample, dict) or not torch.is_tensor(sample.get("labels")):
        return ""
    rows, positions = head_rows(sample["labels"], sample.get("shift_labels"), sample.get("ignore_index", -100))
    if any(getattr(m, "_compiled_call_impl", None) is not None for m in (model, unwrap_model(model))):
        # compile:full traces the loss into the model's graph, where a data-dependent row count would break it.
        return f"; the head runs over all {positions} positions under compile:full (verify ran it eagerly over {rows})"
    return f"; the head ran over {rows} of its {positions} positions (those with a label)"


def _first_sample(batch: object) -> object:
    """One sample of ``batch``: the first with a label other than -100 past its first token (a
    sample without one has no loss, nan in both heads), else the first. A batch that is not
    batch-major (Qwen2-VL's ``pixel_values`` are ``[patches of all images, values]``, its
    ``image_grid_thw`` one row per image) cannot be cut by rows: it is compared whole."""
    row = 0
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if isinstance(batch, dict) and not _batch_major(batch):
        return batch
    if torch.is_tensor(labels) and labels.dim() == 2 and not labels.is_floating_point():
        labelled = (labels[:, 1:] != -100).any(dim=1).nonzero()
        row = int(labelled[0]) if len(labelled) else 0
    if isinstance(batch, dict):
        return {k: v[row : row + 1] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(v[:1] if torch.is_tensor(v) and v.dim() > 0 else v for v in batch)
    return batch[:1] if torch.is_tensor(batch) else batch


def _batch_major(batch: dict[str, object]) -> bool:
    """Whether every tensor of ``batch`` has one row per sample (as many as its ``input_ids``, or
    ``labels``, have)."""
    anchor = cast(
        "torch.Tensor | None", next((batch[k] for k in ("input_ids", "labels") if torch.is_tensor(batch.get(k))), None)
    )
    if anchor is None or anchor.dim() == 0:
        return True
    rows = anchor.shape[0]
    return all(v.shape[0] == rows for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)
