"""Where in a step the bytes are: before the model's blocks run, in block ``k``, after the last one.

The estimator traces a deep model at two shallow depths and extrapolates (:mod:`hf_memstack.planning.estimate.depth`).
A phase's peak is its highest moment, and which moment that is can move with the depth: in the
backward of a LoRA model under checkpointing, the head's backward (the logits' gradient) holds the
peak of a 2-block model, but each block's backward adds its adapters' gradients while freeing only
its checkpointed input, so at 16 or 32 blocks the last block to run its backward holds it (a LoRA
Mixtral at 16 blocks read 2% low from one line through the phase's peaks). Each part of a phase is
a line in the depth - before the blocks, the first blocks to run, the last blocks to run, after
them - and the blocks between lie on the line from the first to the last, so the phase's peak is the
highest of those lines at the full depth. The tracker keeps each part's peak apart
(:func:`segment_hooks` says which part runs), and the extrapolation takes the highest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["POST", "PRE", "Segment", "segment_hooks"]

Segment = tuple[str, int]
"""``("pre", 0)``, ``("block", k)`` (block ``k`` of the model, counted from its input) or ``("post", 0)``."""
PRE: Segment = ("pre", 0)
POST: Segment = ("post", 0)


def segment_hooks(
    blocks: Sequence[nn.Module], enter: Callable[[Segment], None], phase: Callable[[], int]
) -> list[RemovableHandle]:
    """Hooks on ``blocks`` that call ``enter`` as each part of a phase begins (``phase()``: 0 for the
    forward, 1 for the backward; the optimizer step runs no block).

    Forward: each block's start, then the rest after the last block. Backward: each block's start,
    when the gradient of its output arrives (also when its checkpointed forward is recomputed, which
    is part of its backward); then, when the gradient of block 0's input arrives, the rest (the
    embeddings'). A phase begins in ``PRE``: the caller enters it.
    """
    handles: list[RemovableHandle] = []
    last = len(blocks) - 1
    for k, block in enumerate(blocks):

        def pre(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], k: int = k) -> None:
            enter(("block", k))
            if k == 0 and phase() == 0:
                _on_gradient(_first_tensor((*args, *kwargs.values())), lambda: enter(POST))

        def post(module: nn.Module, args: tuple[object, ...], output: object, k: int = k) -> None:
            if phase() != 0:
                return  # a checkpointed block recomputed in the backward: still its own part
            _on_gradient(_first_tensor(output), lambda: enter(("block", k)))
            if k == last:
                enter(POST)

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))
    return handles


def _on_gradient(t: torch.Tensor | None, call: Callable[[], None]) -> None:
    """Call ``call`` when the backward computes the gradient of ``t`` (nothing when none will flow)."""
    if t is not None and t.requires_grad:

        def hook(grad: torch.Tensor) -> None:
            call()

        t.register_hook(hook)


def _first_tensor(values: object) -> torch.Tensor | None:
    """The hidden states among a block's inputs or outputs: its first tensor."""
    if isinstance(values, torch.Tensor):
        return values
    if isinstance(values, (tuple, list)):
        for v in values:
            if isinstance(v, torch.Tensor):
                return v
    return None
