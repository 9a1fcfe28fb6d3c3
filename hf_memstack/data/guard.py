"""The packed-batch guard ``prepare_model`` puts on a model's forward: a packed batch (its
``position_ids`` restart inside a row) that would let its samples attend to each other - a 2-D
attention mask, a KV cache, an attention implementation that ignores the boundaries - is refused
with the fix, before the forward runs (:func:`hf_memstack.data.check_packed_batch`).

It costs nothing on batches without ``position_ids`` (one dict look-up); with them, one small
reduction over the positions (a device sync on a GPU, as Transformers' own packed-sequence
detection makes). It checks training and evaluation calls (gradients on, or labels given), not
generation, whose padded rows carry position ids of their own. The attention probe runs once, at
the first packed batch, on the model itself; under FSDP (where a probe would need every rank at
once) the attention implementation is judged by its name instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from ..record import unwrap_model
from ..transforms._wrappers import _ForwardWrapper
from .boundaries import (
    _check_no_2d_mask,
    _check_no_cache,
    _known_boundary_aware,
    attention_respects_boundaries,
    ignores_boundaries_message,
    is_packed,
)

__all__ = ["PackedBatchGuard", "install_packing_guard"]


def install_packing_guard(model: nn.Module, *, probe: bool) -> bool:
    """Put :class:`PackedBatchGuard` on ``model``'s forward (in place); False (nothing done) for a
    forward without a ``position_ids`` argument, which cannot receive a packed batch."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "position_ids" not in parameters:
        return False
    model.forward = PackedBatchGuard(model, probe=probe)  # type: ignore[method-assign]
    return True


def settle_packing_guard(model: nn.Module, batch: object) -> None:
    """Run the guard's checks of a packed ``batch`` now, before a measured step: its one-time probe
    of the attention runs two extra forwards, which a memory meter would count (and PyTorch's
    MemTracker refuses a module called twice in one tracked step). Nothing for other batches."""
    guard = _installed_guard(unwrap_model(model))
    if guard is not None and isinstance(batch, Mapping) and batch.get("position_ids") is not None:
        positions = batch["position_ids"]
        if not _is_fake(positions):
            guard._check(dict(batch))


def _installed_guard(model: nn.Module) -> PackedBatchGuard | None:
    """The guard prepare_model put on ``model.forward``, under whatever wraps it since: Accelerate's
    mixed precision wraps the forward in autocast (``functools.wraps``, so ``__wrapped__`` leads back)."""
    forward = getattr(model, "forward", None)
    for _ in range(8):  # a handful of wrappers at most; never loop on a cycle
        if isinstance(forward, PackedBatchGuard):
            return forward
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return None
        forward = getattr(forward, "__func__", forward)
    return None


class PackedBatchGuard(_ForwardWrapper):
    """Checks a packed batch before the model's forward runs it (see the module docstring)."""

    def __init__(self, module: nn.Module, *, probe: bool) -> None:
        super().__init__(module)
        self.probe = probe
        self._respects: bool | None = None
        self._busy = False
        parameters = inspect.signature(self.__wrapped__).parameters.values()
        self._positional = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    def __call__(self, *args: object, **kwargs: object) -> object:
        positions = kwargs.get("position_ids")
        if positions is None and "position_ids" in self._positional[: len(args)]:
            positions = args[self._positional.index("position_ids")]
        if positions is not None and not self._busy and not _is_fake(positions):
            arguments = dict(zip(self._positional, args))
            arguments.update(kwargs)
            if torch.is_grad_enabled() or arguments.get("labels") is not None:
                self._check(arguments)
        return self.__wrapped__(*args, **kwargs)

    @torch.compiler.disable
    def _check(self, arguments: Mapping[str, object]) -> None:
        # Run eagerly under a whole-model compile (a graph break before the forward), not skipped.
        if not is_packed(arguments["position_ids"], arguments.get("attention_mask")):
            return
        _check_no_2d_mask(arguments.get("attention_mask"))
        _check_no_cache(self.module, arguments)
        if self._respects is None:
            self._busy = True  # the probe calls this forward
            try:
                self._respects = (
                    attention_respects_boundaries(self.module) if self.probe else _known_boundary_aware(self.module)
                )
            finally:
                self._busy = False
        if not self._respects:
            raise ValueError(ignores_boundaries_message(self.module))

    def _options(self) -> dict[str, object]:
        return {"probe": self.probe}


def _is_fake(t: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or (torch.is_tensor(t) and t.is_meta)
