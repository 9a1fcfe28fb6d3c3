"""What a training step changes, copied to host memory before the finder's probes and written
back, bitwise, after them: trainable parameters, every gradient, buffers, optimizer state and
settings, scheduler and scaler state, and each submodule's own train/eval mode.

Frozen parameters are not copied - a step cannot change them - so LoRA on a large model needs
no second host copy of its base weights. Tensors are written back in place where they still
exist (same storage, so references held elsewhere stay valid); under FSDP2 only this rank's
local shards are copied.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard, cast

import torch
from torch import nn

from ..measure.accounting import tensor_bytes
from ..measure.simulated import untracked

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement

__all__ = ["SchedulerLike", "StepState", "step_state_restored"]


class SchedulerLike(Protocol):
    """What the snapshot needs of a learning-rate scheduler (``torch.optim.lr_scheduler.LRScheduler``,
    Transformers' schedulers, or any object with the same two methods): its state, and a way back to it."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object], /) -> None: ...


@dataclass(frozen=True, slots=True)
class _Saved:
    """A host copy of a tensor's local data, and how to rebuild the tensor on its device."""

    host: torch.Tensor
    """The local data, copied to host memory."""
    device: torch.device
    """Where the local data lives."""
    dtensor: tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]] | None
    """``(mesh, placements, shape, stride)`` of a DTensor; None for a plain tensor."""

    @classmethod
    def of(cls, t: torch.Tensor) -> _Saved:
        local = _local(t)
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if _is_dtensor(t) else None
        return cls(local.detach().to("cpu", copy=True), local.device, spec)

    def rebuild(self) -> torch.Tensor:
        local = self.host.to(self.device, copy=True)
        if self.dtensor is None:
            return local
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def write_into(self, t: torch.Tensor) -> bool:
        """Copy back in place when ``t`` still has the saved layout; False when it must be rebuilt."""
        local = _local(t)
        if local.shape != self.host.shape or local.dtype != self.host.dtype or local.device != self.device:
            return False
        local.copy_(self.host)
        return True


class StepState:
    """The copies; :meth:`restore` writes them back. ``copied_bytes`` is the host memory they take."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: SchedulerLike | None,
        grad_scaler: torch.amp.GradScaler | None,
    ):
        self.model, self.optimizer, self.scheduler, self.grad_scaler = model, optimizer, scheduler, grad_scaler
        params = list(dict.fromkeys(model.parameters()))
        with torch.no_grad(), untracked():  # host copies: never counted as device memory
            self.trainable = [(p, _Saved.of(p)) for p in params if p.requires_grad]
            self.buffers = [(b, _Saved.of(b)) for b in dict.fromkeys(model.buffers())]
            self.grads = [(p, None if p.grad is None else _Saved.of(p.grad)) for p in params]
            self.opt_state = _save_optimizer(optimizer)
            self.opt_groups = (
                []
                if optimizer is None
                else [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            )
            self.sched = None if scheduler is None else copy.deepcopy(scheduler.state_dict())
            self.scaler = None if grad_scaler is None else copy.deepcopy(grad_scaler.state_dict())
        self.modes = [(m, m.training) for m in model.modules()]
        saved = [s for _, s in [*self.trainable, *self.buffers, *self.grads] if s is not None]
        saved += [v for state in self.opt_state.values() for v in state.values() if isinstance(v, _Saved)]
        self.copied_bytes = sum(tensor_bytes(s.host) for s in saved)

    def restore(self) -> None:
        # Rebuilt tensors are not checked against a simulated limit: a half-restored model would
        # be worse than a miscounted one, and they held this memory before the search.
        with torch.no_grad(), untracked():
            for t, saved in [*self.trainable, *self.buffers]:
                saved.write_into(t)
            for p, g in self.grads:
                p.grad = None if g is None else g.rebuild()
            _restore_optimizer(self.optimizer, self.opt_state, self.opt_groups)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(cast("dict[str, object]", self.sched))  # saved from this scheduler
        if self.grad_scaler is not None and self.scaler is not None:  # both or neither: saved from the scaler
            self.grad_scaler.load_state_dict(self.scaler)
        for m, training in self.modes:  # each submodule's own mode, not the root's
            m.training = training


@contextlib.contextmanager
def step_state_restored(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: SchedulerLike | None,
    grad_scaler: torch.amp.GradScaler | None,
) -> Iterator[StepState]:
    """Copy the step's state now and write it back on exit, also when the body raises."""
    state = StepState(model, optimizer, scheduler, grad_scaler)
    try:
        yield state
    finally:
        state.restore()


def _save_optimizer(optimizer: torch.optim.Optimizer | None) -> dict[torch.Tensor, dict[str, object]]:
    if optimizer is None:
        return {}
    return {
        p: {k: _Saved.of(v) if torch.is_tensor(v) else copy.deepcopy(v) for k, v in state.items()}
        for p, state in optimizer.state.items()
    }


def _restore_optimizer(
    optimizer: torch.optim.Optimizer | None,
    saved: dict[torch.Tensor, dict[str, object]],
    groups: list[dict[str, object]],
) -> None:
    if optimizer is None:
        return
    for p in list(optimizer.state):
        if p not in saved:  # state the probes created (the optimizer had none for p)
            del optimizer.state[p]
    for p, entries in saved.items():
        current = optimizer.state.get(p, {})
        restored: dict[str, object] = {}
        for k, v in entries.items():
            if isinstance(v, _Saved):
                now = current.get(k)
                restored[k] = now if torch.is_tensor(now) and v.write_into(now) else v.rebuild()
            else:
                restored[k] = copy.deepcopy(v)
        optimizer.state[p] = restored
    for group, settings in zip(optimizer.param_groups, groups):
        for k in [k for k in group if k != "params" and k not in settings]:
            del group[k]
        group.update(copy.deepcopy(settings))


def _is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    # Duck-typed (no import of torch.distributed at run time); the guard tells the checker what it found.
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's data of ``t``: a DTensor's local shard (sharing its storage), else ``t``."""
    return t.to_local() if _is_dtensor(t) else t
