"""The memory meter: run one real training step and report its peak bytes split into parameters,
gradients, optimizer state, activations and temporaries, plus the step time.

On every device the split comes from PyTorch's ``MemTracker`` (a dispatch-mode tracker of live
tensor storage; private API, so it is used in :func:`_track` only, with a fallback). On CUDA the
peak is the caching allocator's own ``max_memory_allocated``.
"""

from __future__ import annotations

import gc
import time
import warnings
from dataclasses import asdict, dataclass
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._device import device_of, synchronize
from .step import LossFn, backward, forward_loss, optimizer_step, train_step

__all__ = ["StepMemory", "format_bytes", "measure_step", "model_state_bytes", "parse_bytes"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True, slots=True)
class StepMemory:
    """One training step's peak memory, by category (bytes), and its time."""

    peak_bytes: int
    """The step's peak: live tensor bytes on CPU, the allocator's peak on CUDA."""
    parameters: int
    """Parameters and buffers at the peak."""
    gradients: int
    optimizer: int
    activations: int
    """Tensors saved for backward (and the batch) at the peak."""
    temporaries: int
    other: int
    step_seconds: float | None
    """Wall time of an untracked step (None when not timed)."""
    device: str
    method: str
    """``memtracker`` (+``cuda-allocator`` peak) or ``fallback``."""
    forward_backward_peak: int = 0
    """Peak of the forward + backward alone: grows linearly with the batch size."""
    saved_activations: int = 0
    """Activation bytes alive at the end of the forward - what the backward needs, and what
    checkpointing shrinks (0 when a custom ``step_fn`` hides the phases)."""
    peak_phase: str = "forward+backward"
    """Where the step peaked: ``forward+backward`` or ``optimizer`` (the step's fixed cost)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [f"{k}={format_bytes(getattr(self, k))}" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")]
        time_s = f", step {self.step_seconds:.3f}s" if self.step_seconds is not None else ""
        return f"peak {format_bytes(self.peak_bytes)} ({', '.join(parts)}){time_s} [{self.method}]"


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def parse_bytes(value: int | float | str, *, field: str = "budget") -> int:
    """``'20GiB'``, ``'512 MB'``, ``'1.5e9'`` or a number of bytes -> int bytes.

    Raises:
        ValueError: not a size, or not positive; the message names ``field``.
    """
    if isinstance(value, bool):
        raise TypeError(f"{field}={value!r} must be a number of bytes or a string like '20GiB'")
    if isinstance(value, (int, float)):
        n = int(value)
    elif isinstance(value, str):
        import re

        m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _UNITS):
            raise ValueError(
                f"{field}={value!r} is not a size; write a number of bytes or a number with a unit "
                f"({', '.join(['B', 'KB', 'MB', 'GB', 'KiB', 'MiB', 'GiB', 'TiB'])}), e.g. '20GiB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit or "b"])
    else:
        raise TypeError(f"{field}={value!r} must be a number of bytes or a string like '20GiB'")
    if n <= 0:
        raise ValueError(f"{field}={value!r} must be positive, e.g. '20GiB'")
    return n


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters (and buffers), gradients and optimizer state, as they are now;
    under FSDP only the local shards count."""
    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's shard
        return local.numel() * local.element_size()

    params = sum(nbytes(t) for t in [*model.parameters(), *model.buffers()])
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    if optimizer is not None:
        opt = sum(nbytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    return {"parameters": params, "gradients": grads, "optimizer": opt}


def measure_step(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: LossFn | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    warmup: bool | None = None,
    timed: bool = True,
    step_fn: Callable[[nn.Module, Any, torch.optim.Optimizer | None], Any] | None = None,
) -> StepMemory:
    """Run a real training step (it updates the model, like any step) and measure its memory.

    Args:
        model: a prepared (or plain) model on its device.
        batch: what the model takes (a dict of tensors for Transformers models, with ``labels``).
        optimizer: stepped after backward; ``None`` measures forward + backward only.
        loss_fn: for models that do not return ``outputs.loss``.
        grad_scaler: fp16's scaler (``model.memstack.grad_scaler``).
        warmup: run one step first so the optimizer state exists and the measured step is a
            steady-state one. ``None``: only when the optimizer has no state yet.
        timed: also time one untracked step (the tracker slows the tracked one down).
        step_fn: ``step_fn(model, batch, optimizer)`` replaces :func:`train_step` (e.g. to measure
            a hand-written loop the same way); ``loss_fn`` and ``grad_scaler`` are then unused.

    Returns:
        :class:`StepMemory`; on CPU the same step twice gives the same bytes.
    """
    phases: list[Callable[[], Any]] | None = None
    if step_fn is None:
        def step_fn(m: nn.Module, b: Any, o: torch.optim.Optimizer | None) -> Any:
            return train_step(m, b, o, loss_fn=loss_fn, grad_scaler=grad_scaler)

        # Split so the tracker can read what the forward left for the backward, and the
        # forward+backward peak before the optimizer step.
        held: dict[str, torch.Tensor] = {}
        phases = [lambda: held.update(loss=forward_loss(model, batch, loss_fn)),
                  lambda: backward(held.pop("loss"), grad_scaler=grad_scaler),
                  lambda: optimizer_step(optimizer, grad_scaler=grad_scaler)]
    if warmup is None:
        warmup = optimizer is not None and not optimizer.state
    if warmup:
        step_fn(model, batch, optimizer)
    device = device_of(model)
    seconds = None
    if timed:
        synchronize(device)
        start = time.perf_counter()
        step_fn(model, batch, optimizer)
        synchronize(device)
        seconds = time.perf_counter() - start
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    breakdown, method = _track(model, optimizer, phases or [lambda: step_fn(model, batch, optimizer)])
    peak = breakdown.pop("total")
    fwd_bwd = breakdown.pop("backward_peak")
    saved = breakdown.pop("forward_activations")
    if device.type == "cuda":
        synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device))
        method += "+cuda-allocator"
    return StepMemory(peak_bytes=int(peak), step_seconds=seconds, device=str(device), method=method,
                      forward_backward_peak=int(fwd_bwd), saved_activations=int(saved),
                      peak_phase="optimizer" if phases and peak > fwd_bwd else "forward+backward", **breakdown)


def _track(model: nn.Module, optimizer: torch.optim.Optimizer | None, phases: list[Callable[[], Any]]) -> tuple[dict[str, Any], str]:
    """Run the step's phases under PyTorch's MemTracker; return the category bytes at the peak,
    the total, the activation bytes alive after the first phase (the forward) and the peak
    reached by the end of the second (the backward). A single phase is the whole step."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # private API: it may move; fall back to counting what outlives the step
        return _fallback(model, optimizer, phases), "fallback"
    tracker = MemTracker()
    tracker.track_external(*(x for x in (model, optimizer) if x is not None))
    forward_activations = backward_peak = 0
    with tracker, warnings.catch_warnings():
        # MemTracker's module tracker warns for modules freed before their backward hook runs.
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        for i, phase in enumerate(phases):
            phase()
            if i == 0 and len(phases) > 1:
                forward_activations = _category(tracker.get_tracker_snapshot("current"), "act")
            if i == min(1, len(phases) - 1):
                backward_peak = _category(tracker.get_tracker_snapshot("peak"), "total")
                if device_of(model).type == "cuda":
                    synchronize(device_of(model))
                    backward_peak = max(backward_peak, torch.cuda.max_memory_allocated(device_of(model)))
    snapshot = tracker.get_tracker_snapshot("peak")
    per_cat: dict[str, int] = {}
    total = 0
    for dev_snapshot in snapshot.values():
        for key, value in dev_snapshot.items():
            name = str(key).rsplit(".", 1)[-1].lower()
            if name == "total":
                total += int(value)
            else:
                per_cat[name] = per_cat.get(name, 0) + int(value)
    return {
        "total": total,
        "parameters": per_cat.get("param", 0) + per_cat.get("buffer", 0),
        "gradients": per_cat.get("grad", 0),
        "optimizer": per_cat.get("opt", 0),
        "activations": per_cat.get("act", 0),
        "temporaries": per_cat.get("temp", 0),
        "other": per_cat.get("oth", 0),
        "forward_activations": forward_activations,
        "backward_peak": backward_peak,
    }, "memtracker"


def _category(snapshot: dict[Any, dict[Any, int]], name: str) -> int:
    """Bytes of one category (``act``, ``total``, ...) summed over devices."""
    return sum(int(v) for dev in snapshot.values() for k, v in dev.items() if str(k).lower().rsplit(".", 1)[-1] == name)


def _fallback(model: nn.Module, optimizer: torch.optim.Optimizer | None, phases: list[Callable[[], Any]]) -> dict[str, Any]:
    """Without MemTracker: model states from their storages, activations from saved-for-backward bytes."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for phase in phases:
            phase()
    params = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    grads = params if any(p.requires_grad for p in model.parameters()) else 0
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    total = params + grads + opt + saved
    return {"total": total, "parameters": params, "gradients": grads, "optimizer": opt,
            "activations": saved, "temporaries": 0, "other": 0, "forward_activations": saved, "backward_peak": total}

