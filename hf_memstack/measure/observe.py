"""observe: the hooks that watch verify's one forward + backward.

What verify checks is what these saw: the bytes saved for backward, which blocks re-ran their
forward in the backward (checkpointing), the FLOPs spent recomputing, the Linear outputs' dtypes
(autocast), the tiled MLPs' tiles, and selective checkpointing's "nothing saved" warnings. They
watch from outside (hooks, a FLOP counter), so the step itself runs as in training.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..distributed._ranks import on_every_rank, share_error
from ..distributed._stalls import watching
from ..record import MemstackRecord
from ..transforms.checkpointing.apply import SelectiveCheckpointingWarning
from ..transforms.tiled_mlp import tiled_mlps
from .grad_reach import GradReach, Unreached
from .step import LossFn, forward_loss

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["Observed", "observe_step"]

_ForwardHook = Callable[[nn.Module, tuple[object, ...], object], None]
"""``hook(module, args, output)``, as ``register_forward_hook`` calls it."""


@dataclass(slots=True)
class Observed:
    """What the hooks saw during one forward + backward."""

    saved_bytes: int = 0
    recomputed: list[int] = field(default_factory=list)
    linear_dtypes: set[torch.dtype] = field(default_factory=set)
    loss_dtype: torch.dtype | None = None
    loss_finite: bool = True
    """Every element of the loss is finite (a nan or inf loss trains nothing, whatever its gradients)."""
    selective_saved_nothing: bool = False
    """Selective checkpointing warned that no op of its save list ran in a checkpointed block."""
    backward_error: str | None = None
    """Why the backward could not run (the loss needs no gradient), or None."""
    flops: _Flops = field(default_factory=lambda: _Flops())
    tiles: dict[int, list[int]] = field(default_factory=dict)
    """Per tiled MLP (block index): the calls of its first submodule in the forward and in the backward."""
    unreached: Unreached = field(default_factory=Unreached)
    """The trainable parameters without a gradient that the loss does not use (read from the graph)."""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensors hook: counts what the forward saves for the backward (outside checkpoints)."""
        self.saved_bytes += t.numel() * t.element_size()
        return t


def observe_step(
    model: nn.Module, batch: object, loss_fn: LossFn | None, record: MemstackRecord, *, shared: bool
) -> Observed:
    observed = Observed()
    phase = _Phase()
    counter = FlopCounterMode(display=False)
    handles, backward_calls = _watch(model, record, observed, counter, phase)
    reach = GradReach()
    handles += reach.watch(model, lambda: phase.backward)
    try:
        # Selective checkpointing says, when a block's contexts are done with (after its forward if it
        # kept nothing, else after its backward), whether the block kept anything: listen throughout.
        with _selective_warnings() as caught:
            with counter, torch.autograd.graph.saved_tensors_hooks(observed.pack, lambda t: t):
                # Agreed before the backward, whose collectives a rank that failed here would never reach.
                loss = on_every_rank("verify: the forward", lambda: forward_loss(model, batch, loss_fn), shared=shared)
            observed.flops.forward = counter.get_total_flops()
            observed.loss_dtype = loss.dtype
            observed.loss_finite = bool(torch.isfinite(loss.detach()).all())
            phase.backward = True
            every_rank_needs_grad = (
                share_error("verify: the loss needs gradients", None, values=(int(loss.requires_grad),))[0]
                if shared
                else loss.requires_grad
            )
            if every_rank_needs_grad:
                reach.walk_loss(loss)  # before the backward frees the graph
                # A peer that never reaches the backward's collectives is named (shared: under FSDP/DDP).
                with counter, watching("verify: the backward", shared=shared):
                    loss.backward()
                observed.flops.backward = counter.get_total_flops()  # entering the counter again reset it
                observed.unreached = reach.unreached(model)
            elif loss.requires_grad:
                observed.backward_error = (
                    "the loss does not require grad on another rank, so no rank runs the backward "
                    "(its collectives need every rank)"
                )
            else:
                observed.backward_error = "the loss does not require grad: no trainable parameter contributes to it"
            reach.release()  # the graph of the branches the loss does not use
            del loss  # the checkpoints' frames sit in reference cycles: free them while listening
            gc.collect()
        observed.selective_saved_nothing = bool(caught)
    finally:
        phase.backward = False
        for h in handles:
            h.remove()
    observed.recomputed = [i for i, n in enumerate(backward_calls) if n]
    return observed


class _Phase:
    """Whether the observed step is in its backward (read by the hooks)."""

    backward = False


def _watch(
    model: nn.Module, record: MemstackRecord, observed: Observed, counter: FlopCounterMode, phase: _Phase
) -> tuple[list[RemovableHandle], list[int]]:
    """Forward hooks counting each block's runs in the backward (its recompute), each tiled MLP's
    tiles in the forward and the backward, and the Linear outputs' dtypes; the FLOP watch on the
    checkpointed blocks. Returns the handles and the per-block backward run counts."""
    blocks = record.blocks.modules if record.blocks is not None else ()
    backward_calls = [0] * len(blocks)
    checkpointed = set(record.checkpointing.checkpointed)

    def block_hook(i: int) -> _ForwardHook:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if phase.backward:
                backward_calls[i] += 1

        return hook

    def linear_hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if torch.is_tensor(output):
            observed.linear_dtypes.add(output.dtype)

    def tile_hook(i: int) -> _ForwardHook:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if module.training:  # not the packed-batch guard's probe (it runs in eval mode)
                observed.tiles.setdefault(i, [0, 0])[int(phase.backward)] += 1

        return hook

    # Submodules, not the block itself: checkpointing re-runs the block's forward function, not
    # its __call__, so only inner modules re-run visibly (their hooks fire during backward). A tiled
    # MLP recomputes its tiles in the backward on its own: its modules are watched apart.
    mlps = tiled_mlps(record.blocks, record.mlp)
    inside_mlps = {id(m) for mlp in mlps.values() for m in mlp.modules()}
    handles = [
        sub.register_forward_hook(block_hook(i))
        for i, block in enumerate(blocks)
        for sub in block.modules()
        if id(sub) not in inside_mlps
    ]
    handles += [next(mlp.children(), mlp).register_forward_hook(tile_hook(i)) for i, mlp in mlps.items()]
    handles += [sub.register_forward_hook(linear_hook) for sub in model.modules() if isinstance(sub, nn.Linear)]
    handles += observed.flops.watch(
        [b for i, b in enumerate(blocks) if i in checkpointed], counter, lambda: phase.backward
    )
    return handles, backward_calls


@contextlib.contextmanager
def _selective_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Collect selective checkpointing's "nothing saved" warnings (each recompute would give one);
    every other warning is passed on as it came."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours: list[warnings.WarningMessage] = []
        yield ours
    for w in caught:
        if issubclass(w.category, SelectiveCheckpointingWarning):
            ours.append(w)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@dataclass(slots=True)
class _Flops:
    """FLOPs of the step, and those spent inside checkpointed blocks (forward, and recompute in backward)."""

    forward: int = 0
    backward: int = 0
    checkpointed_forward: int = 0
    """FLOPs of the checkpointed blocks' forward: what full checkpointing recomputes."""
    recompute: int = 0
    _depth: int = 0
    _start: int = 0

    def watch(
        self, blocks: list[nn.Module], counter: FlopCounterMode, in_backward: Callable[[], bool]
    ) -> list[RemovableHandle]:
        """Hooks on the blocks' submodules that add the counter's FLOPs while one of them runs."""

        def enter(module: nn.Module, args: tuple[object, ...]) -> None:
            if self._depth == 0:
                self._start = counter.get_total_flops()
            self._depth += 1

        def leave(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            self._depth -= 1
            if self._depth == 0:
                spent = counter.get_total_flops() - self._start
                if in_backward():
                    self.recompute += spent
                else:
                    self.checkpointed_forward += spent

        subs = [sub for block in blocks for sub in block.children()]
        # always_call: a recompute stops early (once it has what the backward needs) by raising
        # through the module that runs; its FLOPs so far still count, and the depth stays right.
        return [
            h
            for sub in subs
            for h in (sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave, always_call=True))
        ]
