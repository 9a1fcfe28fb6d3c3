"""What ``Trainer.evaluate()`` / ``predict()`` keeps of each evaluation batch, in bytes.

``Trainer.prediction_step`` keeps every tensor of the model's outputs but the loss and the config's
``keys_to_ignore_at_inference`` (``past_key_values`` for most decoders), and ``evaluation_loop``
concatenates them across the whole dataset (padded to its longest sample) on the device, unless
``eval_accumulation_steps`` moves them to host memory every N batches (transformers#12878). At the
end they become numpy arrays, bf16 ones as fp32 (numpy has no bfloat16: ``nested_numpify``). None of
this happens when ``prediction_loss_only`` holds (``evaluate()`` without ``compute_metrics`` sets it),
and ``preprocess_logits_for_metrics`` (e.g. an argmax) replaces what is kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["KeptOutputs", "kept_outputs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class KeptOutputs:
    """The outputs Trainer keeps for one batch."""

    device_bytes: int
    """Bytes of the kept tensors as the model returns them (on its device, in their dtypes)."""
    host_bytes: int
    """Bytes of the same as the numpy arrays Trainer hands ``compute_metrics`` (bf16 as fp32)."""
    dtypes: tuple[str, ...]
    """The kept tensors' dtypes (``torch.float32``...), in order."""


def kept_outputs(outputs: object, ignore_keys: list[str] | tuple[str, ...] | None = None) -> KeptOutputs:
    """What ``Trainer.prediction_step`` keeps of ``outputs``: every tensor but ``loss`` and
    ``ignore_keys`` (``config.keys_to_ignore_at_inference``; Trainer's default is ``["cache"]``),
    nested tuples and dicts walked (a Transformers ``ModelOutput`` is a dict; cache objects hold no
    tensors Trainer keeps)."""
    ignore = set(ignore_keys if ignore_keys is not None else ["cache"]) | {"loss"}
    if isinstance(outputs, Mapping):
        kept: object = [v for k, v in outputs.items() if k not in ignore]
    else:
        kept = outputs
    tensors = _tensors(kept)
    device = sum(t.numel() * t.element_size() for t in tensors)
    host = sum(t.numel() * (4 if t.dtype == torch.bfloat16 else t.element_size()) for t in tensors)
    return KeptOutputs(device_bytes=device, host_bytes=host, dtypes=tuple(str(t.dtype) for t in tensors))


def _tensors(value: object) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []  # a cache object or None: Trainer's containers keep tensors only
