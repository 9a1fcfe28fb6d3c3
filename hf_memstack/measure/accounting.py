"""Bytes of tensors and of a model's training state, counted one way everywhere (the meter, the
finder, the estimator and the planner): under FSDP2 a parameter is a DTensor, and only this
rank's local shard occupies this rank's memory."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelStateBytes", "bnb_state_tensors", "model_state_bytes", "optimizer_state_bytes", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t``: the local shard of a DTensor; the inner tensors of a tensor
    subclass (an 8-bit optimizer state: uint8 codes and fp32 scales, whatever dtype it shows; a 4-bit
    NF4 weight: codes, scales, second-level scales and code table); a bitsandbytes 4-bit weight's
    codes and its quantization state; else the whole tensor."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(t, DTensor):
        return tensor_bytes(t.to_local())
    if is_traceable_wrapper_subclass(t):  # torchao's optimizer states: their inner tensors
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(inner) for inner in (getattr(t, name) for name in names) if torch.is_tensor(inner))
    return t.numel() * t.element_size() + sum(tensor_bytes(s) for s in bnb_state_tensors(t))


def bnb_state_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes 4-bit weight's quantization state (``Params4bit.quant_state``:
    its scales, code table and offset, and the second-level ones), which live beside the weight and
    are neither parameters nor buffers; empty for any other tensor."""
    state = t.__dict__.get("quant_state") if isinstance(t, nn.Parameter) else None
    out: list[torch.Tensor] = []
    while state is not None and hasattr(state, "absmax"):
        out += [x for x in (state.absmax, state.code, getattr(state, "offset", None)) if torch.is_tensor(x)]
        state = getattr(state, "state2", None)
    return out


def _sum(tensors: Iterable[object]) -> int:
    return sum(tensor_bytes(t) for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the optimizer's state tensors (AdamW: two moments and a step per parameter)."""
    if optimizer is None:
        return 0
    return _sum(v for state in optimizer.state.values() for v in state.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStateBytes:
    """This rank's bytes of a model's training state, as it is now."""

    parameters: int
    """Parameters and buffers (trainable and frozen)."""
    trainable_parameters: int
    """The part of ``parameters`` that requires grad (what gradients and the optimizer scale with)."""
    gradients: int
    """Gradients currently held (``p.grad``)."""
    optimizer: int
    """Optimizer state tensors."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> ModelStateBytes:
    """This rank's bytes of parameters (and buffers), gradients and optimizer state, as they are
    now; under FSDP only the local shards count."""
    params = list(model.parameters())
    return ModelStateBytes(
        parameters=_sum(params) + _sum(model.buffers()),
        trainable_parameters=_sum(p for p in params if p.requires_grad),
        gradients=_sum(p.grad for p in params if p.grad is not None),
        optimizer=optimizer_state_bytes(optimizer),
    )
