"""tracker: PyTorch's MemTracker, taught about frozen parameters, and one step traced phase by phase.

MemTracker (a private API, ``torch.distributed._tools.mem_tracker``) attributes every live tensor
to a category (parameter, gradient, optimizer state, activation, temporary); this module holds what
reads it, so the measured step (:mod:`.memory`) and the estimator's fake-tensor traces share one tracker.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from .accounting import bnb_state_tensors
from .segments import PRE, Segment, segment_hooks

if TYPE_CHECKING:
    from torch.utils.weak import WeakIdKeyDictionary

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
    segments: tuple[dict[Segment, dict[str, int]], ...] = field(default=())
    """Each phase's peak in each of its parts (:mod:`.segments`: before the blocks, in block ``k``,
    after them), in the order they first ran; empty unless the blocks were given."""
    kept: int = 0
    """Bytes the loop holds from one step to the next (the outputs of a loop that keeps them), as the
    tracker counts them; already in every phase's peak (the first phase's: the previous step's)."""


Snapshot = dict[torch.device, dict[str, int]]
"""MemTracker's reading of the bytes alive: device -> category (``Total``, ``_MemRefType``'s names) -> bytes."""


class _Tracker(Protocol):
    """What is read of :func:`_frozen_aware_tracker`'s MemTracker (here and in
    ``integrations/trainer_first_step.py``): its context, snapshots, storages and modules, and the
    subclass's phases and segments."""

    _WINFO: WeakIdKeyDictionary
    memory_tracking: WeakIdKeyDictionary

    def __enter__(self) -> object: ...
    def __exit__(self, *args: object) -> None: ...
    def track_external(self, *external: nn.Module | torch.optim.Optimizer | torch.Tensor) -> None: ...
    def get_tracker_snapshot(self, type: str = "current") -> Snapshot: ...
    def reset_mod_stats(self) -> None: ...
    def restart_peak(self) -> None: ...
    def keep_segments(self) -> None: ...
    def enter_segment(self, segment: Segment) -> None: ...
    def segment_peaks(self) -> list[tuple[Segment, Snapshot]]: ...


_CATEGORIES = ("total", "param", "buffer", "grad", "opt", "act", "temp", "oth")


def trace_phases(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    phases: list[Callable[[], object]],
    *,
    blocks: Sequence[nn.Module] = (),
    kept: Callable[[], object] | None = None,
) -> PhasePeaks | None:
    """Each phase's peak under MemTracker (None when this PyTorch has none). The tracker's peak is
    reset to the current bytes as each phase starts, so each phase's own peak is read. With the
    model's ``blocks``, also each phase's peak in each of its parts (``segments``).

    ``kept``: what a loop holds from one step to the next (the outputs of a loop that keeps
    ``outputs``), read after the last phase. The phases hold this step's; the previous step's, of
    the same shapes, were alive through this step's forward until ``outputs = model(...)`` rebound
    them - tensors the tracker never saw made (they predate it), so they are added to the first
    phase (its peak and each of its parts), in ``oth``: what MemTracker reads when given them with
    ``track_external``."""
    tracker = _frozen_aware_tracker()
    if tracker is None:
        return None
    tracker.track_external(*(x for x in (model, optimizer) if x is not None))
    previous = 0
    peaks: list[dict[str, int]] = []
    segments: list[dict[Segment, dict[str, int]]] = []
    forward_activations = 0
    current = [0]
    hooks = segment_hooks(blocks, tracker.enter_segment, lambda: current[0]) if blocks else []
    try:
        with tracker, warnings.catch_warnings():
            # MemTracker's module tracker warns for modules freed before their backward hook runs.
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            for i, phase in enumerate(phases):
                current[0] = i
                if i:
                    tracker.restart_peak()
                if blocks:
                    tracker.keep_segments()
                phase()
                if i == 0 and len(phases) > 1:
                    forward_activations = _category(tracker.get_tracker_snapshot("current"), "act")
                peak = tracker.get_tracker_snapshot("peak")
                peaks.append({name: _category(peak, name) for name in _CATEGORIES})
                if blocks:
                    segments.append(
                        {
                            s: {name: _category(snap, name) for name in _CATEGORIES}
                            for s, snap in tracker.segment_peaks()
                        }
                    )
            previous = _bytes_of(tracker, kept()) if kept is not None else 0
    finally:
        for handle in hooks:
            handle.remove()
    if previous:
        peaks[0] = _plus(peaks[0], previous)
        if segments:
            segments[0] = {s: _plus(c, previous) for s, c in segments[0].items()}
    return PhasePeaks(
        peaks=tuple(peaks), forward_activations=forward_activations, segments=tuple(segments), kept=previous
    )


def _bytes_of(tracker: _Tracker, values: object) -> int:
    """The bytes ``tracker`` counts for the tensors in ``values`` (a model's outputs, nested): each
    storage once, rounded as it rounds them (512-byte blocks on CUDA); 0 for any it never saw."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    seen: dict[int, int] = {}
    for t in _tensors(values):
        for st in get_untyped_storages(t):
            winfo, _ = tracker._WINFO.get(st, (None, None))
            seen[id(st)] = winfo.mem_consumed if winfo is not None else 0
    return sum(seen.values())


def _tensors(values: object) -> list[torch.Tensor]:
    """The tensors in a model's outputs: a tensor, a mapping (a ``ModelOutput``), a tuple or list of them, nested."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, Mapping):
        values = list(values.values())
    if isinstance(values, (tuple, list)):
        return [t for v in values for t in _tensors(v)]
    return []


def _plus(categories: dict[str, int], other: int) -> dict[str, int]:
    """A phase's (or part's) peak with ``other`` bytes more alive throughout, counted as ``oth``."""
    return {**categories, "total": categories["total"] + other, "oth": categories["oth"] + other}


def _frozen_aware_tracker() -> _Tracker | None:
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

    class FrozenAwareMemTracker(_SegmentPeaks, MemTracker):
        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            def grad_hook(grad: torch.Tensor) -> None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            param_memory = buffer_memory = 0
            for param in _parameters(module):
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

        def _update_peak_stats(self, peak_state: object) -> None:
            # MemTracker walks every tracked module on every op to keep per-module peaks, which
            # nothing here reads: O(modules) per op made a 7B estimate take minutes (its time grew
            # with the square of the depth). Only the global peak is kept, as MemTracker keeps it,
            # and the peak of the part of the phase running now (keep_segments).
            total = 0
            for dev, snap in self._curr_mem_snap.items():
                total += snap[_TOTAL_KEY]
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
            if self._segment_peaks is not None and total > self._segment_best:
                self._note_segment(total)

    FrozenAwareMemTracker._total_key = _TOTAL_KEY

    return FrozenAwareMemTracker()


def _parameters(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s parameters, not a plain tensor standing in for one while it runs (the estimator's trace
    of an FSDP rank, planning/estimate/fsdp_dtypes.py; ``torch.func.functional_call``): made in the step,
    an activation."""
    return [p for p in module.parameters() if isinstance(p, nn.Parameter)]


class _SegmentPeaks:
    """The tracker's peak of each part of a phase (:mod:`.segments`), kept beside its global peak:
    mixed into the MemTracker subclass, whose ``_curr_mem_snap`` (device -> category -> bytes) it reads."""

    _curr_mem_snap: Snapshot
    _total_key: str = "Total"
    _segment: Segment = PRE
    _segment_best = -1  # the running segment's peak so far (bytes)
    _segment_peaks: dict[Segment, tuple[int, Snapshot]] | None = None

    def keep_segments(self) -> None:
        """From now on (a phase's start), keep each segment's peak apart, starting in ``PRE``."""
        self._segment_peaks = {}
        self.enter_segment(PRE)

    def enter_segment(self, segment: Segment) -> None:
        """The step moves on to ``segment``: the bytes alive now are its first reading."""
        self._segment = segment
        if self._segment_peaks is not None:
            best = self._segment_peaks.get(segment)
            self._segment_best = -1 if best is None else best[0]
            self._note_segment(sum(snap[self._total_key] for snap in self._curr_mem_snap.values()))

    def segment_peaks(self) -> list[tuple[Segment, Snapshot]]:
        """Each segment's peak snapshot (device -> category -> bytes), in the order they first ran."""
        return [(s, snap) for s, (_, snap) in (self._segment_peaks or {}).items()]

    def _note_segment(self, total: int) -> None:
        """``total`` bytes alive now: the running segment's peak if it is above the one kept."""
        assert self._segment_peaks is not None  # keep_segments ran
        if total > self._segment_best or self._segment not in self._segment_peaks:
            self._segment_best = total
            self._segment_peaks[self._segment] = (
                total,
                {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()},
            )


def _category(snapshot: Snapshot, name: str) -> int:
    """Bytes of one category (``act``, ``total``, ...) summed over devices."""
    return sum(int(v) for dev in snapshot.values() for k, v in dev.items() if str(k).lower().rsplit(".", 1)[-1] == name)
