"""check_batch: what a step's batch must be before any forward, checked in one place for verify,
measure_step and the batch-size finder's first sample.

Without it, each bad batch fails deep in the model in torch's words, naming no field: ids outside
the vocabulary are ``IndexError: index out of range in self`` from the embedding (a device-side
assert on CUDA), labels of another length are ``Expected input batch_size (32) to match target
batch_size (26)`` from the loss, and an attention mask of another length is even taken silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..record import unwrap_model
from ..transforms.loss_head.apply import supports_chunked_loss
from ..transforms.loss_head.chunked import _check_ids_in_range, _vocab_size

__all__ = ["check_batch", "no_labelled_token"]

IGNORE_INDEX = -100
"""The label Transformers' losses skip (prompt tokens, padding)."""
_MULTIMODAL_FIELDS = ("vision_config", "audio_config", "image_token_id", "image_token_index", "video_token_id")


def check_batch(model: nn.Module, batch: object, *, where: str) -> None:
    """Refuse a batch ``model`` cannot run a step on, naming the field, its shape or value, and the fix.

    Checks: no tensor is empty; in a dict batch, ``input_ids`` are integers within the input
    embedding's vocabulary, ``labels`` and ``attention_mask`` have its rows (a causal LM's labels and
    a 2-D mask its shape), a causal LM's labels are within its head's vocabulary or -100. A batch
    whose every label is -100 runs (and trains nothing): :func:`no_labelled_token` says so.

    Raises:
        TypeError: ``input_ids`` that are not integers.
        ValueError: any other of the above, prefixed with ``where`` (e.g. ``verify``).
    """
    _refuse_empty(batch, where=where)
    if not isinstance(batch, Mapping):
        return  # positional batches: which tensor is which is the model's business
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.ndim == 0:
        return
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"{where}: input_ids has dtype {ids.dtype}: token ids are integers (torch.long, as a tokenizer returns them); "
            "pass the tokenizer's input_ids, or inputs_embeds for vectors"
        )
    causal = supports_chunked_loss(model)  # a causal LM: its labels are its next tokens
    _check_shapes(batch, ids, causal=causal, where=where)
    target = unwrap_model(model)
    ranges: list[tuple[str, torch.Tensor, int, int | None]] = []
    vocab_in = _input_vocabulary(target)
    if vocab_in is not None:
        ranges.append(("input_ids", ids, vocab_in, None))
    labels = batch.get("labels")
    if causal and torch.is_tensor(labels):
        get_head = getattr(target, "get_output_embeddings", None)
        config: Any = getattr(target, "config", None)  # a causal LM: a Transformers model, with its config
        vocab_out = _vocab_size(get_head() if callable(get_head) else None, config)
        ranges.append(("labels", labels, vocab_out, IGNORE_INDEX))
    _check_ids_in_range(ranges, model_name=type(target).__name__, where=where)


def _refuse_empty(batch: object, *, where: str) -> None:
    """An empty batch (0 rows or 0 tokens) runs no step: the model's own forward fails deep
    inside (a reshape), so say which field is empty instead."""
    if isinstance(batch, Mapping):
        fields = [(f"batch[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (list, tuple)):
        fields = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        fields = [("batch", batch)]
    for name, value in fields:
        if torch.is_tensor(value) and value.ndim > 0 and value.numel() == 0:
            raise ValueError(
                f"{where}: {name} has shape {tuple(value.shape)}: an empty batch (0 rows or 0 tokens) runs no step; "
                "pass a batch of at least one sample with at least one token"
            )


def _check_shapes(batch: Mapping[str, object], ids: torch.Tensor, *, causal: bool, where: str) -> None:
    """``labels`` and ``attention_mask`` against ``input_ids``: the same rows; a causal LM's labels
    (one per token, shifted inside the model) and a 2-D mask (one entry per token) the same shape."""
    labels, mask = batch.get("labels"), batch.get("attention_mask")
    if torch.is_tensor(labels) and labels.ndim > 0:
        full = causal and ids.ndim == 2
        if labels.shape[0] != ids.shape[0] or (full and labels.shape != ids.shape):
            what = "one label per token (the model shifts them): the same shape" if full else "one row per sample"
            raise ValueError(
                f"{where}: labels has shape {tuple(labels.shape)} and input_ids {tuple(ids.shape)}; they must have "
                f"{what}. Build both from the same rows and pad them to the same length (a collator such as "
                "DataCollatorForLanguageModeling, or hf_memstack.data's packing collator, does)"
            )
    # A longer mask is the generation's (past tokens + new ones): not a training step's batch.
    if torch.is_tensor(mask) and mask.ndim > 0 and batch.get("past_key_values") is None:
        if mask.shape[0] != ids.shape[0] or (mask.ndim == 2 and ids.ndim == 2 and mask.shape != ids.shape):
            raise ValueError(
                f"{where}: attention_mask has shape {tuple(mask.shape)} and input_ids {tuple(ids.shape)}; a 2-D mask "
                "has one entry per token (1: attend, 0: padding), the same shape as input_ids. Take both from one "
                "tokenizer or collator call, padded together"
            )


def _input_vocabulary(target: nn.Module) -> int | None:
    """The input embedding's number of ids, or None (no ``get_input_embeddings``, or not an ``nn.Embedding``;
    a multimodal model, whose image or audio placeholder ids may lie past the text embedding: Llava's
    forward swaps an ``image_token_id >= vocab_size`` out before the lookup)."""
    config = getattr(target, "config", None)
    if any(hasattr(config, n) for n in _MULTIMODAL_FIELDS):
        return None
    get = getattr(target, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):  # Transformers' default for a model without one
        return None
    size = getattr(embedding, "num_embeddings", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def no_labelled_token(model: nn.Module, batch: object) -> str | None:
    """Why ``batch`` trains nothing - every label is -100, so the mean loss is 0/0 (nan) and every
    gradient 0 - or None (a label counts, or the batch has no integer ``labels``)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not torch.is_tensor(labels) or labels.is_floating_point() or labels.numel() == 0:
        return None
    causal = supports_chunked_loss(model)
    # A causal LM predicts token t+1 from token t: the first label of each row is never a target.
    targets = labels[..., 1:] if causal and labels.ndim == 2 else labels
    if targets.numel() and not bool((targets == IGNORE_INDEX).all()):
        return None
    past_first = " past each row's first token (which a causal LM never predicts)" if causal else ""
    return (
        f"every label in labels (shape {tuple(labels.shape)}) is {IGNORE_INDEX}{past_first}: the batch has no labelled "
        "token, so its loss is 0/0 = nan and every gradient 0, and nothing trains on it. Pass a batch with labelled "
        "tokens (prompt masking or truncation can mask every response token of a sample)"
    )
