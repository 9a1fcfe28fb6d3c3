"""A drop-in for Accelerate's ``find_executable_batch_size`` that predicts first.

Same calling convention - the decorated function gets ``batch_size`` first, and is called again
with a smaller one after an out-of-memory error - so existing code changes one import::

    from hf_memstack import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=128, make_batch=make_batch)
    def train(batch_size, model, optimizer):
        ...

    train(model, optimizer)

Before the first call, :func:`~hf_memstack.find_batch_size` predicts the largest size that fits
(a few measured steps, cached), capped at ``starting_batch_size``; the function then starts
there. Only if it still runs out of memory (a longer batch than ``make_batch`` builds, an
evaluation loop, another model on the device) does the decorator fall back to Accelerate's retries
(``int(batch_size * 0.9)`` or ``reduce_batch_size_fn``) - with the device cache emptied outside
the ``except`` block, so the failed attempt's tensors are really gone (pytorch#18853).
"""

from __future__ import annotations

import functools
import gc
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ._finder_probe import is_out_of_memory
from .batch_size import find_batch_size

__all__ = ["find_executable_batch_size"]


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    make_batch: Callable[[int], Any] | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    budget: int | str | None = None,
    mode: Literal["train", "eval"] = "train",
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> Any:
    """Decorate ``function(batch_size, *args, **kwargs)``: predict the batch size, then retry on OOM.

    Args:
        function: the function to wrap (or None, to use the decorator with arguments).
        starting_batch_size: the largest size to use (Accelerate's first attempt).
        reduce_batch_size_fn: Accelerate's hook: called with no arguments after an out-of-memory
            error, returns the next size. Default: ``int(batch_size * 0.9)``.
        make_batch: ``make_batch(n)`` returns a batch of ``n`` samples at the longest sequence
            length the function will see; without it there is no prediction (a warning says so).
        model, optimizer: what the finder measures; default: the first ``nn.Module`` and the
            first optimizer among the call's arguments.
        budget, mode, cache, cache_dir: as in :func:`~hf_memstack.find_batch_size` (on CPU
            inside :func:`~hf_memstack.simulated_memory_limit` the budget is the limit's).

    The wrapper's ``batch_size_result`` attribute holds the finder's result after the first call.

    Raises:
        TypeError: ``batch_size`` passed by the caller (Accelerate's check) or a bad argument.
        RuntimeError: ``No executable batch size found, reached zero.`` (Accelerate's message).
        BudgetTooSmallError: the finder found that not even batch size 1 fits.
    """
    options = {"make_batch": make_batch, "model": model, "optimizer": optimizer, "budget": budget, "mode": mode,
               "cache": cache, "cache_dir": cache_dir}
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn, **options)
    if not isinstance(starting_batch_size, int) or isinstance(starting_batch_size, bool) or starting_batch_size <= 0:
        raise ValueError(f"starting_batch_size={starting_batch_size!r} must be a positive integer")
    for name, value in (("function", function), ("reduce_batch_size_fn", reduce_batch_size_fn), ("make_batch", make_batch)):
        if value is not None and not callable(value):
            raise TypeError(f"{name}={value!r} must be callable")
    state = {"batch_size": starting_batch_size, "predicted": False}

    def reduce() -> int:
        state["batch_size"] = reduce_batch_size_fn() if reduce_batch_size_fn else int(state["batch_size"] * 0.9)
        return state["batch_size"]

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_call(function, args)
        if not state["predicted"]:
            state["predicted"] = True
            result = _predict(args, kwargs, cap=starting_batch_size, **options)
            wrapper.batch_size_result = result  # type: ignore[attr-defined]
            if result is not None:
                state["batch_size"] = result.batch_size
        while True:
            if state["batch_size"] == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(state["batch_size"], *args, **kwargs)
            except Exception as e:  # only out-of-memory errors are retried
                if not is_out_of_memory(e):
                    raise
            _free_device_memory()
            reduce()

    wrapper.batch_size_result = None  # type: ignore[attr-defined]
    return wrapper


def _predict(args: tuple, kwargs: dict[str, Any], *, cap: int, make_batch: Any, model: Any, optimizer: Any,
             **finder: Any) -> Any:
    values = [*args, *kwargs.values()]
    model = model if model is not None else next((v for v in values if isinstance(v, nn.Module)), None)
    optimizer = optimizer if optimizer is not None else next((v for v in values if isinstance(v, torch.optim.Optimizer)), None)
    missing = [name for name, v in (("make_batch", make_batch), ("model", model)) if v is None]
    if finder["mode"] == "train" and optimizer is None:
        missing.append("optimizer")
    if missing:
        warnings.warn(f"hf_memstack.find_executable_batch_size: no {', '.join(missing)} (pass it to the decorator, or the "
                      f"model/optimizer among the function's arguments): no prediction, retrying from {cap} on "
                      "out-of-memory errors as Accelerate does", stacklevel=3)
        return None
    return find_batch_size(model, make_batch, optimizer, max_batch_size=cap, **finder)


def _check_call(function: Callable[..., Any], args: tuple) -> None:
    """Accelerate's guard: the caller must not pass ``batch_size`` (the decorator does)."""
    params = list(inspect.signature(function).parameters)
    if len(params) < len(args) + 1:
        arg_str = ", ".join(f"{arg}={value}" for arg, value in zip(params[1:], args[1:]))
        raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called."
                        f"Remove this as the decorator already does so: `{function.__name__}({arg_str})`")


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
