"""Each vision-language family's images as its processor makes them: the placeholder tokens an image
of ``image_size`` pixels a side takes, and the pixel, grid and mask tensors of a batch
(:mod:`hf_memstack.planning.model.vision_inputs` picks the family and builds the batch)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Family", "Gemma3", "Llava", "LlavaNext", "Mllama", "QwenVL", "image_token_id"]

Shapes = dict[str, tuple[int, ...]]


def image_token_id(config: object) -> int | None:
    """The placeholder id the processor puts in ``input_ids`` for each image token."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _positive(config: object, name: str, default: int | None = None) -> int:
    value = getattr(config, name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"{type(config).__name__}.{name}={value!r} must be a positive integer to size the pixel inputs; fix the config"
        )
    return value


class Family:
    """A family's image sizes; ``image_size`` None: the family's default, from the config."""

    refusal: str | None = None
    """Why the estimator cannot trace the family's forward on fake tensors (None: it can)."""

    def __init__(self, config: PretrainedConfig, image_size: int | None) -> None:
        self.config, self.vision = config, config.vision_config
        self.tile = self.read_tile()
        self.patch = _positive(self.vision, "patch_size")
        self.channels = _positive(self.vision, "num_channels", getattr(self.vision, "in_channels", 3))
        default, why = self.default_size()
        self.image_size = image_size or default
        self.source = why if image_size is None else "image_size="
        self.check()

    def check(self) -> None:
        """Refuse a config whose vision fields do not fit together (Transformers' default configs of
        some families are such: their forward fails inside torch)."""

    def read_tile(self) -> int:
        return _positive(self.vision, "image_size")

    def default_size(self) -> tuple[int, str]:
        return self.tile, f"the vision tower's vision_config.image_size={self.tile}"

    def tokens_per_image(self) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        raise NotImplementedError

    def traced_inputs(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs the estimator's batch adds to the processor's: what the forward would compute from
        values it cannot read on fake tensors (of the same shape: the memory is the same)."""
        return {}


class QwenVL(Family):
    """Qwen2-VL, Qwen2.5-VL: the image resized to a multiple of patch x merge (at most the processor's
    default 1,003,520 pixels), one row per patch (``[patches, channels x temporal x patch x patch]``)."""

    _MAX_PIXELS = 28 * 28 * 1280  # Qwen2VLImageProcessor's default longest_edge (max_pixels)

    def read_tile(self) -> int:
        return 0  # the vision tower takes any size: no image_size in its config

    def default_size(self) -> tuple[int, str]:
        return 448, "default: the config sets no image size and the processor keeps the image's own"

    def check(self) -> None:
        out = getattr(self.vision, "out_hidden_size", None) or getattr(self.vision, "hidden_size", None)
        hidden = self.config.get_text_config().hidden_size
        if out != hidden:
            field = "out_hidden_size" if hasattr(self.vision, "out_hidden_size") else "hidden_size"
            raise ValueError(
                f"{type(self.config).__name__}: vision_config.{field}={out} (the width of the image features) must equal "
                f"text_config.hidden_size={hidden} (the language model's width); copy the model's config.json again"
            )

    def side(self) -> int:
        factor = self.patch * _positive(self.vision, "spatial_merge_size")
        side = max(factor, factor * round(self.image_size / factor))
        while side * side > self._MAX_PIXELS and side > factor:
            side -= factor
        return side

    def tokens_per_image(self) -> int:
        merge = _positive(self.vision, "spatial_merge_size")
        return (self.side() // self.patch) ** 2 // merge**2

    def describe(self) -> str:
        grid = self.side() // self.patch
        return f"resized to {self.side()}x{self.side()}: {grid * grid} patches of {self.patch}x{self.patch} (patch-major rows)"

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        grid = self.side() // self.patch
        temporal = _positive(self.vision, "temporal_patch_size")
        n = batch * images
        row = self.channels * temporal * self.patch * self.patch
        token = image_token_id(self.config)
        types = (ids == token).to(torch.int32) if token is not None else torch.zeros_like(ids, dtype=torch.int32)
        return (
            {"image_grid_thw": torch.tensor([[1, grid, grid]] * n), "mm_token_type_ids": types},
            {"pixel_values": (n * grid * grid, row)},
        )

    def traced_inputs(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # get_rope_index's [text, temporal, height, width] positions: its loops over the samples stack
        # fake scalars, which have no values; the text model takes them as given.
        batch, seq = inputs["input_ids"].shape
        traced = {"position_ids": torch.arange(seq).expand(4, batch, seq).clone()}
        window = getattr(self.vision, "window_size", None)
        if isinstance(window, int) and window > 0:  # Qwen2.5-VL's windowed attention: its order from arange's
            from transformers.vision_utils import get_vision_window_index

            merge = _positive(self.vision, "spatial_merge_size")
            index, cu = get_vision_window_index(inputs["image_grid_thw"], merge, window, self.patch)
            traced.update(image_window_index=index, image_cu_window_seqlens=cu)
        return traced


class Llava(Family):
    """LLaVA: every image resized to the tower's size; one token per patch (plus CLS with the
    ``full`` feature strategy)."""

    def _base_tokens(self) -> int:
        full = getattr(self.config, "vision_feature_select_strategy", "default") == "full"
        return (self.tile // self.patch) ** 2 + int(full)

    def tokens_per_image(self) -> int:
        return self._base_tokens()

    def describe(self) -> str:
        return f"resized to the tower's {self.tile}x{self.tile}"

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        return {}, {"pixel_values": (batch * images, self.channels, self.tile, self.tile)}


class LlavaNext(Llava):
    """LLaVA-NeXT: the tower's view of the whole image plus the tiles of the best
    ``image_grid_pinpoints`` resolution, its features unpadded to the image's aspect ratio."""

    def _best(self) -> tuple[int, int]:
        from transformers.image_processing_utils import select_best_resolution

        pinpoints = getattr(self.config, "image_grid_pinpoints", None) or [[self.tile, self.tile]]
        height, width = select_best_resolution((self.image_size, self.image_size), pinpoints)
        return int(height), int(width)

    def _tiles(self) -> int:
        height, width = self._best()
        return math.ceil(height / self.tile) * math.ceil(width / self.tile) + 1

    def tokens_per_image(self) -> int:
        height, width = self._best()
        side = self.tile // self.patch
        cur_h, cur_w = side * (height // self.tile), side * (width // self.tile)
        # The processor's _get_unpadded_features for a square image: the grid's longer side cut to the shorter.
        if cur_w < cur_h:
            cur_h -= 2 * ((cur_h - cur_w) // 2)
        else:
            cur_w -= 2 * ((cur_w - cur_h) // 2)
        return self._base_tokens() + cur_h * cur_w + cur_h

    def describe(self) -> str:
        height, width = self._best()
        return f"{self._tiles()} tiles of {self.tile}x{self.tile} (the whole image, and its {height}x{width} grid)"

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        n = batch * images
        sizes = torch.tensor([[self.image_size, self.image_size]] * n)
        return {"image_sizes": sizes}, {"pixel_values": (n, self._tiles(), self.channels, self.tile, self.tile)}


class Gemma3(Llava):
    """Gemma-3: every image resized to the tower's size, pooled to ``mm_tokens_per_image`` tokens; its
    tokens attend to each other both ways (``token_type_ids`` 1 there)."""

    def check(self) -> None:
        tokens, patches = _positive(self.config, "mm_tokens_per_image"), self.tile // self.patch
        side = math.isqrt(tokens)
        if side * side != tokens or patches < side or patches % side:
            raise ValueError(
                f"{type(self.config).__name__}: mm_tokens_per_image={tokens} must be the square of a divisor of the "
                f"{patches} patches a side (vision_config.image_size={self.tile} / patch_size={self.patch}): the "
                "projector pools the patches to it; copy the model's config.json again"
            )

    def tokens_per_image(self) -> int:
        return _positive(self.config, "mm_tokens_per_image")

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        token = image_token_id(self.config)
        types = (ids == token).long() if token is not None else torch.zeros_like(ids)
        return {"token_type_ids": types}, {"pixel_values": (batch * images, self.channels, self.tile, self.tile)}


class Idefics3(Family):
    """Idefics3, SmolVLM: the image cut into tiles of the tower's size (plus the whole image when it
    takes more than one), each pooled to ``(tile / patch)^2 / scale_factor^2`` tokens."""

    refusal = (
        "its forward drops padding images by reading the pixel values (an all-zero image is padding), which the "
        "estimator's fake tensors do not have"
    )

    def default_size(self) -> tuple[int, str]:
        return 4 * self.tile, f"default: the processor's longest edge, 4 tiles of {self.tile}"

    def _tiles(self) -> int:
        side = math.ceil(self.image_size / self.tile)
        return side * side + (1 if side > 1 else 0)

    def tokens_per_image(self) -> int:
        scale = _positive(self.config, "scale_factor")
        return self._tiles() * (self.tile // self.patch) ** 2 // scale**2

    def describe(self) -> str:
        return f"{self._tiles()} tiles of {self.tile}x{self.tile}"

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        n = images * self._tiles()
        mask = torch.ones(batch, n, self.tile, self.tile, dtype=torch.bool)
        return {"pixel_attention_mask": mask}, {"pixel_values": (batch, n, self.channels, self.tile, self.tile)}


class Mllama(Family):
    """Mllama (Llama-3.2-Vision): the image cut into at most ``max_num_tiles`` tiles of the tower's size
    (padded to that many), one ``<|image|>`` token each, read by the cross-attention layers."""

    def default_size(self) -> tuple[int, str]:
        side = math.isqrt(_positive(self.vision, "max_num_tiles"))
        return side * self.tile, f"default: a square image filling {side}x{side} tiles of {self.tile}"

    def _side(self) -> int:
        return max(1, min(math.ceil(self.image_size / self.tile), math.isqrt(_positive(self.vision, "max_num_tiles"))))

    def tokens_per_image(self) -> int:
        return 1

    def describe(self) -> str:
        tiles = self._side() ** 2
        return f"{tiles} tile(s) of {self.tile}x{self.tile} (padded to max_num_tiles={self.vision.max_num_tiles})"

    def inputs(self, batch: int, images: int, ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], Shapes]:
        most, side = self.vision.max_num_tiles, self._side()
        ratios = list(getattr(self.vision, "supported_aspect_ratios", None) or [])
        ratio_id = ratios.index([side, side]) + 1 if [side, side] in ratios else 1
        used = torch.zeros(batch, images, most, dtype=torch.long)
        used[..., : side * side] = 1
        cross = used[:, None].expand(batch, ids.shape[1], images, most).clone()
        return (
            {
                "aspect_ratio_ids": torch.full((batch, images), ratio_id, dtype=torch.long),
                "aspect_ratio_mask": used,
                "cross_attention_mask": cross,
            },
            {"pixel_values": (batch, images, most, self.channels, self.tile, self.tile)},
        )
