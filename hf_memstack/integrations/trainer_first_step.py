"""The callback's extra pass on the first training batch: ``verify`` and the memory meter on one
forward + backward, on a batch built the way Trainer's loader builds it.

Kept apart from the callback because it is the part that touches the model: it must leave the
weights, the gradients and the RNG as they were, and measure the step that will train.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Sized
from dataclasses import dataclass

import torch
from torch import nn

from .._device import device_of, preserved_rng, synchronize
from ..data.guard import settle_packing_guard
from ..measure.memory import StepMemory, measure_step
from ..measure.tracker import _category, _frozen_aware_tracker
from ..measure.verify import VerifyReport, verify
from ..transforms.optim.in_backward import optimizer_in_backward_of

logger = logging.getLogger("hf_memstack")


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstStepReport:
    """What the callback saw before the first optimizer step."""

    verify: VerifyReport | None
    """``hf_memstack.measure.verify`` on the first batch (None when verification is off or no batch could be built)."""
    memory: StepMemory | None
    """The meter on the same forward + backward (None when measuring is off)."""
    seconds: float | None = None
    """Wall time of that extra forward + backward (verify and the meter together)."""
    skipped: str | None = None
    """Why the pass did not run (a trainer that generates its batches, an error in the pass), or None."""


def _verify_and_measure(
    model: nn.Module, batch: object, *, run_verify: bool, measure: bool
) -> tuple[VerifyReport | None, StepMemory | None]:
    """``verify`` on ``batch`` with the memory meter's tracker (PyTorch's MemTracker) around it:
    one forward + backward gives both. verify's later passes (the chunked-loss check's forwards
    without gradients, the compile check's compiled step) call the model again, which MemTracker
    takes for a new iteration: its per-module figures restart there, and the figures reported
    are those at the end of the observed training step (under compile, the eager step verify
    observes). Without verify, the meter runs its own forward + backward."""
    if not measure:
        return verify(model, batch), None
    if not run_verify:
        return None, _measure_forward_backward(model, batch)

    settle_packing_guard(model, batch)  # the packed-batch guard's one-time probe runs outside the tracked step

    tracker = _frozen_aware_tracker()
    if tracker is None:  # private API: it may move; verify alone, the meter on its own step
        return verify(model, batch), _measure_forward_backward(model, batch)
    at_step_end: dict[str, dict[torch.device, dict[str, int]]] = {}

    def new_iteration(module: nn.Module, args: tuple[object, ...]) -> None:
        # A global hook registered before MemTracker's runs first: restart its module figures
        # before it would refuse a second call of the model it tracks.
        if module is model and module in tracker.memory_tracking:
            at_step_end.setdefault("peak", tracker.get_tracker_snapshot("peak"))
            tracker.reset_mod_stats()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(new_iteration)
    try:
        tracker.track_external(model)
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            report = verify(model, batch)
    finally:
        handle.remove()
    peak = at_step_end.get("peak") or tracker.get_tracker_snapshot("peak")
    return report, _step_memory(peak, device_of(model))


def _step_memory(peak: dict[torch.device, dict[str, int]], device: torch.device) -> StepMemory:

    cat = {name: _category(peak, name) for name in ("total", "param", "buffer", "grad", "opt", "act", "temp", "oth")}
    total, method = cat["total"], "memtracker"
    if device.type == "cuda":
        synchronize(device)
        total, method = max(total, torch.cuda.max_memory_allocated(device)), "memtracker+cuda-allocator"
    return StepMemory(
        peak_bytes=total,
        parameters=cat["param"] + cat["buffer"],
        gradients=cat["grad"],
        optimizer=cat["opt"],
        activations=cat["act"],
        temporaries=cat["temp"],
        other=cat["oth"],
        step_seconds=None,
        device=str(device),
        method=method,
    )


def _measure_forward_backward(model: nn.Module, batch: object) -> StepMemory:
    """The meter on one forward + backward; the gradients it leaves are removed again."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    stepping = optimizer_in_backward_of(model)  # it would update the weights in this backward: pause it
    with preserved_rng(device_of(model)), stepping.paused() if stepping is not None else contextlib.nullcontext():
        memory = measure_step(model, batch, None, timed=False)
    for p, g in zip(params, grads):
        p.grad = g
    return memory


def _first_batch(dataloader: object, model: nn.Module | None) -> object:
    """The first training batch, built from the dataset and collator directly (iterating the
    Trainer's dataloader would consume its sampler's randomness and Accelerate's state)."""
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    if (
        model is None
        or collate is None
        or not isinstance(dataset, Sized)
        or not hasattr(dataset, "__getitem__")
        or len(dataset) == 0
    ):
        logger.info("hf_memstack: no indexable training dataset; skipping verify and the memory meter")
        return None
    size = (
        getattr(dataloader, "batch_size", None)
        or getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
        or 1
    )
    device = device_of(model)
    collate = getattr(collate, "whole", collate)  # sp:N: the group's whole rows (verify shards them itself)
    with preserved_rng(device):  # a collator may draw random numbers (masking)
        batch = collate([dataset[i] for i in range(min(size, len(dataset)))])
    return (
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()} if isinstance(batch, dict) else batch
    )
