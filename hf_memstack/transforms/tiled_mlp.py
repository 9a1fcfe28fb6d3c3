"""apply_tiled_mlp: each block's MLP computed over tiles of tokens, so that its intermediate
activations (``[tokens, intermediate]``, 2.7-5x the hidden size) exist for one tile at a time, in
the forward and in the backward - the largest tensors checkpointing still holds while it
recomputes a block of a long sequence (DeepSpeed ALST's, Axolotl's and Unsloth's TiledMLP).

Each tile runs under non-reentrant ``torch.utils.checkpoint``: the forward keeps only the tile's
input, the backward recomputes the tile and frees it before the next one. The cost is one more
MLP forward per step. PyTorch's checkpoint brings what the tiles need: the autocast state and
the RNG (dropout inside the MLP draws the same masks again), nesting inside block checkpointing,
and parameter gradients summed over the tiles before they are accumulated once (so hooks that
fire on accumulation - FSDP2's reduction, an optimizer stepping in the backward - fire once).
LoRA layers inside the MLP are part of the tile. Under selective (op-level) checkpointing the
ops inside a tile are marked for recompute (:func:`inside_tiled_mlp`): saving them would keep
every tile's intermediates alive again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._device import module_mode
from ..policy import MLPConfig
from ._wrappers import _ForwardWrapper
from .blocks import Blocks

__all__ = [
    "TiledMLPForward",
    "TiledMLPResult",
    "apply_tiled_mlp",
    "auto_tile_tokens",
    "check_tiled_mlp",
    "inside_tiled_mlp",
    "tiled_mlps",
    "verify_tiled_mlp",
]

# Where the MLP of a block sits in Transformers' decoder layers (Llama, Mistral, Qwen2/3, Gemma,
# Phi-3, GPT-2, GPT-NeoX, Falcon: ``mlp``; Llama 4, some others: ``feed_forward``).
_MLP_NAMES = ("mlp", "feed_forward", "ffn")


@dataclass(frozen=True, kw_only=True, slots=True)
class TiledMLPResult:
    """What :func:`apply_tiled_mlp` did."""

    mode: Literal["default", "tiled"]
    tile_tokens: int = 0
    """Tokens per tile."""
    module_name: str = ""
    """The MLP's name inside each block."""
    tiled: tuple[int, ...] = ()
    """Indices of the blocks whose MLP is tiled."""

    def describe(self) -> str:
        if self.mode == "default":
            return "off"
        return f"block.{self.module_name} in tiles of {self.tile_tokens} tokens, {len(self.tiled)} block(s)"


@dataclass(frozen=True, kw_only=True, slots=True)
class _TilePlan:
    """What the checks found; applying it cannot fail."""

    mlps: tuple[nn.Module, ...]
    result: TiledMLPResult


def auto_tile_tokens(hidden_size: int) -> int:
    """Tokens per tile when ``tile_tokens`` is None: the hidden size (ALST's choice: a tile's
    intermediate then takes about ``intermediate x hidden`` elements, the size of one weight), at least 256."""
    return max(256, int(hidden_size))


def check_tiled_mlp(model: nn.Module, cfg: MLPConfig, blocks: Blocks | None) -> _TilePlan | None:
    """Raise before the model is touched when the MLPs cannot be tiled; None when there is nothing to do.

    Raises:
        ValueError: no blocks, no MLP under the name in some block, a mixture-of-experts model (its
            router's auxiliary loss and expert capacity are not per token), or an MLP whose tiled
            output differs from its own (it mixes tokens).
    """
    if cfg.mode == "default":
        return None
    if blocks is None or not len(blocks):
        raise ValueError(
            f"policy.mlp.mode='tiled': {type(model).__name__} has no repeated blocks to find MLPs in; set "
            "policy.checkpointing.block_classes to the block class, or drop mlp:tiled"
        )
    config = getattr(model, "config", None)
    config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(
            f"policy.mlp.mode='tiled': {type(model).__name__} is a mixture-of-experts model, whose expert layers "
            "route and balance over all tokens at once (router loss, capacity); tiling them is not supported. "
            "Drop mlp:tiled"
        )
    name = cfg.module_name or _find_name(blocks.modules[0])
    missing = [i for i, b in enumerate(blocks.modules) if not isinstance(_child(b, name), nn.Module)]
    if name is None or missing:
        found = sorted(n for n, _ in blocks.modules[0].named_children())
        raise ValueError(
            f"policy.mlp.module_name={name!r}: block(s) {missing or [0]} of {type(model).__name__} have no such MLP "
            f"module (block children: {found}); set policy.mlp.module_name to the MLP's name, or drop mlp:tiled"
        )
    mlps = tuple(b.get_submodule(name) for b in blocks.modules)  # every block has it: none is missing
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    tile = cfg.tile_tokens or auto_tile_tokens(hidden)
    if _has_values(mlps[0]):
        _check_token_wise(mlps[0], name)
    return _TilePlan(
        mlps=mlps,
        result=TiledMLPResult(mode="tiled", tile_tokens=tile, module_name=name, tiled=tuple(range(len(mlps)))),
    )


def apply_tiled_mlp(plan: _TilePlan | None) -> TiledMLPResult:
    """Tile the MLPs :func:`check_tiled_mlp` found (in place, on each MLP's forward)."""
    if plan is None:
        return TiledMLPResult(mode="default")
    for mlp in plan.mlps:
        mlp.forward = TiledMLPForward(mlp, tile_tokens=plan.result.tile_tokens)  # type: ignore[method-assign]
    return plan.result


class TiledMLPForward(_ForwardWrapper):
    """An MLP's forward over tiles of ``tile_tokens`` tokens, each checkpointed, while training;
    the MLP's own forward otherwise (no gradients, or no more tokens than one tile)."""

    def __init__(self, module: nn.Module, *, tile_tokens: int) -> None:
        super().__init__(module)
        self.tile_tokens = tile_tokens
        # The RNG is saved and restored per tile only when the MLP draws from it (dropout).
        self._rng = any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())

    def __call__(self, hidden: torch.Tensor, *args: object, **kwargs: object) -> object:
        tokens = hidden.numel() // hidden.shape[-1] if hidden.dim() else 0
        if args or kwargs or not torch.is_grad_enabled() or tokens <= self.tile_tokens:
            return self.__wrapped__(hidden, *args, **kwargs)
        flat = hidden.reshape(tokens, hidden.shape[-1])
        with _tiled():
            outs = [
                checkpoint(
                    self.__wrapped__, flat[s : s + self.tile_tokens], use_reentrant=False, preserve_rng_state=self._rng
                )
                for s in range(0, tokens, self.tile_tokens)
            ]
        out = torch.cat(outs)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])

    def _options(self) -> dict[str, object]:
        return {"tile_tokens": self.tile_tokens}


class _TileState(threading.local):
    # A class default, not getattr(..., "depth", 0): dynamo raises on getattr's default for a
    # thread-local's missing attribute and runs the whole compiled block eagerly (a fresh process's
    # first tiled block under compile:regional ran with no compiled graph at all).
    depth = 0


_state = _TileState()


def inside_tiled_mlp() -> bool:
    """True while a tiled MLP runs its tiles (selective checkpointing then keeps none of their ops)."""
    return _state.depth > 0


@contextlib.contextmanager
def _tiled() -> Iterator[None]:
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def _find_name(block: nn.Module) -> str | None:
    return next((n for n in _MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)


def _child(block: nn.Module, name: str | None) -> nn.Module | None:
    if not name:
        return None
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


def _check_token_wise(mlp: nn.Module, name: str) -> None:
    """The MLP on six tokens, whole and in tiles of two (eval mode, no gradients): equal, or it mixes tokens."""

    weight = next((p for p in mlp.parameters()), None)
    if weight is None:
        return
    width = _input_width(mlp)
    if width is None:
        return
    x = torch.linspace(-1, 1, 6 * width, device=weight.device, dtype=weight.dtype).reshape(1, 6, width)
    with torch.no_grad(), module_mode(mlp, training=False):
        whole = mlp(x)
        tiles = torch.cat([mlp(x[:, s : s + 2]) for s in range(0, 6, 2)], dim=1)
    if (
        not torch.is_tensor(whole)
        or whole.shape[:2] != x.shape[:2]
        or not torch.allclose(whole, tiles, rtol=1e-4, atol=1e-5)
    ):
        raise ValueError(
            f"policy.mlp.mode='tiled': block.{name} ({type(mlp).__name__}) does not compute each token on its own "
            "(its output on tokens in tiles differs from its output on all of them, or is not one tensor per "
            "token); set policy.mlp.module_name to a token-wise MLP, or drop mlp:tiled"
        )


def _input_width(mlp: nn.Module) -> int | None:
    first = next((m for m in mlp.modules() if isinstance(m, nn.Linear)), None)
    if first is not None:
        return int(first.in_features)
    conv1d = next((m for m in mlp.modules() if type(m).__name__ == "Conv1D"), None)  # GPT-2's transposed linear
    return int(cast(torch.Tensor, conv1d.weight).shape[0]) if conv1d is not None else None  # its [in, out] weight


def _has_values(module: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(p.is_meta or isinstance(p, FakeTensor) for p in module.parameters())


def tiled_mlps(blocks: Blocks | None, result: TiledMLPResult) -> dict[int, nn.Module]:
    """The tiled MLPs by block index (empty when the MLPs are not tiled)."""
    if result.mode != "tiled" or blocks is None:
        return {}
    return {i: blocks.modules[i].get_submodule(result.module_name) for i in result.tiled}


def verify_tiled_mlp(
    result: TiledMLPResult, tiles: dict[int, list[int]], backward_error: str | None
) -> tuple[bool, str]:
    """verify's ``mlp`` check: each tiled MLP ran more than one tile in the forward and re-ran every
    tile in the backward; ``tiles`` holds, per block, the calls of its MLP's first submodule in each."""
    if backward_error is not None:
        return False, f"not observed: {backward_error}"
    counts = [tiles.get(i, [0, 0]) for i in result.tiled]
    forward, backward = min(c[0] for c in counts), min(c[1] for c in counts)
    detail = (
        f"{len(counts)} tiled MLP(s), tiles of {result.tile_tokens} tokens: at least {forward} tile(s) each in the "
        f"forward, {backward} recomputed in the backward"
    )
    if forward <= 1:
        return (
            True,
            detail + f": this batch fits one tile per row set (<= {result.tile_tokens} tokens), so "
            "the MLPs ran whole; longer batches run in tiles",
        )
    ok = backward >= forward
    if ok:
        return ok, detail
    return ok, detail + (
        ": some tiles were not recomputed in the backward - the tiles' "
        "intermediates were kept; prepare the model without mlp:tiled and report it"
    )
