"""What find_batch_size checks before any step, agreed across ranks: the arguments, the budget
(given, or read from the device), a model with something to train that the budget can hold, one
sample from ``make_batch``; and the errors that name the next rung of the ladder to try."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from .._device import device_of
from ..errors import BudgetTooSmallError
from ..measure.accounting import model_state_bytes
from ..measure.batch_checks import check_batch
from ..measure.simulated import current_limit, untracked
from ..planning.plan.next_rung import next_rung
from ..record import MemstackRecord, record_of
from ..sizes import format_bytes, parse_bytes
from ..transforms.quant.apply import quantizable
from .probe import Measured, check_batch_size
from .ranks import agree_no_error

__all__ = ["budget_too_small", "preflight"]


def preflight(
    model: nn.Module,
    make_batch: Callable[[int], object],
    optimizer: torch.optim.Optimizer | None,
    *,
    budget: int | str | None,
    mode: Literal["train", "eval"],
    global_batch_size: int | None,
    max_batch_size: int,
    probe_size: int,
) -> tuple[int, object]:
    """Every check before any step, agreed across ranks (a rank that fails - a wrong argument, a
    budget that does not parse or cannot hold the weights, a ``make_batch`` that fails - makes
    every rank raise). Returns the budget in bytes and a batch of one sample."""
    error: BaseException | None = None
    budget_bytes, sample = 0, None
    try:
        _check_arguments(
            model,
            make_batch,
            optimizer,
            mode=mode,
            global_batch_size=global_batch_size,
            max_batch_size=max_batch_size,
            probe_size=probe_size,
        )
        budget_bytes = _resolve_budget(budget, device_of(model))
        sample = _check_model_and_sample(model, make_batch, mode=mode, budget=budget_bytes, record=record_of(model))
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks first, then raised on every rank
        error = e
    agree_no_error(error, "pre-flight checks", budget=budget_bytes)
    return budget_bytes, sample


def _check_model_and_sample(
    model: nn.Module, make_batch: Callable[[int], object], *, mode: str, budget: int, record: MemstackRecord | None
) -> object:
    if mode == "train" and not any(p.requires_grad for p in model.parameters()):
        n = sum(1 for _ in model.parameters())
        raise ValueError(
            f"mode='train' but every one of the model's {n} parameters is frozen (requires_grad=False): "
            "a training step would change nothing. Unfreeze what should train (e.g. PEFT's "
            "get_peft_model adds trainable adapters), or size evaluation with mode='eval'"
        )
    params = model_state_bytes(model).parameters  # this rank's local shards under FSDP
    if params >= budget:
        raise BudgetTooSmallError(
            f"budget={format_bytes(budget)} is smaller than the model's parameters alone ({format_bytes(params)}); "
            f"training needs about {format_bytes(4 * params)} before activations (parameters, gradients, AdamW "
            f"state). {_next_rung(record, weights_dominate=True)}",
            budget_bytes=budget,
            needed_bytes=4 * params,
        )
    with untracked():  # a look at the batch's shapes, not part of any step
        sample = make_batch(1)
        check_batch_size(sample, 1)
        check_batch(model, sample, where="find_batch_size: make_batch(1)")
    return sample


def _check_arguments(
    model: object,
    make_batch: object,
    optimizer: object,
    *,
    mode: object,
    global_batch_size: object,
    max_batch_size: object,
    probe_size: object,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__} must be a torch.nn.Module")
    if not callable(make_batch):
        raise TypeError(f"make_batch={make_batch!r} must be callable: make_batch(n) returns a batch of n samples")
    if mode not in ("train", "eval"):
        raise ValueError(f"mode={mode!r} is not one of 'train', 'eval'")
    for name, value in (("max_batch_size", max_batch_size), ("probe_size", probe_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if global_batch_size is not None and (
        not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0
    ):
        raise ValueError(
            f"global_batch_size={global_batch_size!r} must be a positive integer (samples per optimizer step)"
        )
    if mode == "train" and optimizer is None:
        raise ValueError(
            "mode='train' needs the optimizer (its state is part of the step's memory); pass optimizer=..."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer")


def _resolve_budget(budget: int | str | None, device: torch.device) -> int:
    if budget is not None:
        return parse_bytes(budget, field="budget")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    limit = current_limit(device.type)
    if limit is not None:
        return limit.budget
    raise ValueError(
        f"budget is required on {device.type}: there is no out-of-memory error to catch there (the operating system "
        "kills the process), so the measured peak is compared with a budget; pass budget='8GiB' (or bytes), or run "
        "inside hf_memstack.simulated_memory_limit(...)"
    )


def budget_too_small(m: Measured, *, mode: str, budget: int, record: MemstackRecord | None) -> BudgetTooSmallError:
    need = format_bytes(m.peak_bytes) if m.peak_bytes else "more than the budget (out of memory)"
    return BudgetTooSmallError(
        f"budget={format_bytes(budget)} cannot hold one {mode} step at batch size {m.batch_size}: "
        f"it needs {need}. {_next_rung(record, weights_dominate=False)}",
        budget_bytes=budget,
        needed_bytes=m.peak_bytes,
    )


def _next_rung(record: MemstackRecord | None, *, weights_dominate: bool) -> str:

    if record is None:
        return "Prepare the model with a memory policy first, e.g. prepare_model(model, 'bf16+ckpt')."
    return next_rung(
        record.policy,
        num_blocks=len(record.blocks or ()),
        weights_dominate=weights_dominate,
        causal_lm=record.chunkable_loss,
        quantize=quantizable(record.blocks),
    )
