"""One training step, written once and shared by the memory meter, verify, the batch-size
finder and the benchmarks, so that all of them measure the same thing a user's loop does."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["LossFn", "backward", "forward_loss", "forward_outputs", "optimizer_step", "train_step"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(outputs, batch) -> scalar loss``, for models that do not return ``outputs.loss``."""


def forward_loss(model: nn.Module, batch: object, loss_fn: LossFn | None = None) -> torch.Tensor:
    """Run the forward and return the scalar loss (the outputs are dropped: see :func:`forward_outputs`).

    A mapping batch is passed as keyword arguments (``model(**batch)``), a tuple/list as positional
    arguments, anything else as the single argument. Without ``loss_fn`` the model must return a
    ``loss`` (Transformers models do when the batch holds ``labels``).

    Raises:
        ValueError: no ``loss_fn`` and the outputs carry no loss.
    """
    return forward_outputs(model, batch, loss_fn)[0]


def forward_outputs(model: nn.Module, batch: object, loss_fn: LossFn | None = None) -> tuple[torch.Tensor, Any]:
    """Run the forward and return the scalar loss and the model's outputs, as :func:`forward_loss`
    runs it. A loop that keeps the outputs (``outputs = model(**batch); outputs.loss.backward()``)
    holds them - under a mixed precision, the logits in fp32 - through the backward and the
    optimizer step, until the next forward rebinds ``outputs``; one that keeps only the loss frees them here.

    Raises:
        ValueError: no ``loss_fn`` and the outputs carry no loss.
    """
    if isinstance(batch, Mapping):
        outputs = model(**batch)
    elif isinstance(batch, (tuple, list)):
        outputs = model(*batch)
    else:
        outputs = model(batch)
    if loss_fn is not None:
        return loss_fn(outputs, batch), outputs
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            f"{type(model).__name__} returned no loss for this batch: put `labels` in the batch for a "
            "Transformers model, or pass loss_fn=lambda outputs, batch: ... that returns a scalar"
        )
    return loss, outputs


def train_step(
    model: nn.Module,
    batch: object,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    loss_fn: LossFn | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    keep_outputs: bool = False,
) -> float:
    """Forward, backward and (when ``optimizer`` is given) an optimizer step; returns the loss.

    With a ``grad_scaler`` (fp16) the loss is scaled, and the step skips on inf/nan gradients.
    Gradients are freed with ``zero_grad(set_to_none=True)`` after the step, as a training loop does.
    The model's outputs are freed once the loss is taken from them (as Trainer and the recipe do),
    or, with ``keep_outputs``, held through the backward and the optimizer step (as
    ``outputs = model(**batch); outputs.loss.backward()`` holds them).
    """
    loss, outputs = forward_outputs(model, batch, loss_fn)
    if not keep_outputs:
        del outputs  # the logits (fp32 under a mixed precision) are freed before the backward
    backward(loss, grad_scaler=grad_scaler)
    optimizer_step(optimizer, grad_scaler=grad_scaler)
    if isinstance(loss, FakeTensor):  # traced by the estimator: shapes only, no value
        return float("nan")
    return float(loss.detach())


def backward(loss: torch.Tensor, *, grad_scaler: torch.amp.GradScaler | None = None) -> None:
    """Backward from ``loss`` (scaled first for fp16)."""
    if grad_scaler is not None:
        grad_scaler.scale(loss).backward()
    else:
        loss.backward()


def optimizer_step(optimizer: torch.optim.Optimizer | None, *, grad_scaler: torch.amp.GradScaler | None = None) -> None:
    """The last part of :func:`train_step`: step (through the scaler for fp16) and free the gradients."""
    if optimizer is None:
        return
    if grad_scaler is not None:
        grad_scaler.step(optimizer)
        grad_scaler.update()
    else:
        optimizer.step()
    # Free the gradients as soon as they are used: this memory is not needed until the next backward.
    optimizer.zero_grad(set_to_none=True)
