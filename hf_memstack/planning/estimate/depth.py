"""A deep model's step from two shallow ones: the estimator traces the model with a few of its
blocks and extrapolates the identical rest.

Tracing every block of a 7B or 70B model on fake tensors takes tens of seconds to minutes, and
nothing in it differs from block to block. Each block of a repeated stack adds the same bytes to
every phase's peak (its weights, gradients and optimizer state; its saved activations or
checkpointed input), so each phase's peak is a line in the number of blocks, and two traces
``period`` blocks apart give its slope. The step's peak is the highest phase's at the full depth,
which is not a line (the optimizer phase grows faster than the backward under full fine-tuning),
so each phase is extrapolated on its own, and each category of it.

This holds only when the blocks really repeat. :func:`plan_depths` builds the full model on the
meta device (no storage: a fraction of a second at 80 blocks) and compares its blocks: their
classes, parameters (names, shapes, dtypes) and the plain attributes of every submodule (a
sliding-window size, a layer type). The stack must repeat every ``period`` blocks (Gemma-2's
sliding/global pairs: 2), the model built shallow must hold the deep one's first blocks and the same
modules around them, and nothing in the policy or the PEFT config may pick blocks by index.
Anything else is traced in full.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ...measure.memory import PhasePeaks
from ...measure.segments import Segment
from ...transforms.blocks import find_blocks

if TYPE_CHECKING:
    from peft import PeftConfig
    from transformers import PretrainedConfig

__all__ = [
    "DepthPlan",
    "FULL_TRACE_ASKED",
    "FullTrace",
    "blocks_of_every_kind",
    "extrapolate_line",
    "extrapolate_phases",
    "num_layers",
    "plan_depths",
    "text_config",
    "with_depth",
]

# Periods of blocks in the shallower trace, and at least 2 blocks: the second trace's extra period
# is then an interior block, neither the first (whose input is the embeddings') nor the last, as
# every block added past it is. From 1 and 2 blocks a 7B LoRA under bf16+loss:chunked read 1.8%
# high; from 2 and 3 every field equals the full trace's there and at 6 to 24 blocks on Llama,
# GPT-2, Qwen2 and Gemma-2 (tests/unit/planning/estimate/test_depth.py, bench/estimate_speed.py).
_SHALLOW_PERIODS = 1
# The most blocks the two shallow traces may hold together, as a share of the model's.
_MOST_TRACED = 0.75
# Attributes that number a block (each block's own), not describe it.
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx"})
# Config fields listing a value per block (layer_types, no_rope_layers): cut to the shallow depth.
_PLAIN = (int, float, str, bool, type(None))
# What one rank holds of a part of a phase: (phase index, part or None, its peak by category) -> the same.
PerRank = Callable[[int, "Segment | None", dict[str, int]], dict[str, int]]


@dataclass(frozen=True, slots=True)
class DepthPlan:
    """How the estimate is traced: ``depths`` blocks (two traces) for a model of ``layers``."""

    layers: int
    """The model's blocks."""
    period: int
    """Blocks per repeat of the stack (1 when every block is alike)."""
    depths: tuple[int, int]
    """The two depths traced, ``period`` apart, together at most 3/4 of ``layers``."""

    def deeper(self) -> DepthPlan | None:
        """The next two depths, a period further; None when they hold most of the model."""
        depths = (self.depths[1], self.depths[1] + self.period)
        if sum(depths) > _MOST_TRACED * self.layers:
            return None
        return DepthPlan(layers=self.layers, period=self.period, depths=depths)

    def note(self) -> str:
        repeat = "every block alike" if self.period == 1 else f"the stack repeats every {self.period} blocks"
        return (
            f"traced with {self.depths[0]} and {self.depths[1]} of the model's {self.layers} blocks ({repeat}) and "
            "extrapolated, phase by phase; extrapolate=False (--full-trace) traces every block"
        )


@dataclass(frozen=True, slots=True)
class FullTrace:
    """Why the estimate traces every block instead of extrapolating (said in its notes)."""

    reason: str

    def note(self) -> str:
        return f"traced every block of the model: {self.reason}"


FULL_TRACE_ASKED = FullTrace("extrapolate=False (--full-trace)")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def num_layers(config: PretrainedConfig) -> int | None:
    layers = getattr(text_config(config), "num_hidden_layers", None)
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def with_depth(config: PretrainedConfig, depth: int) -> PretrainedConfig:
    """A copy of ``config`` with ``depth`` blocks; its per-block lists (``layer_types``) cut to them."""
    layers = num_layers(config)
    new = copy.deepcopy(config)
    text = text_config(new)
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers and key != "architectures":
            setattr(text, key, type(value)(value[:depth]))
    text.num_hidden_layers = depth
    return new


def plan_depths(
    config: PretrainedConfig,
    build: Callable[[PretrainedConfig], nn.Module],
    *,
    every_n: int,
    peft_config: PeftConfig | None,
) -> DepthPlan | FullTrace:
    """The two shallow depths to trace for ``config``, or why the model is traced in full (too
    shallow to gain, blocks that differ, a PEFT config that picks blocks by index).

    Args:
        build: builds the model of a config on the meta device, in the estimate's dtypes.
        every_n: the policy's checkpointing period (``ckpt:N``: one block in N; 1 otherwise).
    """
    layers = num_layers(config)
    if layers is None:
        return FullTrace("its config names no number of blocks (num_hidden_layers)")
    if _peft_picks_blocks(peft_config):
        return FullTrace("the PEFT config picks blocks by index (layers_to_transform, a regex or rank_pattern)")
    deep = build(config)
    blocks = _blocks(deep)
    if blocks is None or len(blocks) != layers:
        return FullTrace(f"its {layers} blocks were not found as one stack")
    signatures = [_signature(b) for b in blocks]
    period = _period(signatures)
    if period is None:
        return FullTrace("its blocks do not repeat")
    period = math.lcm(period, every_n)
    shallow = _SHALLOW_PERIODS * period + layers % period
    if shallow < 2:
        shallow += period  # also: one block is no stack to find_blocks (the tiled MLP's)
    depths = (shallow, shallow + period)
    plan = DepthPlan(layers=layers, period=period, depths=depths)
    if sum(depths) > _MOST_TRACED * layers or (shallow == period and plan.deeper() is None):
        # Two traces about as deep as the model, plus its meta build: tracing it once is faster
        # (Gemma-3's 26 blocks, a period of 6: traces of 8 and 14 blocks took longer than all 26). A
        # shallower trace of one period may need the next two depths (its block 0 is also its last
        # period's first: :func:`_by_position`); where those are too deep, the two traces and then the
        # full one cost more than the full one alone (Gemma-3's 24 blocks: 6, 12, then 24).
        return FullTrace(f"{layers} blocks are too few for two shallower traces to be faster")
    model = build(with_depth(config, depths[1]))
    few = _blocks(model)
    if (
        few is None
        or [_signature(b) for b in few] != signatures[: depths[1]]
        or _outside(model, few) != _outside(deep, blocks)
    ):
        return FullTrace("a shallower copy of the model is not its first blocks")
    return plan


def extrapolate_line(at: tuple[int, int], depths: tuple[int, int], layers: int) -> int:
    """The value at ``layers`` on the line through the values ``at`` the two ``depths``."""
    (lo, hi), (a, b) = at, depths
    return hi + (hi - lo) * (layers - b) // (b - a)


def extrapolate_phases(
    shallow: PhasePeaks, deeper: PhasePeaks, plan: DepthPlan, per_rank: PerRank | None = None
) -> PhasePeaks | None:
    """Each phase's peak, category by category, at the model's full depth; None when the traces'
    parts cannot be matched (then :meth:`DepthPlan.deeper`).

    With the traces' segments (each part of a phase kept apart: before the blocks, in each block,
    after them; :mod:`hf_memstack.measure.segments`), each part that is there at every depth - the
    first blocks from the input, the last ``period`` blocks, the rest of the model before and after
    (:func:`_by_position`) - is extrapolated on its own and the phase's peak is the highest at the
    full depth: the part that holds the peak can change with the depth (the head's backward in a
    shallow LoRA model, its last block's backward in a deep one). The blocks between add the same
    bytes each, so none of them is above both ends. Without segments (no blocks found), each phase's
    peak is one line. ``per_rank(phase, part, peak)``: what one rank holds of each part at the full
    depth (FSDP's shards: :mod:`hf_memstack.planning.estimate.fsdp_shards`), before the phase's highest is taken.
    """
    rank: PerRank = per_rank or (lambda phase, part, peak: peak)
    if len(shallow.peaks) != len(deeper.peaks):
        raise RuntimeError("the two shallow traces ran different phases")

    def line(lo: int, hi: int) -> int:
        return max(0, extrapolate_line((lo, hi), plan.depths, plan.layers))

    def extrapolated(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        peak = {k: line(a[k], b[k]) for k in a}
        # The total is its categories' sum at each depth, so it is on their lines' sum.
        peak["total"] = sum(v for k, v in peak.items() if k != "total")
        return peak

    if not (shallow.segments and deeper.segments):
        peaks = [
            rank(i, None, extrapolated(a, b)) for i, (a, b) in enumerate(zip(shallow.peaks, deeper.peaks, strict=True))
        ]
    else:
        # Block 0 may stand for the last block of its kind when it holds what the others do.
        alike = all(_block0_alike(parts, plan.period) for parts in deeper.segments)
        peaks = []
        for i, (low, high) in enumerate(zip(shallow.segments, deeper.segments, strict=True)):
            lo = _by_position(low, plan.depths[0], plan.period, block0_alike=alike)
            hi = _by_position(high, plan.depths[1], plan.period, block0_alike=alike)
            if lo.keys() != hi.keys():
                return None  # the shallower trace's one period starts with an unlike block 0
            # The first part (in the order they ran) to reach the highest peak, as one tracker reads it.
            peaks.append(max((rank(i, k, extrapolated(lo[k], hi[k])) for k in hi), key=lambda p: p["total"]))
    return PhasePeaks(
        peaks=tuple(peaks), forward_activations=line(shallow.forward_activations, deeper.forward_activations)
    )


def _by_position(
    segments: dict[Segment, dict[str, int]], depth: int, period: int, *, block0_alike: bool
) -> dict[Segment, dict[str, int]]:
    """A trace's segments keyed by what each is at any depth: ``pre`` and ``post`` as they are, block
    ``k`` of ``depth`` as ``("first", k)`` among the first blocks from the input and as ``("last", j)``
    among the last ``period``; the blocks between dropped.

    Block 0 can be unlike the others (its input is the embeddings'; a GPT-OSS LoRA block 0's backward
    held 18 KB less than the line through the rest). Then the blocks after it form the line whose
    ends bound the ones between: block ``period`` (the first after it of its kind) is keyed too, and
    block 0 never stands for a last block - a trace of one period (``ckpt:N`` or Gemma-2's pairs over
    a depth ``N`` divides: 2 and 4 blocks) lacks keys, and is traced a period deeper. When block 0
    holds what the others do (``block0_alike``), it is the first of its kind and may be a last one."""
    keyed: dict[Segment, dict[str, int]] = {}
    first = period if block0_alike else period + 1
    for (kind, k), peak in segments.items():
        if kind != "block":
            keyed[(kind, k)] = peak
            continue
        if k < first:
            keyed[("first", k)] = peak
        if depth - 1 - k < period and (k > 0 or block0_alike):
            keyed[("last", depth - 1 - k)] = peak
    return keyed


def _block0_alike(parts: dict[Segment, dict[str, int]], period: int) -> bool:
    """Whether block 0's part of a phase holds what a block of another kind does: a period on, every
    block's part changes by the same bytes (one period's worth, in each category), so block 0 to
    block ``period`` must change as block ``r`` to ``period + r`` does. Read on a trace of at least
    two periods; with one kind of block (period 1) there is none to compare with: False. A phase
    that runs no block: True."""
    blocks = {k: peak for (kind, k), peak in parts.items() if kind == "block"}
    if not blocks:
        return True  # a phase without blocks (the optimizer step): nothing of block 0's to tell apart
    if period < 2 or not all(k in blocks for k in range(2 * period)):
        return False

    def step(r: int) -> dict[str, int]:
        return {c: blocks[period + r][c] - blocks[r][c] for c in blocks[r]}

    return all(step(0) == step(r) for r in range(1, period))


def blocks_of_every_kind(config: PretrainedConfig, model: nn.Module | None = None) -> int:
    """The fewest first blocks that hold every kind of block the model has: a copy cut to them holds
    every kind of layer there is (a hybrid model cut to its first block, a Mamba or linear-attention
    one, has no attention layer for the cache Transformers builds: Qwen3-Next, Jamba; a Qwen3-MoE
    whose block 0 is dense, ``mlp_only_layers=[0]``, has no router for its router loss).

    Read from the config's ``layer_types`` (Jamba's ``layers_block_type``) and, given ``model`` (the
    full-depth model, built on meta), from its blocks' signatures - classes, parameter shapes, plain
    attributes: that also covers the dense and sparse blocks that configs place by their own fields
    (``mlp_only_layers``, ``decoder_sparse_step``, ``first_k_dense_replace``, ...). 1 when all are alike."""
    kinds: Sequence[object] = []
    text = text_config(config)
    for name in ("layer_types", "layers_block_type"):
        named = getattr(text, name, None)
        if isinstance(named, (list, tuple)) and named:
            kinds = list(named)
            break
    blocks = _blocks(model) if model is not None else None
    if blocks is not None:
        signatures = [_signature(b) for b in blocks]
        kinds = [(k, s) for k, s in zip(kinds, signatures, strict=False)] if kinds else signatures
    if not kinds:
        return 1
    distinct: list[object] = []  # compared by equality: a signature's plain attributes may hold lists
    newest = 0
    for i, kind in enumerate(kinds):
        if kind not in distinct:
            distinct.append(kind)
            newest = i
    return newest + 1


def _blocks(model: nn.Module) -> tuple[nn.Module, ...] | None:

    try:
        return find_blocks(model).modules
    except ValueError:
        return None


def _signature(module: nn.Module) -> tuple[object, ...]:
    """What makes two blocks the same block: classes, parameters and buffers, plain attributes."""
    parts: list[object] = []
    for name, sub in module.named_modules():
        tensors = [
            (n, tuple(t.shape), t.dtype, t.requires_grad)
            for n, t in (*sub._parameters.items(), *sub._buffers.items())
            if t is not None
        ]
        plain = sorted(
            (k, v)
            for k, v in vars(sub).items()
            if k not in _INDEX_ATTRIBUTES and not k.startswith("_") and _is_plain(v)
        )
        parts.append((name, type(sub).__qualname__, tuple(tensors), tuple(plain)))
    return tuple(parts)


def _is_plain(value: object) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _outside(model: nn.Module, blocks: tuple[nn.Module, ...]) -> tuple[object, ...]:
    """The signature of everything but the blocks (embeddings, final norm, head)."""
    inside = {id(m) for b in blocks for m in b.modules()}
    parts = []
    for name, sub in model.named_modules():
        if id(sub) in inside:
            continue
        own = [
            (n, tuple(t.shape), t.dtype) for n, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None
        ]
        parts.append((name, type(sub).__qualname__, tuple(own)))
    return tuple(parts)


def _period(signatures: list[tuple[object, ...]]) -> int | None:
    """The smallest period of the stack that leaves room for extrapolating (None: not periodic)."""
    for period in range(1, len(signatures) // (_SHALLOW_PERIODS + 1) + 1):
        if all(signatures[i] == signatures[i % period] for i in range(len(signatures))):
            return period
    return None


def _peft_picks_blocks(peft_config: PeftConfig | None) -> bool:
    """A PEFT config that may treat blocks differently: by index, by pattern, by regular expression."""
    if peft_config is None:
        return False
    if getattr(peft_config, "layers_to_transform", None) is not None or getattr(peft_config, "layers_pattern", None):
        return True
    if getattr(peft_config, "rank_pattern", None) or getattr(peft_config, "alpha_pattern", None):
        return True
    for field in ("target_modules", "exclude_modules"):
        value = getattr(peft_config, field, None)
        if isinstance(value, str) and value != "all-linear":
            return True  # a regular expression over the full names, which may name blocks
        if isinstance(value, (list, tuple, set, frozenset)) and any(
            p.isdigit() for v in value for p in str(v).split(".")
        ):
            return True  # a name with a block's index (layers.0.q_proj)
    return False
