"""Tiny vision-language models of real Transformers architectures (2 text blocks, 2 vision blocks,
64 wide, a vocabulary of 1,000) and their pixel batches, built here: no downloads.

Qwen2-VL and Qwen2.5-VL take their pixels patch-major (``pixel_values`` ``[16 * n, 1176]``: 16 patches
of 2 x 14 x 14 x 3 values per image, ``image_grid_thw`` ``[n, 3]``), the others batch-major."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VLM_VOCAB = 1000
IMAGE_ID = VLM_VOCAB - 3  # the image placeholder token
_TEXT: dict[str, Any] = {
    "vocab_size": VLM_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
}
_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 28,
    "patch_size": 14,
}
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
_QWEN_IDS = {"image_token_id": IMAGE_ID, "vision_start_token_id": VLM_VOCAB - 4, "video_token_id": VLM_VOCAB - 2}

# Image placeholder tokens per image, as each architecture's vision tower yields them for a 28 x 28 image.
_IMAGE_TOKENS = {"qwen2_vl": 4, "qwen2_5_vl": 4, "llava": 5, "idefics3": 4, "smolvlm": 4, "gemma3": 4, "mllama": 1}
VLMS = tuple(_IMAGE_TOKENS)


def _config(arch: str) -> Any:
    import transformers as t

    qwen_vision = {"depth": 2, "num_heads": 4, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    idefics = {"text_config": {"model_type": "llama", **_TEXT}, "vision_config": _VISION, "image_token_id": IMAGE_ID}
    builders: dict[str, Callable[[], Any]] = {
        "qwen2_vl": lambda: t.Qwen2VLConfig(
            text_config={**_TEXT, "rope_parameters": _MROPE},
            vision_config={**qwen_vision, "embed_dim": 32, "hidden_size": 64},
            **_QWEN_IDS,
        ),
        "qwen2_5_vl": lambda: t.Qwen2_5_VLConfig(
            text_config={**_TEXT, "rope_parameters": _MROPE},
            vision_config={
                **qwen_vision,
                "hidden_size": 32,
                "intermediate_size": 64,
                "out_hidden_size": 64,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            **_QWEN_IDS,
        ),
        "llava": lambda: t.LlavaConfig(
            text_config={"model_type": "llama", **_TEXT},
            vision_config={"model_type": "clip_vision_model", **_VISION},
            image_token_id=IMAGE_ID,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
        ),
        "idefics3": lambda: t.Idefics3Config(**idefics, scale_factor=1),
        "smolvlm": lambda: t.SmolVLMConfig(**idefics, scale_factor=1),
        "gemma3": lambda: t.Gemma3Config(
            text_config={**_TEXT, "head_dim": 16, "sliding_window": 16},
            vision_config=_VISION,
            mm_tokens_per_image=4,
            image_token_index=IMAGE_ID,
            boi_token_index=VLM_VOCAB - 4,
            eoi_token_index=VLM_VOCAB - 5,
        ),
        "mllama": lambda: t.MllamaConfig(
            text_config={**_TEXT, "cross_attention_layers": [1]},
            vision_config={
                **_VISION,
                "num_global_layers": 1,
                "max_num_tiles": 1,
                "intermediate_layers_indices": [0],
                "vision_output_dim": 64,
                "supported_aspect_ratios": [[1, 1]],
            },
            image_token_index=IMAGE_ID,
        ),
    }
    return builders[arch]()


def tiny_vlm(arch: str, seed: int = 0) -> nn.Module:
    """A fresh tiny ``*ForConditionalGeneration`` of ``arch`` (one of ``VLMS``), in train mode."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(_config(arch)).train()


def vlm_batch(arch: str, n: int, seq: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` samples of ``seq`` tokens, each with one 28 x 28 image (its placeholder tokens at 2, 3, ...)
    and labels on every token but the image's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VLM_VOCAB - 10, (n, seq), generator=g)
    images = _IMAGE_TOKENS[arch]
    ids[:, 2 : 2 + images] = IMAGE_ID
    labels = ids.masked_fill(ids == IMAGE_ID, -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        # Patch-major: one image of 1 x 4 x 4 patches (2 frames x 14 x 14 x 3 values each) per sample.
        batch["pixel_values"] = torch.randn(16 * n, 2 * 14 * 14 * 3, generator=g)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * n)
        batch["mm_token_type_ids"] = (ids == IMAGE_ID).int()
    elif arch in ("idefics3", "smolvlm"):
        batch["pixel_values"] = torch.randn(n, 1, 3, 28, 28, generator=g)
    elif arch == "mllama":
        batch["pixel_values"] = torch.randn(n, 1, 1, 3, 28, 28, generator=g)
        batch["aspect_ratio_ids"] = torch.ones(n, 1, dtype=torch.long)
        batch["aspect_ratio_mask"] = torch.ones(n, 1, 1, dtype=torch.long)
        batch["cross_attention_mask"] = torch.ones(n, seq, 1, 1, dtype=torch.long)
    else:
        batch["pixel_values"] = torch.randn(n, 3, 28, 28, generator=g)
        if arch == "gemma3":
            batch["token_type_ids"] = (ids == IMAGE_ID).long()
    return batch
