"""Where a model lives (private helpers shared by the modules that need it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def shard_device() -> torch.device:
    """The device FSDP2 shards onto in this process: its GPU when the process group runs NCCL
    (``LOCAL_RANK``'s, as torchrun and Accelerate set it), else the CPU (gloo)."""
    import os

    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall time and allocator peaks are complete."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU RNG (and the device's, on CUDA) on exit: measuring must not shift a run's randomness."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextlib.contextmanager
def module_mode(model: nn.Module, *, training: bool) -> Iterator[None]:
    """``model.train(training)`` inside; every submodule's own mode restored after (a module the
    user put in eval mode stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, was_training in modes:
            module.training = was_training
