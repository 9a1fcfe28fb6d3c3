"""The memory meter: run one real training step and report its peak bytes split into parameters,
gradients, optimizer state, activations and temporaries, plus the step time.

On every device the split comes from PyTorch's ``MemTracker`` (a dispatch-mode tracker of live
tensor storage; private API, so it is used in :func:`_track` only, with a fallback). On CUDA the
peak is the caching allocator's own ``max_memory_allocated``.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._device import device_of, synchronize
from ..data.guard import settle_packing_guard
from ..distributed._ranks import on_every_rank, runs_collectives, same_arguments_on_every_rank
from ..distributed._stalls import watching
from ..sizes import format_bytes
from .accounting import model_state_bytes, tensor_bytes
from .batch_checks import check_batch
from .step import LossFn, backward, forward_outputs, optimizer_step
from .step_phases import Loop, StepPhases, loop_name, step_phases, trace_training_step
from .tracker import PhasePeaks, trace_phases

__all__ = ["StepMemory", "measure_eval_forward", "measure_step", "trace_training_step"]

PeakPhase = Literal["forward+backward", "optimizer"]
StepFn = Callable[[nn.Module, Any, torch.optim.Optimizer | None], object]
"""``step_fn(model, batch, optimizer)``: a caller's own step (its batch as the caller built it; what it returns is unused)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMemory:
    """One training step's peak memory, by category (bytes), and its time."""

    peak_bytes: int
    """The step's peak: live tensor bytes on CPU, the allocator's peak on CUDA."""
    parameters: int
    """Parameters and buffers at the peak (frozen ones included)."""
    gradients: int
    """Gradients at the peak (trainable parameters only)."""
    optimizer: int
    """Optimizer state at the peak."""
    activations: int
    """Tensors saved for backward (and the batch) at the peak."""
    temporaries: int
    """Short-lived tensors at the peak (e.g. the logits' gradient, fused-kernel buffers)."""
    other: int
    """Tensors the tracker could not attribute."""
    step_seconds: float | None
    """Wall time of an untracked step (None when not timed)."""
    device: str
    """Where the step ran (``cpu``, ``cuda:0``)."""
    method: str
    """``memtracker`` (+``cuda-allocator`` peak) or ``fallback``."""
    forward_backward_peak: int = 0
    """Peak of the forward + backward alone: grows linearly with the batch size."""
    saved_activations: int = 0
    """Activation bytes alive at the end of the forward - what the backward needs, and what
    checkpointing shrinks (0 when a custom ``step_fn`` hides the phases)."""
    peak_phase: PeakPhase = "forward+backward"
    """Where the step peaked: ``forward+backward`` or ``optimizer`` (the step's fixed cost)."""
    loop: Loop | Literal["step_fn"] = "outputs dropped"
    """Which loop was measured: ``outputs dropped`` (the outputs freed once the loss is taken, as
    Trainer and the recipe do), ``outputs kept`` (``outputs = model(**batch); outputs.loss.backward()``:
    the outputs, fp32 logits under a mixed precision, alive through the backward, the optimizer step
    and the next forward), or ``step_fn`` (the caller's own)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [
            f"{k}={format_bytes(getattr(self, k))}"
            for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")
        ]
        time_s = f", step {self.step_seconds:.3f}s" if self.step_seconds is not None else ""
        return f"peak {format_bytes(self.peak_bytes)} ({', '.join(parts)}){time_s} [{self.method}, {self.loop}]"


def measure_step(
    model: nn.Module,
    batch: object,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: LossFn | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    warmup: bool | None = None,
    timed: bool = True,
    step_fn: StepFn | None = None,
    keep_outputs: bool = False,
) -> StepMemory:
    """Run a real training step (it updates the model, like any step) and measure its memory.

    Args:
        model: a prepared (or plain) model on its device; frozen parameters (LoRA, frozen
            embeddings) count as parameters, with no gradient and no optimizer state.
        batch: what the model takes (a dict of tensors for Transformers models, with ``labels``).
        optimizer: stepped after backward; ``None`` measures forward + backward only.
        loss_fn: for models that do not return ``outputs.loss``.
        grad_scaler: fp16's scaler (``model.memstack.grad_scaler``).
        warmup: run one step first so the optimizer state exists and the measured step is a
            steady-state one. ``None``: only when the optimizer has no state yet.
        timed: also time one untracked step (the tracker slows the tracked one down).
        step_fn: ``step_fn(model, batch, optimizer)`` replaces :func:`train_step` (e.g. to measure
            a hand-written loop the same way); ``loss_fn`` and ``grad_scaler`` are then unused.
        keep_outputs: measure a loop that keeps the model's outputs through the backward
            (``outputs = model(**batch); outputs.loss.backward()``, Transformers' docs): under a mixed
            precision they hold the logits in fp32, alive through the backward and the optimizer
            step, and the previous step's through this step's forward until ``outputs`` is rebound.
            Default: the loop that drops them once the loss is taken (Trainer, the recipe).
            ``StepMemory.loop`` says which was measured.

    Returns:
        :class:`StepMemory`; on CPU the same step twice gives the same bytes.

    Without ``step_fn``, a batch the model cannot run (labels or an attention mask of another shape
    than ``input_ids``, ids outside the vocabulary, an empty tensor) is refused before any step with
    a ValueError naming the field (:func:`hf_memstack.measure.batch_checks.check_batch`).

    Under FSDP or DDP every rank must call it (the step holds collectives): an error on one rank
    in the forward (a batch without labels) or in ``step_fn`` is then raised on every rank, naming
    that rank and its message, instead of leaving the others waiting in the backward's collectives.
    """
    if keep_outputs and step_fn is not None:
        raise ValueError(
            "measure_step: keep_outputs=True with a step_fn: the step_fn is the loop measured, and it decides what "
            "it keeps; keep the outputs in it, or drop step_fn to measure the default step keeping them"
        )
    shared = runs_collectives(model)
    if shared:
        # A rank given no optimizer (or no warm-up) would run fewer collectives than its peers.
        same_arguments_on_every_rank(
            "measure_step",
            optimizer=optimizer is not None,
            step_fn=step_fn is not None,
            warmup=warmup if warmup is None else bool(warmup),
            timed=bool(timed),
        )
    if step_fn is None:  # the batch goes to model(**batch): a bad one is named here, not deep in the model
        on_every_rank("measure_step: the batch", lambda: check_batch(model, batch, where="measure_step"), shared=shared)
    if step_fn is None and not model.training:
        warnings.warn(
            f"measure_step: {type(model).__name__} is in eval mode, so this is not the training step it looks like "
            "(checkpointing and dropout are off); call model.train() first (from_pretrained returns models in eval mode)",
            stacklevel=2,
        )
    phases: StepPhases | None = None
    if step_fn is None:
        step_fn, phases = _train_step(model, batch, optimizer, loss_fn, grad_scaler, shared=shared, keep=keep_outputs)
    elif shared:
        step_fn = _on_every_rank(step_fn)
    if warmup is None:
        warmup = optimizer is not None and not optimizer.state
    if warmup:
        step_fn(model, batch, optimizer)
    memory = _measured(model, batch, optimizer, step_fn, phases, timed=timed)
    return dataclasses.replace(memory, loop=loop_name(keep_outputs) if phases is not None else "step_fn")


def _train_step(
    model: nn.Module,
    batch: object,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: LossFn | None,
    grad_scaler: torch.amp.GradScaler | None,
    *,
    shared: bool,
    keep: bool = False,
) -> tuple[StepFn, StepPhases]:
    """The default step (forward, backward, optimizer step) whole, and split in its phases; ``keep``:
    the outputs held to the step's end (the untimed, untracked warm-up and timed steps too)."""

    def forward() -> tuple[torch.Tensor, object]:
        # Agreed before the backward, whose collectives a rank that failed here would never reach.
        return on_every_rank("measure_step: the forward", lambda: forward_outputs(model, batch, loss_fn), shared=shared)

    def step_fn(m: nn.Module, b: object, o: torch.optim.Optimizer | None) -> None:
        loss, outputs = forward()
        if not keep:
            del outputs
        with watching("measure_step: the backward and the optimizer step", shared=shared):
            backward(loss, grad_scaler=grad_scaler)
            optimizer_step(o, grad_scaler=grad_scaler)

    return step_fn, step_phases(forward, optimizer, grad_scaler, shared=shared, keep_outputs=keep)


def _on_every_rank(users_step: StepFn) -> StepFn:
    """The user's step_fn, its error raised on every rank."""

    def step_fn(m: nn.Module, b: object, o: torch.optim.Optimizer | None) -> object:
        return on_every_rank("measure_step: step_fn", lambda: users_step(m, b, o))

    return step_fn


def _measured(
    model: nn.Module,
    batch: object,
    optimizer: torch.optim.Optimizer | None,
    step_fn: StepFn,
    phases: StepPhases | None,
    *,
    timed: bool,
) -> StepMemory:
    """Time one untracked step, then track one (from a collected heap and, on CUDA, a reset allocator peak)."""
    device = device_of(model)
    seconds = _time_step(model, batch, optimizer, step_fn, device) if timed else None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    settle_packing_guard(model, batch)  # its one-time probe runs outside the measured step
    tracked = _track(model, optimizer, phases or StepPhases([lambda: step_fn(model, batch, optimizer)], None))
    peak, method = tracked.peak_bytes, tracked.method
    if device.type == "cuda":
        synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device))
        method += "+cuda-allocator"
    return dataclasses.replace(
        tracked,
        peak_bytes=peak,
        step_seconds=seconds,
        device=str(device),
        method=method,
        peak_phase="optimizer" if phases and peak > tracked.forward_backward_peak else "forward+backward",
    )


def _time_step(
    model: nn.Module,
    batch: object,
    optimizer: torch.optim.Optimizer | None,
    step_fn: StepFn,
    device: torch.device,
) -> float:
    synchronize(device)
    start = time.perf_counter()
    step_fn(model, batch, optimizer)
    synchronize(device)
    return time.perf_counter() - start


def _track(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: StepPhases) -> StepMemory:
    """Run the step's phases under PyTorch's MemTracker; a single phase is the whole step. The
    activations alive after the first phase (the forward) are the saved activations; the peak by
    the end of the second (the backward) is the forward+backward peak. Kept outputs: see :func:`trace_phases`."""
    traced = trace_phases(model, optimizer, step.phases, kept=step.kept)
    if traced is None:  # private API: it may move; fall back to counting what outlives the step
        return _fallback(model, optimizer, step.phases)
    memory = step_memory_of(traced)
    device = device_of(model)
    if device.type == "cuda":
        synchronize(device)
        backward_peak = max(memory.forward_backward_peak, torch.cuda.max_memory_allocated(device))
        memory = dataclasses.replace(memory, forward_backward_peak=backward_peak)
    return memory


def step_memory_of(traced: PhasePeaks) -> StepMemory:
    """The step's memory from its phases' peaks: the highest phase's categories; the forward+backward
    peak is the highest of all phases but the optimizer's (the last of three)."""
    peaks = traced.peaks
    cat = max(peaks, key=lambda c: c["total"])  # the first phase to reach the step's peak, as one tracker reads it
    backward = peaks[:2] if len(peaks) > 1 else peaks
    backward_peak = max(c["total"] for c in backward)
    return StepMemory(
        peak_bytes=cat["total"],
        parameters=cat["param"] + cat["buffer"],
        gradients=cat["grad"],
        optimizer=cat["opt"],
        activations=cat["act"],
        temporaries=cat["temp"],
        other=cat["oth"],
        saved_activations=traced.forward_activations,
        forward_backward_peak=backward_peak,
        step_seconds=None,
        device="",
        method="memtracker",
        peak_phase="optimizer" if len(peaks) > 2 and cat["total"] > backward_peak else "forward+backward",
    )


def trace_eval_forward(
    model: nn.Module, batch: object, *, blocks: Sequence[nn.Module] = ()
) -> tuple[PhasePeaks, object]:
    """One evaluation forward as ``Trainer.prediction_step`` runs it - ``model(**batch)`` under
    ``torch.no_grad()``, the model as it is (eval mode is the caller's) - traced as a single phase;
    returns its peaks and the model's outputs (what Trainer keeps from them: :mod:`hf_memstack.planning.estimate.eval_logits`).

    Raises:
        RuntimeError: this PyTorch has no MemTracker.
    """
    held: dict[str, object] = {}

    def forward() -> None:
        with torch.no_grad():
            held["outputs"] = model(**batch) if isinstance(batch, dict) else model(batch)

    settle_packing_guard(model, batch)  # its one-time probe runs outside the traced forward
    traced = trace_phases(model, None, [forward], blocks=blocks)
    if traced is None:
        raise RuntimeError(
            "this PyTorch has no torch.distributed._tools.mem_tracker.MemTracker, which the meter traces with"
        )
    return traced, held["outputs"]


def measure_eval_forward(model: nn.Module, batch: object) -> StepMemory:
    """Measure one evaluation forward (``model.eval()`` is the caller's; ``torch.no_grad()`` is applied
    here, as ``Trainer.prediction_step`` applies it): its peak by category, no gradients, no optimizer.
    ``peak_phase`` is ``forward+backward`` (the one phase; nothing runs backward) and
    ``forward_backward_peak`` equals ``peak_bytes``. On CUDA the peak is the allocator's."""
    device = device_of(model)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    traced, _ = trace_eval_forward(model, batch)
    memory = step_memory_of(traced)
    peak, method = memory.peak_bytes, memory.method
    if device.type == "cuda":
        synchronize(device)
        peak, method = max(peak, torch.cuda.max_memory_allocated(device)), method + "+cuda-allocator"
    return dataclasses.replace(memory, peak_bytes=peak, forward_backward_peak=peak, device=str(device), method=method)


def _fallback(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, phases: list[Callable[[], object]]
) -> StepMemory:
    """Without MemTracker: model states from their storages, activations from saved-for-backward bytes."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor_bytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for phase in phases:
            phase()
    states = model_state_bytes(model, optimizer)
    grads = states.trainable_parameters  # every trainable parameter gets a gradient of its size
    total = states.parameters + grads + states.optimizer + saved
    return StepMemory(
        peak_bytes=total,
        parameters=states.parameters,
        gradients=grads,
        optimizer=states.optimizer,
        activations=saved,
        temporaries=0,
        other=0,
        saved_activations=saved,
        forward_backward_peak=total,
        step_seconds=None,
        device="",
        method="fallback",
    )
