"""tracker: PyTorch's MemTracker, taught about frozen parameters, and one step traced phase by phase.

MemTracker (a private API, ``torch.distributed._tools.mem_tracker``) attributes every live tensor
to a category (parameter, gradient, optimizer state, activation, temporary); this module holds what
reads it, so the measured step (:mod:`.memory`) and the estimator's fake-tensor traces share one tracker.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .accounting import bnb_state_tensors

__all__ = ["PhasePeaks", "trace_phases"]


@dataclass(frozen=True, slots=True)
class PhasePeaks:
    """What the tracker saw in one step, phase by phase: each phase's peak by MemTracker category
    (``total``, ``param``, ``buffer``, ``grad``, ``opt``, ``act``, ``temp``, ``oth``), and the
    activations alive when the first phase (the forward) ended. The estimator extrapolates these
    across depths: each phase's peak is a line in the number of identical blocks, the step's peak
    (their maximum) is not."""

    peaks: tuple[dict[str, int], ...]
    forward_activations: int


_CATEGORIES = ("total", "param", "buffer", "grad", "opt", "act", "temp", "oth")


def trace_phases(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, phases: list[Callable[[], Any]]
) -> PhasePeaks | None:
    """Each phase's peak under MemTracker (None when this PyTorch has none). The tracker's peak is
    reset to the current bytes as each phase starts, so each phase's own peak is read."""
    tracker = _frozen_aware_tracker()
    if tracker is None:
        return None
    tracker.track_external(*(x for x in (model, optimizer) if x is not None))
    peaks: list[dict[str, int]] = []
    forward_activations = 0
    with tracker, warnings.catch_warnings():
        # MemTracker's module tracker warns for modules freed before their backward hook runs.
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        for i, phase in enumerate(phases):
            if i:
                tracker.restart_peak()
            phase()
            if i == 0 and len(phases) > 1:
                forward_activations = _category(tracker.get_tracker_snapshot("current"), "act")
            peak = tracker.get_tracker_snapshot("peak")
            peaks.append({name: _category(peak, name) for name in _CATEGORIES})
    return PhasePeaks(peaks=tuple(peaks), forward_activations=forward_activations)


def _frozen_aware_tracker() -> Any:
    """PyTorch's MemTracker, taught that frozen parameters get no gradient.

    MemTracker hooks every parameter it sees to count its gradient, and PyTorch refuses a hook on
    a tensor that does not require grad (every LoRA model, frozen embeddings). This subclass hooks
    only the trainable ones; frozen parameters still count as parameters, a bitsandbytes 4-bit
    weight with its quantization state (tensors no module holds as a parameter or buffer). ``None`` when this
    PyTorch has no MemTracker (it is a private API).
    """
    try:
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
    except ImportError:
        return None

    class FrozenAwareMemTracker(MemTracker):
        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            def grad_hook(grad: torch.Tensor) -> None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            param_memory = buffer_memory = 0
            for param in module.parameters():
                param_memory += sum(
                    w.mem_consumed for w in self._update_and_maybe_create_winfos(param, _MemRefType.PARAM)
                )
                for state in bnb_state_tensors(param):  # a bitsandbytes 4-bit weight's scales, beside it
                    param_memory += sum(
                        w.mem_consumed for w in self._update_and_maybe_create_winfos(state, _MemRefType.PARAM)
                    )
                if param.grad is not None:
                    self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD)
                if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(grad_hook),
                        # None when an optimizer stepping in the backward already used and freed it.
                        param.register_post_accumulate_grad_hook(
                            lambda p: grad_hook(p.grad) if p.grad is not None else None
                        ),
                    )
            for buffer in module.buffers():
                buffer_memory += sum(
                    w.mem_consumed for w in self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)
                )
            return param_memory, buffer_memory

        def restart_peak(self) -> None:
            """Read the next phase's own peak: from the bytes alive now."""
            self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._curr_mem_snap.items()}
            self._peak_mem_snap = {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()}

        def _update_peak_stats(self, peak_state: Any) -> None:
            # MemTracker walks every tracked module on every op to keep per-module peaks, which
            # nothing here reads: O(modules) per op made a 7B estimate take minutes (its time grew
            # with the square of the depth). Only the global peak is kept, as MemTracker keeps it.
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

    return FrozenAwareMemTracker()


def _category(snapshot: dict[Any, dict[Any, int]], name: str) -> int:
    """Bytes of one category (``act``, ``total``, ...) summed over devices."""
    return sum(int(v) for dev in snapshot.values() for k, v in dev.items() if str(k).lower().rsplit(".", 1)[-1] == name)
