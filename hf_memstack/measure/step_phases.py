"""One training step split in its phases (forward, backward, optimizer step) for the tracker, in
either loop: one that drops the model's outputs once the loss is taken (Trainer, the recipe), or one
that keeps ``outputs`` through the backward (``outputs = model(**batch); outputs.loss.backward()``,
Transformers' docs): under a mixed precision those outputs hold the logits in fp32 (the prepared
forward returns fp32 outputs, as Accelerate's ``convert_to_fp32`` does), one ``[batch, seq, vocab]``
fp32 tensor alive through the backward and the optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from ..data.guard import settle_packing_guard
from ..distributed._stalls import watching
from .step import backward, forward_outputs, optimizer_step
from .tracker import PhasePeaks, trace_phases

__all__ = ["Loop", "StepPhases", "loop_name", "step_phases", "trace_training_step"]

Loop = Literal["outputs dropped", "outputs kept"]
"""Which training loop a step stands for: the model's outputs freed once the loss is taken from
them, or kept (with their logits) through the backward and the optimizer step."""


def loop_name(keep_outputs: bool) -> Loop:
    return "outputs kept" if keep_outputs else "outputs dropped"


@dataclass(frozen=True, slots=True)
class StepPhases:
    """The phases to run in order, and what the loop holds from this step to the next (the outputs
    of a loop that keeps them; ``None`` for one that drops them)."""

    phases: list[Callable[[], object]]
    kept: Callable[[], object] | None


def step_phases(
    forward: Callable[[], tuple[torch.Tensor, object]],
    optimizer: torch.optim.Optimizer | None,
    grad_scaler: torch.amp.GradScaler | None = None,
    *,
    shared: bool = False,
    keep_outputs: bool = False,
) -> StepPhases:
    """A training step split in its phases (forward, backward, optimizer step), so the tracker can
    read what the forward left for the backward, and the forward+backward peak before the step.
    ``forward`` returns the loss and the outputs; with ``keep_outputs`` the outputs are held to the
    end of the step (and after it, as the loop's ``outputs`` variable holds them), else dropped."""
    held: dict[str, object] = {}  # the loss (a tensor) and the outputs

    def forward_phase() -> None:
        loss, outputs = forward()
        held.update(loss=loss, outputs=outputs if keep_outputs else None)

    def backward_phase() -> None:
        with watching("measure_step: the backward", shared=shared):
            backward(cast(torch.Tensor, held.pop("loss")), grad_scaler=grad_scaler)

    def optimizer_phase() -> None:
        with watching("measure_step: the optimizer step", shared=shared):
            optimizer_step(optimizer, grad_scaler=grad_scaler)

    kept = (lambda: held.get("outputs")) if keep_outputs else None
    return StepPhases([forward_phase, backward_phase, optimizer_phase], kept)


@torch.no_grad()
def create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The warm-up of a traced step: one optimizer step on zero gradients, so the optimizer's state
    exists as after any real step (a whole forward and backward first would cost as much again).
    An optimizer stepping in the backward holds one optimizer per parameter (``optimizers``)."""
    inner = getattr(optimizer, "optimizers", None)
    for opt in inner.values() if isinstance(inner, dict) else (optimizer,):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


def trace_training_step(
    model: nn.Module,
    batch: object,
    optimizer: torch.optim.Optimizer,
    *,
    blocks: Sequence[nn.Module] = (),
    keep_outputs: bool = False,
) -> PhasePeaks:
    """The optimizer's state created, then each phase's peak of one step (forward, backward, optimizer step):
    what :func:`hf_memstack.measure_step` reads, phase by phase, for the estimator on fake tensors. With the
    model's ``blocks``, each phase's peak in each of its parts too (:mod:`.segments`). ``keep_outputs``:
    the loop keeps the model's outputs (through this step, and the previous step's through its forward).

    Raises:
        RuntimeError: this PyTorch has no MemTracker.
    """
    # No gc.collect() here (measure_step's is slow with Transformers loaded: it walks every object): stepping on zero
    # gradients leaves no reference cycles holding tensors.
    create_optimizer_state(optimizer)
    settle_packing_guard(model, batch)  # its one-time probe runs outside the traced step
    step = step_phases(lambda: forward_outputs(model, batch), optimizer, keep_outputs=keep_outputs)
    traced = trace_phases(model, optimizer, step.phases, blocks=blocks, kept=step.kept)
    if traced is None:
        raise RuntimeError(
            "this PyTorch has no torch.distributed._tools.mem_tracker.MemTracker, which the estimator traces with"
        )
    return traced
