"""A simulated device memory limit, so out-of-memory handling can be tested on a laptop CPU.

Inside :func:`simulated_memory_limit`, every tensor allocation that would take the live tensor
bytes above the budget raises the real :class:`torch.OutOfMemoryError` *at that allocation* -
mid-forward or mid-backward, as CUDA's allocator does - so Accelerate's
``find_executable_batch_size``, Transformers' ``auto_find_batch_size`` or your own retry loop meet
the same exception, at the same point, as on a GPU that is too small.

How it counts. A Python dispatch mode (:class:`torch.utils._python_dispatch.TorchDispatchMode`)
sees the outputs of every operator that runs; a storage it has not seen before is new memory, and
a weak reference on that storage takes its bytes off when it is freed. Views share their base's
storage and cost nothing. This is the accounting of PyTorch's ``MemTracker`` (and of the memory
meter): bytes of live tensor storages, no allocator rounding or fragmentation, no scratch buffers
a kernel allocates and frees inside one operator.

What it does not see: tensors created in other threads without the mode (DataLoader workers),
and compiled code - while a Python dispatch mode is active, Dynamo does not run compiled frames
but runs them eagerly, so under ``torch.compile`` the limit applies to eager memory (usually an
upper bound on what the compiled step needs).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

from ..sizes import format_bytes, parse_bytes

__all__ = ["SimulatedMemory", "current_limit", "simulated_memory_limit", "untracked"]

Countable = nn.Module | torch.optim.Optimizer | torch.Tensor
_DEVICES = ("cpu", "cuda", "xpu", "mps")


class SimulatedMemory:
    """What a :func:`simulated_memory_limit` saw; readable inside the context and after it."""

    __slots__ = ("_mode",)

    def __init__(self, mode: LiveBytes):
        self._mode = mode

    @property
    def budget(self) -> int:
        """The simulated device's capacity in bytes."""
        return int(self._mode.budget or 0)

    @property
    def live_bytes(self) -> int:
        """Bytes of counted tensor storages alive now (frozen at exit)."""
        return self._mode.live

    @property
    def peak_bytes(self) -> int:
        """The most live bytes seen at once."""
        return self._mode.peak

    @property
    def out_of_memory_errors(self) -> int:
        """How many allocations were refused."""
        return self._mode.refused


@contextlib.contextmanager
def simulated_memory_limit(
    budget: int | str,
    *,
    count: Iterable[Countable] | Literal["all"] = "all",
    device: str = "cpu",
) -> Iterator[SimulatedMemory]:
    """A device of ``budget`` bytes: an allocation that would take the live tensor bytes above it
    raises :class:`torch.OutOfMemoryError` (message ``"... out of memory. Tried to allocate ..."``,
    which Accelerate and Transformers recognise) where it happens.

    Args:
        budget: bytes or a string such as ``"2GiB"``.
        count: what already occupies the device at entry: ``"all"`` (every tensor alive on
            ``device``, found by a garbage-collector scan), or the models (parameters, buffers,
            gradients), optimizers (their state) and tensors to count. Whatever is allocated inside
            the context always counts.
        device: the device type whose tensors count (``"cpu"``; ``"cuda"`` simulates a smaller GPU).

    Yields:
        :class:`SimulatedMemory` with the live and peak bytes and the number of refused allocations.

    Raises:
        torch.OutOfMemoryError: at entry when the counted tensors alone exceed the budget, and at
            any allocation inside the context that would exceed it (its ``requested_bytes`` is
            the refused allocation's size).
        RuntimeError: no ``device`` is available here (nothing would be counted).
        ValueError: the tensors of ``count`` all live on another device than ``device``.
        TypeError: ``count`` is not ``"all"``, a model, optimizer or tensor, or an iterable of them.

    Warns (on exit) when nothing on ``device`` was ever seen while operators ran on another
    device: the limit counted nothing and refused nothing (e.g. ``device="cuda"`` around a model
    on the CPU).

    Nothing is left behind: on exit the dispatch mode is popped and every weak reference dropped.
    Composes with autocast and activation checkpointing (their operators are seen like any other);
    see the module docstring for ``torch.compile``.
    """
    limit = parse_bytes(budget, field="budget")
    if not isinstance(device, str) or device not in _DEVICES:
        raise ValueError(f"device={device!r} is not one of 'cpu', 'cuda', 'xpu', 'mps'")
    _check_available(device)
    # What is on the device already, found before the mode starts (so the scan costs nothing).
    existing = list(_all_tensors(device)) if count == "all" else _counted_tensors(count, device)
    mode = LiveBytes(device_type=device, budget=limit)
    mode.register(existing)
    del existing
    with mode:
        mode.check_entry()
        yield SimulatedMemory(mode)
    if mode.peak == 0 and mode.elsewhere:
        warnings.warn(
            f"simulated_memory_limit(device={device!r}) counted nothing: no tensor lived on {device!r} while operators "
            f"ran on {', '.join(map(repr, sorted(mode.elsewhere)))}, so nothing was limited; "
            f"{_fix(mode.elsewhere, device)}",
            stacklevel=3,
        )


def _fix(devices: set[str], device: str) -> str:
    other = sorted(devices & set(_DEVICES))
    return (
        f"pass device={other[0]!r} (where the tensors live), or move them to {device!r} first"
        if other
        else f"move the tensors to {device!r} first"
    )


def _check_available(device: str) -> None:
    """A device type that does not exist here has no tensors to count: the limit would limit nothing."""
    backend = {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": getattr(torch.backends, "mps", None)}.get(
        device
    )
    if backend is not None and not backend.is_available():
        raise RuntimeError(
            f"simulated_memory_limit(device={device!r}): no {device} device is available here, so no tensor would "
            f"be counted and nothing limited; use device='cpu' (the default: a device of that size simulated on "
            f"the CPU), or run where a {device} device is"
        )


def _counted_tensors(count: object, device: str) -> list[torch.Tensor]:
    """The tensors of ``count`` (one model, optimizer or tensor, or an iterable of them), checked to be
    on ``device``: counting a model that lives elsewhere counts nothing."""
    if isinstance(count, str):
        raise ValueError(f"count={count!r}: pass 'all' or an iterable of models, optimizers and tensors")
    if isinstance(count, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
        count = [count]
    elif not isinstance(count, Iterable):
        raise TypeError(
            f"count={count!r} ({type(count).__name__}): expected 'all', a model, an optimizer or a tensor, or a "
            "list of them (e.g. count=[model, optimizer])"
        )
    tensors = list(_tensors_of(count))
    devices = {t.device.type for t in tensors}
    if tensors and device not in devices and not any(is_traceable_wrapper_subclass(t) for t in tensors):
        raise ValueError(
            f"simulated_memory_limit(device={device!r}): the {len(tensors)} tensors of count= live on "
            f"{', '.join(map(repr, sorted(devices)))}, none on {device!r}, so none would be counted and nothing "
            f"limited; {_fix(devices, device)}"
        )
    return tensors


def current_limit(device: str = "cpu") -> SimulatedMemory | None:
    """The innermost active :func:`simulated_memory_limit` for ``device`` (None outside one)."""
    for m in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(m, LiveBytes) and m.budget is not None and m.device_type == device:
            return SimulatedMemory(m)
    return None


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Tensors created inside are not counted by any active :func:`simulated_memory_limit` (or the
    finder's tracker): host-side copies, such as the batch-size finder's state snapshot, which on
    a GPU live in host memory, not on the device. Without an active limit this does nothing."""
    modes = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, LiveBytes) and not m.paused]
    for m in modes:
        m.paused = True
    try:
        yield
    finally:
        for m in modes:
            m.paused = False


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages created by the operators that run under it (and of
    those registered up front); refuses an allocation above ``budget``; optionally records the
    live bytes after every operator (``timeline``: the finder fits one line per operator).

    Internal to hf_memstack (the finder uses it); users want :func:`simulated_memory_limit`.
    """

    def __init__(self, *, device_type: str, budget: int | None = None, record: bool = False):
        super().__init__()
        self.device_type = device_type
        self.budget = budget
        self.live = 0
        self.peak = 0
        self.refused = 0
        self.paused = False
        self.timeline: list[int] | None = [] if record else None
        # Device types of outputs seen while nothing on ``device_type`` was counted (a wrong device).
        self.elsewhere: set[str] = set()
        # id(storage) -> (weak reference whose callback returns the bytes, bytes counted)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist already (the model, the optimizer state)."""
        for t in tensors:
            self._add(_storages(t, self.device_type))
        self.peak = max(self.peak, self.live)

    def check_entry(self) -> None:
        if self.budget is not None and self.live > self.budget:
            self.refused += 1
            raise torch.OutOfMemoryError(
                f"Simulated device out of memory. The tensors counted at entry take {format_bytes(self.live)}, more than "
                f"the simulated budget of {format_bytes(self.budget)} (hf_memstack.simulated_memory_limit)"
            )

    def __torch_dispatch__(
        self,
        func: Callable[..., object],
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        # Let tensor subclasses (DTensor, ...) turn into operators on plain tensors first: those
        # come back through this mode and hold the real storages.
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            refused = self._account(out)
            if refused is not None:
                # Raise as a GPU's allocator does: without the outputs it would never have allocated,
                # and without a local naming the error (frame -> error -> traceback -> frame is a
                # cycle that would keep every frame of the failed step, and its tensors, alive
                # until the next garbage collection).
                del out
                try:
                    raise refused
                finally:
                    del refused
        if self.timeline is not None:
            self.timeline.append(self.live)
        return out

    def __exit__(self, *exc: object) -> None:
        # Drop every weak reference: their callbacks can no longer fire into this object.
        self._storages.clear()
        return super().__exit__(*exc)

    # -- bookkeeping -------------------------------------------------------------------------
    def _account(self, out: object) -> torch.OutOfMemoryError | None:
        """Count ``out``'s new storages; the error to raise (nothing counted) when they do not fit."""
        leaves = (
            [out] if isinstance(out, torch.Tensor) else [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        )
        if self.peak == 0 and len(self.elsewhere) < 4:  # cheap: only until the first counted byte
            self.elsewhere.update(t.device.type for t in leaves if t.device.type != self.device_type)
        fresh: dict[int, torch.UntypedStorage] = {}
        resized: dict[int, torch.UntypedStorage] = {}  # grown or shrunk in place (resize_, set_)
        for t in leaves:
            for st in _storages(t, self.device_type):
                known = self._storages.get(id(st))
                if known is None:
                    fresh[id(st)] = st
                elif known[1] != st.nbytes():
                    resized[id(st)] = st
        added = sum(st.nbytes() for st in fresh.values()) + sum(
            st.nbytes() - self._storages[k][1] for k, st in resized.items()
        )
        if self.budget is not None and added > 0 and self.live + added > self.budget:
            self.refused += 1
            # The outputs are dropped with the exception: nothing of this operator stays counted.
            error = torch.OutOfMemoryError(
                f"Simulated device out of memory. Tried to allocate {format_bytes(added)}; {format_bytes(self.live)} of the "
                f"simulated budget of {format_bytes(self.budget)} are in use (hf_memstack.simulated_memory_limit)"
            )
            # exact: tests and retry logic can read it. An attribute of our own on torch's exception,
            # which torch's class does not declare.
            error.requested_bytes = added  # type: ignore[attr-defined]
            return error
        for key, st in resized.items():
            ref, old = self._storages[key]
            self._storages[key] = (ref, st.nbytes())
            self.live += st.nbytes() - old
        self._add(fresh.values())
        self.peak = max(self.peak, self.live)
        return None

    def _add(self, storages: Iterable[torch.UntypedStorage]) -> None:
        for st in storages:
            key = id(st)
            if key in self._storages:
                continue
            nbytes = st.nbytes()
            self._storages[key] = (weakref.ref(st, self._freed_callback(key)), nbytes)
            self.live += nbytes

    def _freed_callback(self, key: int) -> Callable[[weakref.ref], None]:
        def freed(ref: weakref.ref) -> None:
            entry = self._storages.get(key)
            if entry is not None and entry[0] is ref:
                del self._storages[key]
                self.live -= entry[1]

        return freed


def _storages(t: torch.Tensor, device_type: str) -> list[torch.UntypedStorage]:
    """The real storages behind ``t`` on ``device_type`` (through wrapper subclasses such as DTensor)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return [st for x in inner if isinstance(x, torch.Tensor) for st in _storages(x, device_type)]
    if t.device.type != device_type:
        return []
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested or other storage-less layouts
        return []
    if st.device.type != device_type:  # fake (meta-backed) tensors under FakeTensorMode
        return []
    return [st]


def _tensors_of(things: Iterable[Countable]) -> Iterator[torch.Tensor]:
    for x in things:
        if isinstance(x, nn.Module):
            for p in x.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from x.buffers()
        elif isinstance(x, torch.optim.Optimizer):
            yield from (v for state in x.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        elif isinstance(x, torch.Tensor):
            yield x
        else:
            raise TypeError(f"count={x!r} ({type(x).__name__}): expected 'all' or modules, optimizers and tensors")


def _all_tensors(device: str) -> Iterator[torch.Tensor]:
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some module proxies warn on.
        if (
            issubclass(type(obj), torch.Tensor)
            # torch/nn/parameter.py defines the mixin; its stub, parameter.pyi, leaves it out.
            and not isinstance(obj, torch.nn.parameter.UninitializedTensorMixin)  # type: ignore[attr-defined]
            and (is_traceable_wrapper_subclass(obj) or obj.device.type == device)
        ):
            yield obj
