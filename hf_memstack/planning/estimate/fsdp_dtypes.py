"""An FSDP job's single-device trace in the dtypes a rank computes in.

``apply_fsdp`` shards with FSDP2's ``MixedPrecisionPolicy(param_dtype=<the policy's>)``: a rank gathers
every floating parameter in that dtype and casts each FSDP module's floating inputs to it. So the whole
forward runs in it: measured on 2 gloo ranks under ``bf16+fsdp`` (a tiny Llama), the embeddings, the
residual stream, every norm's output and the attention mask are bf16, where one device under autocast
keeps them fp32 (fp32 weights: the embedding's and norms' outputs, and the sums on them, stay fp32). A
trace of the single-device job then read the activations 13-19% over the meter (the step's peak +2.4%
to +9.3%).

:func:`compute_dtypes` traces the job as a rank runs it: while a module runs, each of its floating
parameters is replaced by a copy in the compute dtype (autograd carries its gradient back to the
parameter, as FSDP's reduce-scatter does to the shard), and each block's and the root's floating inputs
are cast to it. A rank holds no such copy (its gathered parameters are accounted for apart, in
:mod:`.fsdp_shards`), so the bytes of the copies the backward keeps are measured (:func:`copies_of`) and
taken off there. The copy is made per module, not per FSDP unit, so that MemTracker never sees it
among a module's parameters (it reads them as a module's forward first starts)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from ..model.fake import blocks_or_empty

__all__ = ["Copies", "compute_dtypes", "copies_of", "forget_copies"]


@dataclass(slots=True)
class Copies:
    """The compute-dtype copies of the parameters that the traced backward keeps (saved for it)."""

    block: int = 0
    """One block's (the largest)."""
    root: int = 0
    """The parameters' outside the blocks (the head's, the final norm's)."""
    by_unit: dict[int, int] = field(default_factory=dict)


_COPIES: weakref.WeakKeyDictionary[nn.Module, Copies] = weakref.WeakKeyDictionary()


def copies_of(net: nn.Module) -> Copies | None:
    """What :func:`compute_dtypes` measured of ``net``'s trace (None: it was not traced so)."""
    return _COPIES.get(net)


def forget_copies(net: nn.Module) -> None:
    """``net`` traced again, not as a rank computes: no earlier reading is left."""
    _COPIES.pop(net, None)


@contextlib.contextmanager
def compute_dtypes(net: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """While inside, ``net`` computes as an FSDP rank under ``param_dtype=dtype`` does (see above)."""
    blocks = blocks_or_empty(net)
    unit_of = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    copies = Copies()
    _COPIES[net] = copies
    handles = [u.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True) for u in (*blocks, net)]
    for m in net.modules():
        if any(_casts(p, dtype) for p in m._parameters.values()):
            unit = unit_of.get(id(m), -1)
            stack: list[tuple[dict[str, nn.Parameter], list[tuple[StorageWeakRef, int]]]] = []
            handles.append(m.register_forward_pre_hook(_swap_in(dtype, stack)))
            handles.append(m.register_forward_hook(_swap_out(stack, copies, unit)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        copies.block = max((b for u, b in copies.by_unit.items() if u >= 0), default=0)
        copies.root = copies.by_unit.get(-1, 0)


def _casts(p: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return p is not None and p.is_floating_point() and p.dtype != dtype


def _cast_inputs(dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """FSDP2's ``cast_forward_inputs``: a unit's floating tensor arguments in the compute dtype."""

    def cast(x: object) -> object:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, object]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


def _swap_in(dtype: torch.dtype, stack: list):  # type: ignore[no-untyped-def,type-arg]
    def hook(module: nn.Module, args: object) -> None:
        originals = {n: p for n, p in module._parameters.items() if p is not None and _casts(p, dtype)}
        made = []
        for name, p in originals.items():
            copy = p.to(dtype)  # differentiable: the gradient reaches the parameter, as the shard's does
            module._parameters[name] = copy  # type: ignore[assignment]  # what FSDP2 swaps in too
            made.append((StorageWeakRef(copy.untyped_storage()), copy.numel() * copy.element_size()))
        stack.append((originals, made))

    return hook


def _swap_out(stack: list, copies: Copies, unit: int):  # type: ignore[no-untyped-def,type-arg]
    def hook(module: nn.Module, args: object, output: object) -> None:
        originals, made = stack.pop()
        module._parameters.update(originals)
        # What outlives the module is what its backward saved. Each call adds (a checkpointed block
        # keeps none in its forward, then its recompute's): summed over one unit's calls.
        kept = sum(size for ref, size in made if not ref.expired())
        copies.by_unit[unit] = copies.by_unit.get(unit, 0) + kept

    return hook
