"""Find the repeated transformer blocks of any model: the unit that checkpointing wraps,
regional compile compiles once, and FSDP shards.

One place, three sources, in order:
1. an explicit override (class names),
2. the model's ``_no_split_modules`` classes that repeat (BERT also lists its embeddings there),
3. the largest ``nn.ModuleList`` / ``nn.Sequential`` whose children are all of one class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

__all__ = ["Blocks", "find_blocks", "no_blocks_reason"]


BlockSource = Literal["override", "_no_split_modules", "largest ModuleList"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Blocks:
    """The repeated blocks of a model, by qualified name under ``root``."""

    root: nn.Module = field(repr=False, compare=False)
    """The module the names are relative to (the model that was searched)."""
    names: tuple[str, ...]
    """Qualified names of the blocks under ``root``, in execution order."""
    class_names: tuple[str, ...]
    """The blocks' class names, as found (before FSDP2 renames the classes it shards)."""
    source: BlockSource
    """How they were found: an explicit override, the model's ``_no_split_modules``, or the
    largest ``ModuleList``/``Sequential`` of one class."""

    def __len__(self) -> int:
        return len(self.names)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """The blocks as they are now under ``root`` (whatever replaced one in its parent included)."""
        return tuple(self.root.get_submodule(name) for name in self.names)

    def replace(self, index: int, module: nn.Module) -> None:
        """Put ``module`` where block ``index`` is, in its parent."""
        parent_name, _, child = self.names[index].rpartition(".")
        setattr(self.root.get_submodule(parent_name) if parent_name else self.root, child, module)


def find_blocks(model: nn.Module, block_classes: Sequence[str] | None = None) -> Blocks:
    """Return the repeated blocks of ``model``.

    Args:
        model: any ``nn.Module``; Transformers models are searched through ``_no_split_modules``.
        block_classes: class names that override detection, e.g. ``["LlamaDecoderLayer"]``.

    Raises:
        ValueError: no blocks can be found (or the override names no module of the model); the
            message lists candidate class names and how to pass ``block_classes``.
    """
    named = list(model.named_modules())
    if block_classes:
        wanted = set(block_classes)
        hits = [(n, m) for n, m in named if type(m).__name__ in wanted and m is not model]
        hits = _outermost(hits)
        if not hits:
            raise ValueError(
                f"policy.checkpointing.block_classes={list(block_classes)!r} names no module of "
                f"{type(model).__name__}; candidates: {_candidates(model)}. Pass the class name of the "
                "repeated layer, e.g. MemoryPolicy(checkpointing={'mode': 'full', 'block_classes': ['MyBlock']})"
            )
        return _make(model, hits, "override")

    no_split = getattr(model, "_no_split_modules", None) or ()
    if no_split:
        wanted = set(no_split)
        hits = [(n, m) for n, m in named if type(m).__name__ in wanted and m is not model]
        counts: dict[str, int] = {}
        for _, m in hits:
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        repeated = [(n, m) for n, m in hits if counts[type(m).__name__] >= 2]
        repeated = _outermost(repeated)
        if repeated:
            return _make(model, repeated, "_no_split_modules")

    best: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        kinds = {type(c) for _, c in children}
        # Leaf layers (Linear, Dropout) are not blocks: a block has submodules of its own.
        if len(kinds) == 1 and any(True for _ in children[0][1].children()):
            if len(children) > len(best):
                prefix = f"{name}." if name else ""
                best = [(prefix + n, c) for n, c in children]
    if best:
        return _make(model, best, "largest ModuleList")

    raise ValueError(
        f"cannot find repeated blocks in {type(model).__name__}: it has no `_no_split_modules` that repeat and "
        f"no ModuleList/Sequential of identical modules. Candidates: {_candidates(model)}. Pass the block "
        "class name: MemoryPolicy(checkpointing={'mode': 'full', 'block_classes': ['MyBlock']})"
    )


def no_blocks_reason(model: nn.Module) -> str | None:
    """Where ``model`` says it has no blocks at all: a config with 0 layers, or an empty
    ``ModuleList`` (where the blocks would be); None when it says nothing of the kind (blocks that
    exist but are not found are :func:`find_blocks`' error). Asked after ``find_blocks`` found none."""
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)  # a multimodal config's layers are its text model's
    text = get_text_config() if callable(get_text_config) else config
    layers = getattr(text, "num_hidden_layers", None)
    if type(layers) is int and layers == 0:
        return "config.num_hidden_layers=0"
    empty = [n for n, m in model.named_modules() if type(m) is nn.ModuleList and len(m) == 0]
    return f"its ModuleList {empty[0]!r} is empty" if empty else None


def _outermost(hits: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop matches nested inside another match (a block class used inside a block)."""
    names = [n for n, _ in hits]
    return [(n, m) for n, m in hits if not any(n != o and n.startswith(o + ".") for o in names)]


def _make(root: nn.Module, hits: list[tuple[str, nn.Module]], source: BlockSource) -> Blocks:
    return Blocks(
        root=root,
        names=tuple(n for n, _ in hits),
        class_names=tuple(dict.fromkeys(type(m).__name__ for _, m in hits)),
        source=source,
    )


def _candidates(model: nn.Module, limit: int = 8) -> str:
    counts: dict[str, int] = {}
    for _, m in model.named_modules():
        if m is not model and any(True for _ in m.children()):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{k} (x{v})" for k, v in top) or "none (the model has no submodules with children)"
