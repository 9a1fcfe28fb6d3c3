"""The batches ``hf-memstack find-batch-size`` measures with: random token ids of the model's
vocabulary (a composite config's text vocabulary), labelled for the task, and for a vision-language
model its images' pixels and placeholder tokens as its processor makes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .vision_inputs import image_batch, images_for, pixel_tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["synthetic_batches"]


def synthetic_batches(
    config: PretrainedConfig,
    task: str,
    seq_len: int,
    device: str,
    *,
    image_size: int | None = None,
    images_per_sample: int | None = None,
) -> Callable[[int], dict[str, torch.Tensor]]:
    """``make_batch(n)`` for the finder: n samples of ``seq_len`` tokens. A vision-language model's
    samples each hold ``images_per_sample`` images (default one) of ``image_size`` pixels a side (default
    the family's): measured without its pixels, the answer would be a text-only job's.

    Raises:
        ValueError: image sizes given for a text model, or images that do not fit in ``seq_len``.
    """
    images = images_for(config, image_size, images_per_sample, seq_len, task)
    vocab = int(config.get_text_config().vocab_size)  # a composite config's (Gemma-3, Qwen2-VL) is its text model's

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        if images is not None:
            ints, floats = image_batch(config, images, n, seq_len)
            return {k: t.to(device) for k, t in {**ints, **pixel_tensors(floats)}.items()}
        ids = torch.randint(0, vocab, (n, seq_len), device=device)
        if task == "classification":
            return {"input_ids": ids, "labels": torch.zeros(n, dtype=torch.long, device=device)}
        return {"input_ids": ids, "labels": ids}  # causal-lm shifts them; seq2seq-lm's decoder reads them shifted

    return make_batch
