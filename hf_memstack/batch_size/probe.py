"""One real, measured step of the batch-size finder.

A probe builds the batch, runs forward, backward and the optimizer step (the shared step of
``step.py``) under a :class:`~hf_memstack.measure.simulated.LiveBytes` tracker that records the live
tensor bytes after every operator, and agrees with the other ranks whether it fitted. A real
out-of-memory error (a GPU's, a CPU allocator's or :func:`~hf_memstack.simulated_memory_limit`'s)
is an outcome, not a failure; any other error ends every rank with it. The ranks agree after
building the batch and after the forward too: the next part of the step holds collectives (FSDP's,
DDP's) that a rank which failed alone would never reach, leaving its peers waiting.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar, cast

import numpy as np
import torch
from torch import nn

from .._device import device_of
from ..distributed._ranks import reraise, share_error
from ..distributed._stalls import watching
from ..measure.simulated import LiveBytes, current_limit, untracked
from ..measure.step import LossFn, backward, forward_loss, optimizer_step
from .ranks import agree, agree_no_error

__all__ = ["Measured", "ProbeKind", "StepRunner", "batch_signature", "check_batch_size", "seq_len_of"]

_T = TypeVar("_T")

ProbeKind = Literal["warmup", "probe", "predict", "refine", "search", "cache"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """One probe as the search sees it (this rank's bytes; ``fits`` agreed by every rank)."""

    batch_size: int
    """Samples in the probe's batch."""
    kind: ProbeKind
    """Why it ran: ``warmup`` (creates the optimizer state), ``probe`` (the two small sizes the
    fit starts from), ``predict`` (the fit's answer), ``refine`` / ``search`` (after a miss), ``cache``."""
    fits: bool
    """Ran to the end under the budget on every rank."""
    peak_bytes: int | None
    """This rank's peak, device-wide (what the step allocated plus what the device held besides
    the model and optimizer); None when the step ran out of memory part-way."""
    timeline: np.ndarray
    """Live bytes after each operator, on the same device-wide scale as ``peak_bytes`` (cut
    short at the refused allocation when the step ran out of memory)."""
    phase_ends: tuple[int, ...]
    """Operator counts at the end of the forward and of the backward (the rest is the optimizer step)."""
    allocator_ratio: float
    """CUDA: the allocator's peak over the tracked peak (rounding, other tensors); 1.0 elsewhere."""
    seconds: float
    """Wall time of the step."""

    @property
    def complete(self) -> bool:
        """Ran to the end (fitting or not): its timeline covers the whole step."""
        return self.peak_bytes is not None


class StepRunner:
    """Runs measured steps of one job (model, batches, optimizer, mode) and keeps them in order."""

    def __init__(
        self,
        *,
        model: nn.Module,
        make_batch: Callable[[int], object],
        optimizer: torch.optim.Optimizer | None,
        loss_fn: LossFn | None,
        grad_scaler: torch.amp.GradScaler | None,
        mode: Literal["train", "eval"],
        budget: int,
    ):
        self.model, self.make_batch, self.optimizer = model, make_batch, optimizer
        self.loss_fn, self.grad_scaler, self.mode, self.budget = loss_fn, grad_scaler, mode, budget
        self.device = device_of(model)
        self.steps: list[Measured] = []

    def run(self, n: int, kind: ProbeKind) -> Measured:
        """One real step at batch size ``n`` (every rank runs it; the outcome is agreed)."""
        tracker = LiveBytes(device_type=self.device.type, record=True)
        tracker.register(self._state_tensors())
        other = self._other_device_bytes(tracker.live)
        marks: list[int] = []
        error: BaseException | None = None
        oom = False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            # A peer that never reaches one of the step's collectives is named, and where.
            with tracker, watching(f"find_batch_size: the step at batch size {n}"):
                self._step(n, tracker, marks)
        except Exception as e:  # noqa: BLE001 - out of memory is an outcome; anything else is agreed, then re-raised
            if is_out_of_memory(e):
                oom = True
            else:
                error = e
        seconds = time.perf_counter() - start
        if oom:  # outside the except block: the traceback no longer holds the step's tensors
            self._recover()
        peak, ratio = self._peaks(tracker, other, complete=not oom and error is None)
        fits = agree_no_error(
            error, f"probe at batch size {n}", budget=self.budget, fits=peak is not None and peak <= self.budget
        )
        measured = Measured(
            batch_size=n,
            kind=kind,
            fits=fits,
            peak_bytes=peak,
            allocator_ratio=ratio,
            seconds=seconds,
            timeline=np.asarray(tracker.timeline, dtype=np.int64) + other,
            phase_ends=tuple(marks),
        )
        self.steps.append(measured)
        return measured

    def init_optimizer_state(self) -> bool:
        """Create the optimizer's state with one optimizer step on zero gradients (no forward or
        backward), so that every probe measures the steady state - the state alive during the
        forward and backward - and all probes run the same operators. False (on every rank) when
        this optimizer cannot step that way; the caller then spends a warm-up probe instead."""
        opt = self.optimizer
        if opt is None:
            return True
        missing = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and not opt.state.get(p)]
        ok = True
        if missing:
            try:
                for p in missing:
                    p.grad = torch.zeros_like(p)
                opt.step()
            except Exception:  # noqa: BLE001 - e.g. an optimizer that needs a closure: fall back to a warm-up step
                ok = False
            finally:
                opt.zero_grad(set_to_none=True)
                for p in missing:
                    p.grad = None
        return bool(agree("optimizer state", int(ok))[0])

    # -- internals ---------------------------------------------------------------------------
    def _step(self, n: int, tracker: LiveBytes, marks: list[int]) -> None:
        # The batch is built under the tracker: on a GPU it occupies device memory during the step.
        batch = _agreed(f"make_batch({n})", lambda: _checked(self.make_batch(n), n))
        if self.mode == "eval":
            with torch.no_grad():
                _call(self.model, batch)
            return
        loss = _agreed(f"the forward at batch size {n}", lambda: forward_loss(self.model, batch, self.loss_fn))
        timeline = cast("list[int]", tracker.timeline)  # a list: run() made the tracker with record=True
        marks.append(len(timeline))
        backward(loss, grad_scaler=self.grad_scaler)
        del loss
        marks.append(len(timeline))
        optimizer_step(self.optimizer, grad_scaler=self.grad_scaler)

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            tensors += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _other_device_bytes(self, tracked: int) -> int:
        """Bytes on the device besides the model and optimizer (other tensors, another model):
        the CUDA allocator's count, or an active simulated limit's; 0 when unknown."""
        if self.device.type == "cuda":
            return max(0, torch.cuda.memory_allocated(self.device) - tracked)
        limit = current_limit(self.device.type)
        return max(0, limit.live_bytes - tracked) if limit is not None else 0

    def _peaks(self, tracker: LiveBytes, other: int, *, complete: bool) -> tuple[int | None, float]:
        if not complete:
            return None, 1.0
        peak = tracker.peak + other
        if self.device.type != "cuda":
            return peak, 1.0
        allocator = torch.cuda.max_memory_allocated(self.device)
        return max(peak, allocator), max(1.0, allocator / max(peak, 1))

    def _recover(self) -> None:
        for p in self.model.parameters():
            p.grad = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _agreed(step: str, fn: Callable[[], _T]) -> _T:
    """``fn()``, then agreed with the other ranks before the next part of the step, whose
    collectives (FSDP's all-gathers in the forward, reduce-scatters in the backward, DDP's
    all-reduces) every rank must reach: an error on one rank is raised on every rank (naming it),
    and an out-of-memory error on one rank stops the step on every rank as out of memory."""
    error: BaseException | None = None
    result: _T | None = None
    try:
        with watching(step):
            result = fn()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks first
        error = e
    oom = error is not None and is_out_of_memory(error)
    with untracked():  # the agreement's few bytes are not part of the step
        (none_ran_out,) = share_error(step, None if oom else error, values=(int(not oom),))
    if error is not None:
        reraise(error)
    if not none_ran_out:
        raise torch.OutOfMemoryError(f"another rank ran out of memory in {step}; this rank stops the step with it")
    return cast(_T, result)  # fn() returned: an error in it was raised above


def _checked(batch: object, n: int) -> object:
    check_batch_size(batch, n)
    return batch


def is_out_of_memory(e: BaseException) -> bool:
    """A GPU's, a CPU allocator's or the simulated limit's out-of-memory error (Accelerate's test, plus the type)."""
    from accelerate.utils.memory import should_reduce_batch_size

    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, Exception) and should_reduce_batch_size(e))


def _call(model: nn.Module, batch: object) -> object:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _tensors(batch: object) -> list[torch.Tensor]:
    if torch.is_tensor(batch):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


# A dict batch's fields with one row per sample whatever else it holds: they count its samples. Its
# other tensors may be laid out otherwise (Qwen2-VL's pixel_values hold the patches of every image,
# [patches, values]; image_grid_thw one row per image): make_batch(n) builds n samples, nothing is sliced.
_SAMPLE_ROWS = ("input_ids", "inputs_embeds", "labels", "attention_mask")


def check_batch_size(batch: object, n: int) -> None:
    """``make_batch(n)`` must return a dict of tensors (or a tensor, or a tuple of tensors passed
    positionally) of ``n`` samples: the first dimension of its ``input_ids``, ``inputs_embeds``,
    ``labels`` and ``attention_mask`` is ``n`` (its other tensors' may be anything: patch-major
    pixels); a batch with none of them has ``n`` rows in every tensor.

    Raises:
        TypeError: another type (a list of dicts is a collator's input, not a batch).
        ValueError: no tensors, or tensors of another sample count (each named).
    """
    _check_batch_type(batch, n)
    named = _named_tensors(batch)
    if not named:
        raise ValueError(
            f"make_batch({n}) returned {type(batch).__name__} with no tensors; return a dict of tensors "
            "such as a collator does"
        )
    counted = (
        [(f"batch[{k!r}]", batch[k]) for k in _SAMPLE_ROWS if torch.is_tensor(batch.get(k))]
        if isinstance(batch, Mapping)
        else []
    )
    wrong = [(k, tuple(t.shape)) for k, t in (counted or named) if t.ndim == 0 or t.shape[0] != n]
    if wrong:
        raise ValueError(
            f"make_batch({n}) returned tensors of shapes {[s for _, s in wrong]} "
            f"({', '.join(f'{k} {s}' for k, s in wrong)}): their first dimension must be exactly {n}. "
            "Build the batch from n samples (and pad to the longest sequence of the run)"
            + (
                ""
                if counted or not isinstance(batch, Mapping)
                else ". Fields laid out otherwise (patch-major pixel_values) are fine beside input_ids, labels or "
                "attention_mask, which count the samples: the finder asks make_batch(n) for n samples and never "
                "slices a batch, so return those too"
            )
        )
    scalars = [k for k, t in named if t.ndim == 0]
    if scalars:
        raise ValueError(
            f"make_batch({n}) returned {', '.join(scalars)} as a 0-dimensional tensor: a batch holds one row per sample "
            "(or per patch or image); pass constants to the model another way (loss_fn=, the model's config)"
        )


def _check_batch_type(batch: object, n: int) -> None:
    positional = isinstance(batch, (list, tuple)) and all(torch.is_tensor(t) for t in batch)
    if not (isinstance(batch, Mapping) or torch.is_tensor(batch) or positional):
        inner = (
            sorted({type(v).__name__ for v in batch if not torch.is_tensor(v)})
            if isinstance(batch, (list, tuple))
            else []
        )
        what = f"{type(batch).__name__}" + (f" of {', '.join(inner)}" if inner else "")
        raise TypeError(
            f"make_batch({n}) returned a {what}; it must return a dict of tensors (a Mapping such as the "
            "BatchEncoding a collator returns), which the model is called with as model(**batch): e.g. "
            f"return collator(rows) rather than [collator(rows)]"
        )


def _named_tensors(batch: object, name: str = "batch") -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``batch`` with its place (``batch['pixel_values']``, ``batch[0]``)."""
    if torch.is_tensor(batch):
        return [(name, batch)]
    if isinstance(batch, Mapping):
        return [t for k, v in batch.items() for t in _named_tensors(v, f"{name}[{k!r}]")]
    if isinstance(batch, (list, tuple)):
        return [t for i, v in enumerate(batch) for t in _named_tensors(v, f"{name}[{i}]")]
    return []


def batch_signature(batch: object) -> list[list[str | int]]:
    """What identifies the batches of a job, from its batch of one: each tensor's dtype and shape
    past the batch dimension; the whole shape of a tensor not laid out one row per sample (a
    sample's patches: a larger image is another job)."""

    def shape(t: torch.Tensor) -> list[str | int]:
        return [*t.shape[1:]] if t.ndim and t.shape[0] == 1 else ["rows", *t.shape]

    if isinstance(batch, Mapping):
        return [[str(k), str(t.dtype), *shape(t)] for k, v in sorted(batch.items()) for t in _tensors(v)]
    return [[str(t.dtype), *shape(t)] for t in _tensors(batch)]


def seq_len_of(batch: object) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[1]) if torch.is_tensor(ids) and ids.ndim >= 2 else None
