"""A drop-in for Accelerate's ``find_executable_batch_size`` that predicts first.

Same calling convention - the decorated function gets ``batch_size`` first, and is called again
with a smaller one after an out-of-memory error - so existing code changes one import::

    from hf_memstack import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=128, make_batch=make_batch)
    def train(batch_size, model, optimizer):
        ...

    train(model, optimizer)

A function that closes over the model and optimizer (Accelerate's canonical style) passes them to
the decorator: ``find_executable_batch_size(..., make_batch=make_batch, model=model, optimizer=optimizer)``.

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
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Concatenate, Literal, ParamSpec, Protocol, TypedDict, TypeVar, cast, overload

import torch
from torch import nn

from .finder import find_batch_size
from .probe import is_out_of_memory
from .result import BatchSizeResult

__all__ = ["find_executable_batch_size"]

_P = ParamSpec("_P")
_R_co = TypeVar("_R_co", covariant=True)


class _Retrying(Protocol[_P, _R_co]):
    """The decorated function: called without ``batch_size``, with the finder's result once it ran."""

    batch_size_result: BatchSizeResult | None

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...


@overload
def find_executable_batch_size(
    function: Callable[Concatenate[int, _P], _R_co],
    starting_batch_size: int = ...,
    reduce_batch_size_fn: Callable[[], int] | None = ...,
    *,
    make_batch: Callable[[int], object] | None = ...,
    model: nn.Module | None = ...,
    optimizer: torch.optim.Optimizer | None = ...,
    budget: int | str | None = ...,
    mode: Literal["train", "eval"] = ...,
    cache: bool = ...,
    cache_dir: str | Path | None = ...,
) -> _Retrying[_P, _R_co]: ...


@overload
def find_executable_batch_size(
    function: None = None,
    starting_batch_size: int = ...,
    reduce_batch_size_fn: Callable[[], int] | None = ...,
    *,
    make_batch: Callable[[int], object] | None = ...,
    model: nn.Module | None = ...,
    optimizer: torch.optim.Optimizer | None = ...,
    budget: int | str | None = ...,
    mode: Literal["train", "eval"] = ...,
    cache: bool = ...,
    cache_dir: str | Path | None = ...,
) -> Callable[[Callable[Concatenate[int, _P], _R_co]], _Retrying[_P, _R_co]]: ...


def find_executable_batch_size(
    function: Callable[..., object] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    make_batch: Callable[[int], object] | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    budget: int | str | None = None,
    mode: Literal["train", "eval"] = "train",
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> Callable[..., object]:
    """Decorate ``function(batch_size, *args, **kwargs)``: predict the batch size, then retry on OOM.

    Args:
        function: the function to wrap (or None, to use the decorator with arguments).
        starting_batch_size: the largest size to use (Accelerate's first attempt).
        reduce_batch_size_fn: Accelerate's hook: called with no arguments after an out-of-memory
            error, returns the next size. Default: ``int(batch_size * 0.9)``. Its sizes must fall
            call after call (0 ends the search as Accelerate's does); a size at or above the one
            that just ran out of memory - it counts down from ``starting_batch_size`` while the
            prediction started lower - is skipped by calling it again.
        make_batch: ``make_batch(n)`` returns a batch of ``n`` samples at the longest sequence
            length the function will see; without it there is no prediction (a warning says so).
        model, optimizer: what the finder measures; default: the first ``nn.Module`` and the
            first optimizer among the call's arguments. Pass them here when the function closes
            over them (Accelerate's canonical style, ``def train(batch_size):`` using the
            enclosing ``model`` and ``optimizer``): without them that style gets no prediction.
        budget, mode, cache, cache_dir: as in :func:`~hf_memstack.find_batch_size` (on CPU
            inside :func:`~hf_memstack.simulated_memory_limit` the budget is the limit's).

    The closure style, predicted first::

        @find_executable_batch_size(starting_batch_size=128, make_batch=make_batch, model=model, optimizer=optimizer)
        def train(batch_size):
            ...  # uses model and optimizer from the enclosing scope

        train()

    The wrapper's ``batch_size_result`` attribute holds the finder's result after the first call.

    Raises:
        TypeError: ``batch_size`` passed by the caller (Accelerate's check), an argument of the
            wrong type, or ``reduce_batch_size_fn`` returning something other than an int.
        ValueError: a bad argument value (``mode``, ``starting_batch_size``), or
            ``reduce_batch_size_fn`` returning a negative size or one that does not fall.
        RuntimeError: ``No executable batch size found, reached zero.`` (Accelerate's message).
        BudgetTooSmallError: the finder found that not even batch size 1 fits.
    """
    options: _FinderOptions = {  # the finder's options, forwarded as keywords
        "make_batch": make_batch,
        "model": model,
        "optimizer": optimizer,
        "budget": budget,
        "mode": mode,
        "cache": cache,
        "cache_dir": cache_dir,
    }
    # Checked when decorating, so a typo fails at import time rather than after a first OOM.
    _check_arguments(function, starting_batch_size, reduce_batch_size_fn, options)
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
            **options,
        )
    state = _RetryState(batch_size=starting_batch_size)

    def reduce() -> int:
        state.batch_size = (
            _next_size(reduce_batch_size_fn, state) if reduce_batch_size_fn else int(state.batch_size * 0.9)
        )
        return state.batch_size

    @functools.wraps(function)
    def wrapper(*args: object, **kwargs: object) -> object:
        _check_call(function, args, kwargs)
        if not state.predicted:
            state.predicted = True
            result = _predict(function, args, kwargs, cap=starting_batch_size, options=options)
            wrapper.batch_size_result = result  # type: ignore[attr-defined]
            if result is not None:
                state.batch_size = result.batch_size
        while True:
            if state.batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(state.batch_size, *args, **kwargs)
            except Exception as e:  # only out-of-memory errors are retried
                if not is_out_of_memory(e):
                    raise
            _free_device_memory()
            reduce()

    wrapper.batch_size_result = None  # type: ignore[attr-defined]
    return wrapper


def _check_arguments(
    function: object,
    starting_batch_size: object,
    reduce_batch_size_fn: Callable[[], int] | None,
    options: _FinderOptions,
) -> None:
    if function is not None and not callable(function):
        hint = f" (did you mean starting_batch_size={function!r}?)" if isinstance(function, int) else ""
        raise TypeError(f"function={function!r} must be callable: the function to decorate{hint}")
    if not isinstance(starting_batch_size, int) or isinstance(starting_batch_size, bool) or starting_batch_size <= 0:
        raise ValueError(f"starting_batch_size={starting_batch_size!r} must be a positive integer")
    for name, value in (("reduce_batch_size_fn", reduce_batch_size_fn), ("make_batch", options["make_batch"])):
        if value is not None and not callable(value):
            raise TypeError(f"{name}={value!r} must be callable")
    if reduce_batch_size_fn is not None:
        _check_no_arguments(reduce_batch_size_fn)
    if options["mode"] not in ("train", "eval"):
        raise ValueError(
            f"mode={options['mode']!r} is not one of 'train', 'eval' (train: forward, backward and optimizer "
            "step; eval: forward under no_grad)"
        )
    if options["model"] is not None and not isinstance(options["model"], nn.Module):
        raise TypeError(
            f"model={type(options['model']).__name__} must be a torch.nn.Module (the model the function trains)"
        )
    if options["optimizer"] is not None and not isinstance(options["optimizer"], torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(options['optimizer']).__name__} must be a torch.optim.Optimizer")
    if not isinstance(options["cache"], bool):
        raise TypeError(f"cache={options['cache']!r} must be True or False")


def _check_no_arguments(reduce_batch_size_fn: Callable[..., object]) -> None:
    """Accelerate calls the hook with no arguments: one that needs some would fail only at the first
    out-of-memory error, with a bare TypeError."""
    try:
        signature = inspect.signature(reduce_batch_size_fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind()
    except TypeError as e:
        raise TypeError(
            f"reduce_batch_size_fn{signature} cannot be called with no arguments ({e}), and Accelerate's "
            "find_executable_batch_size calls it with none after an out-of-memory error; keep the batch size "
            "in a variable it closes over, e.g. lambda: int(state['batch_size'] * 0.9)"
        ) from None


class _FinderOptions(TypedDict):
    """The decorator's arguments for :func:`~hf_memstack.find_batch_size`, kept until the first call."""

    make_batch: Callable[[int], object] | None
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    budget: int | str | None
    mode: Literal["train", "eval"]
    cache: bool
    cache_dir: str | Path | None


@dataclass(slots=True)
class _RetryState:
    """One decorated function's retries: the size to call it with next, whether the finder has
    predicted yet, and what ``reduce_batch_size_fn`` last returned (None before its first call)."""

    batch_size: int
    predicted: bool = False
    returned: int | None = None


def _next_size(reduce_batch_size_fn: Callable[[], int], state: _RetryState) -> int:
    """The user's next size below the one that ran out of memory; refuse a hook that would loop forever."""
    while True:
        returned = reduce_batch_size_fn()
        if not isinstance(returned, numbers.Integral) or isinstance(returned, bool):  # numpy's integers are fine
            raise TypeError(
                f"reduce_batch_size_fn returned {returned!r} ({type(returned).__name__}); it must return the next "
                "batch size as an int"
            )
        size = int(returned)
        previous = state.returned
        if size < 0 or (previous is not None and size >= previous):
            why = "a negative size" if size < 0 else f"{size} after returning {previous} on its previous call"
            raise ValueError(
                f"reduce_batch_size_fn returned {why}, and batch size {state.batch_size} ran out of memory: "
                "each call must return a smaller batch size than the last (0 ends the search), or the retries "
                "never end; e.g. return int(batch_size * 0.9) and store it"
            )
        state.returned = size
        # At or above the size that just ran out of memory: it counts down from starting_batch_size
        # while the prediction started lower; ask again (it falls each call, so this ends).
        if size < state.batch_size:
            return size


def _predict(
    function: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
    *,
    cap: int,
    options: _FinderOptions,
) -> BatchSizeResult | None:
    make_batch, model, optimizer = options["make_batch"], options["model"], options["optimizer"]
    values = [*args, *kwargs.values()]
    model = model if model is not None else next((v for v in values if isinstance(v, nn.Module)), None)
    optimizer = (
        optimizer if optimizer is not None else next((v for v in values if isinstance(v, torch.optim.Optimizer)), None)
    )
    missing = [name for name, v in (("make_batch", make_batch), ("model", model)) if v is None]
    if options["mode"] == "train" and optimizer is None:
        missing.append("optimizer")
    if missing:
        warnings.warn(
            f"hf_memstack.find_executable_batch_size: no {', '.join(missing)} (pass it to the decorator, or the "
            f"model/optimizer among the function's arguments){_closure_hint(function, missing)}: no prediction, "
            f"retrying from {cap} on out-of-memory errors as Accelerate does",
            stacklevel=3,
        )
        return None
    # Neither is None here: ``missing`` named each one that was, and returned.
    model, make_batch = cast(nn.Module, model), cast("Callable[[int], object]", make_batch)
    return find_batch_size(
        model,
        make_batch,
        optimizer,
        max_batch_size=cap,
        budget=options["budget"],
        mode=options["mode"],
        cache=options["cache"],
        cache_dir=options["cache_dir"],
    )


def _closure_hint(function: Callable[..., object], missing: list[str]) -> str:
    """Name the model/optimizer the function closes over, so the warning says exactly what to pass."""
    try:
        scope = inspect.getclosurevars(function)
    except (TypeError, ValueError):
        return ""
    found = {**scope.globals, **scope.nonlocals}
    kinds = {"model": nn.Module, "optimizer": torch.optim.Optimizer}
    first = {
        kind: next((n for n, v in found.items() if isinstance(v, cls)), None)
        for kind, cls in kinds.items()
        if kind in missing
    }
    names = {kind: name for kind, name in first.items() if name is not None}
    if not names:
        return ""
    passes = ", ".join(f"{kind}={name}" for kind, name in names.items())
    return f"; {function.__name__} closes over {' and '.join(names.values())}: pass {passes} to the decorator"


def _check_call(function: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """Accelerate's guard: the caller must not pass ``batch_size`` (the decorator does), by position or by name."""
    parameters = inspect.signature(function).parameters
    params = list(parameters)
    variadic = any(p.kind is p.VAR_POSITIONAL for p in parameters.values())  # def f(batch_size, *args): any count fits
    if (not variadic and len(params) < len(args) + 1) or (params and params[0] in kwargs):
        arg_str = ", ".join(f"{arg}={value}" for arg, value in zip(params[1:], args[1:]))
        raise TypeError(
            f"Batch size was passed into `{function.__name__}` as the first argument when called."
            f"Remove this as the decorator already does so: `{function.__name__}({arg_str})`"
        )


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
