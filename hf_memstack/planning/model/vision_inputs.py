"""A vision-language model's pixel inputs for the estimator: which families it sizes, how many
placeholder tokens and pixels each image becomes (as the family's processor makes them from an image
of ``image_size`` pixels a side), and the batch of one step built from that.

The sizes follow each processor: Qwen2-VL and Qwen2.5-VL resize the image to a multiple of
``patch_size x spatial_merge_size`` and feed its patches (one row each, patch-major); LLaVA and
Gemma-3 resize every image to their vision tower's ``image_size``; LLaVA-NeXT adds the tiles of its
best ``image_grid_pinpoints`` resolution; Mllama cuts it into at most ``max_num_tiles`` tiles.
Idefics3 and SmolVLM (tiles of the tower's size plus the whole image) are sized, for a measured
step's batch, but refused by the estimator: their forward reads the pixels' values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import vision_families as fam

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["SUPPORTED", "ImageSpec", "image_batch", "image_spec", "is_vision_language"]

# model_type -> the family's sizes (vision_families.py)
_FAMILIES: dict[str, type[fam.Family]] = {
    "qwen2_vl": fam.QwenVL,
    "qwen2_5_vl": fam.QwenVL,
    "llava": fam.Llava,
    "llava_next": fam.LlavaNext,
    "gemma3": fam.Gemma3,
    "idefics3": fam.Idefics3,
    "smolvlm": fam.Idefics3,
    "mllama": fam.Mllama,
}
SUPPORTED = tuple(k for k, v in _FAMILIES.items() if v.refusal is None)
# The most images one sample may hold: past it the placeholder tokens alone outgrow any context.
_MAX_IMAGES = 1024
_MAX_IMAGE_SIZE = 2**15


def is_vision_language(config: object) -> bool:
    """A composite config with a vision tower (``vision_config``) over a language model."""
    return getattr(config, "vision_config", None) is not None and hasattr(config, "get_text_config")


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """What each sample's images are, as the family's processor makes them."""

    model_type: str
    image_size: int
    """Pixels a side of each image given to the processor (square)."""
    images_per_sample: int
    tokens_per_image: int
    """Placeholder tokens each image takes in ``input_ids``."""
    pixels: str
    """The pixel tensors of one image as the model takes them, in words."""
    source: str
    """Where ``image_size`` came from."""

    @property
    def image_tokens(self) -> int:
        """The tokens a sample's images take: each image's, then a text token (the processor's
        end-of-image marker, which also keeps two images' tokens apart)."""
        return (self.tokens_per_image + 1) * self.images_per_sample

    def note(self) -> str:
        if not self.images_per_sample:
            return f"images: none (images_per_sample=0): a text-only step of the {self.model_type} model"
        return (
            f"images: {self.images_per_sample} per sample of {self.image_size}x{self.image_size} pixels ({self.source}), "
            f"each {self.pixels} and {self.tokens_per_image} image tokens of the seq_len; pass image_size= "
            "(--image-size) and images_per_sample= (--images-per-sample) to match the data"
        )


def image_spec(config: PretrainedConfig, image_size: int | None = None, images_per_sample: int = 1) -> ImageSpec:
    """The images of each sample for ``config`` (a vision-language model's), ``image_size`` pixels a
    side (default: the family's, from the config) and ``images_per_sample`` of them.

    Raises:
        ValueError: a family whose inputs are not sized here (naming it and those that are), or a
            size that is not a positive integer.
    """
    model_type = str(getattr(config, "model_type", type(config).__name__))
    family = _FAMILIES.get(model_type)
    if family is None or family.refusal:
        why = family.refusal if family is not None else "the estimator does not size its pixel inputs"
        raise ValueError(
            f"{type(config).__name__} (model_type={model_type!r}) is a vision-language model the estimator cannot "
            f"answer for: {why}. Supported vision-language models: {', '.join(SUPPORTED)}. Measure it instead "
            "(hf_memstack.measure_step or find_batch_size on the real model with a real batch)"
        )
    for name, value, low in (("image_size", image_size, 1), ("images_per_sample", images_per_sample, 0)):
        bad = not isinstance(value, int) or isinstance(value, bool) or value < low
        if (value is not None or name != "image_size") and bad:
            raise ValueError(f"{name}={value!r} must be an integer of at least {low}")
    if images_per_sample > _MAX_IMAGES or (image_size or 0) > _MAX_IMAGE_SIZE:
        raise ValueError(
            f"image_size={image_size} and images_per_sample={images_per_sample}: at most {_MAX_IMAGE_SIZE} pixels a "
            f"side and {_MAX_IMAGES} images per sample; pass the sizes of the data"
        )
    sizes = family(config, image_size)
    return ImageSpec(
        model_type=model_type,
        image_size=sizes.image_size,
        images_per_sample=images_per_sample,
        tokens_per_image=sizes.tokens_per_image(),
        pixels=sizes.describe(),
        source=sizes.source,
    )


def check_image_tokens(spec: ImageSpec, seq_len: int) -> None:
    """The samples' image tokens must leave room for a text token in ``seq_len``."""
    if spec.image_tokens >= seq_len:
        fewer = max(0, (seq_len - 1) // max(1, spec.tokens_per_image))
        raise ValueError(
            f"seq_len={seq_len} (--seq-len) cannot hold the images of a sample: {spec.images_per_sample} image(s) of "
            f"{spec.tokens_per_image} tokens each ({spec.image_size}x{spec.image_size} pixels) take {spec.image_tokens} "
            f"tokens; pass seq_len={spec.image_tokens + 1} or more, or images_per_sample={fewer} (or a smaller image_size)"
        )


def image_batch(
    config: PretrainedConfig,
    spec: ImageSpec,
    batch: int,
    seq: int,
    *,
    generator: torch.Generator | None = None,
    traced_inputs: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """One step's batch of ``batch`` samples of ``seq`` tokens, each starting with its images' tokens:
    the integer inputs (ids, labels - image tokens unlabelled -, grids, masks) as tensors, and the
    float pixel tensors' shapes (built by the caller: on fake tensors, or real ones for a measured step).
    ``traced_inputs``: also what the estimator's fake tensors cannot compute (Qwen2-VL's positions)."""
    text = config.get_text_config()
    vocab = int(text.vocab_size)
    token = fam.image_token_id(config)
    if token is None:
        if spec.images_per_sample:
            raise ValueError(
                f"{type(config).__name__} has no image_token_id (nor image_token_index): the id its processor puts in "
                "input_ids for each image token; set it in the config (config.json) or pass images_per_sample=0"
            )
        token = -1  # no image, so no image token placed
    gen = generator or torch.Generator().manual_seed(0)
    ids = torch.randint(0, max(2, vocab - 1), (batch, seq), generator=gen)
    ids[ids == token] = 0
    labels = ids.clone()
    span = spec.tokens_per_image + 1
    for image in range(spec.images_per_sample):
        ids[:, image * span : (image + 1) * span - 1] = token
        labels[:, image * span : (image + 1) * span] = -100
    sizes = _FAMILIES[spec.model_type](config, spec.image_size)
    ints, floats = sizes.inputs(batch, spec.images_per_sample, ids) if spec.images_per_sample else ({}, {})
    inputs = {"input_ids": ids, "labels": labels, **ints}
    traced = sizes.traced_inputs(inputs) if traced_inputs and spec.images_per_sample else {}
    return {**inputs, **traced}, floats


def pixel_tensors(
    shapes: dict[str, tuple[int, ...]], *, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Random pixels of the given shapes (fp32, as processors return them)."""
    return {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}


def images_for(
    config: PretrainedConfig,
    image_size: int | None,
    images_per_sample: int | None,
    seq_len: int,
    task: str = "causal-lm",
) -> ImageSpec | None:
    """The images of each sample of an estimate (None: ``config`` is a text model's), checked
    against ``seq_len`` and ``task``; ``images_per_sample`` None: one."""
    if not is_vision_language(config):
        given = [
            f"{n}={v!r}"
            for n, v in (("image_size", image_size), ("images_per_sample", images_per_sample))
            if v is not None
        ]
        if given:
            raise ValueError(
                f"{' and '.join(given)} given for {type(config).__name__}, which has no vision tower (no vision_config): "
                "they size a vision-language model's images; drop them (--image-size, --images-per-sample)"
            )
        return None
    if task != "causal-lm":
        raise ValueError(
            f"task={task!r} on {type(config).__name__} (model_type={config.model_type!r}), a vision-language model: "
            "the estimator builds it as Transformers' image-text-to-text model (its language-model head); pass "
            "task='causal-lm' (--task causal-lm) or leave task out"
        )
    spec = image_spec(config, image_size, 1 if images_per_sample is None else images_per_sample)
    check_image_tokens(spec, seq_len)
    return spec
