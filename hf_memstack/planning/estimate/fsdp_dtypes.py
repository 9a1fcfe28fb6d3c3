"""An FSDP job's single-device trace in the dtypes a rank computes in.

``apply_fsdp`` shards with FSDP2's ``MixedPrecisionPolicy(param_dtype=<the policy's>)``: a rank gathers
every floating parameter in that dtype and casts each FSDP module's floating inputs to it. So the whole
forward runs in it: measured on 2 gloo ranks under ``bf16+fsdp`` (a tiny Llama), the embeddings, the
residual stream, every norm's output and the attention mask are bf16, where one device under autocast
keeps them fp32 (fp32 weights: the embedding's and norms' outputs, and the sums on them, stay fp32). A
trace of the single-device job read the activations 13-53% over the meter (the step's peak +2.4% to
+9.3%; +29% with ``loss:chunked`` and LoRA, whose head weight it also copied).

:func:`compute_dtypes` traces the job as a rank runs it: each floating parameter is replaced by a copy
in the compute dtype while it is in use (autograd carries its gradient back to the parameter, as FSDP's
reduce-scatter does to the shard), and each block's and the root's floating inputs are cast to it. The
root's parameters (embeddings, final norm, head) are swapped in for the whole forward and a block's for
the block's, as FSDP gathers them (the chunked loss reads the head's weight without calling its module;
PEFT reads its adapters' dtype outside theirs); a checkpointed block's recompute gets them from the
block's hooks, or module by module where the checkpoint runs inside its forward, and they are let go
when its backward ends. PEFT's ``ParamWrapper`` (LoRA on a mixture of experts' grouped weights and
routers) reparametrizes the copy in its forward as it does the gathered parameter on a rank: the
experts' weights with their adapters folded in are bf16 there too. A rank holds no such copy (its
gathered parameters are accounted for apart, in :mod:`.fsdp_shards`), so the bytes of the copies are
measured (:func:`copies_of`) and taken off there."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from ..model.fake import blocks_or_empty

__all__ = ["Copies", "compute_dtypes", "copies_of", "forget_copies"]

_Hook = Callable[..., object]
_Made = list[tuple[StorageWeakRef, int]]


@dataclass(slots=True)
class Copies:
    """The compute-dtype copies of the parameters that the trace made in a rank's stead."""

    block: int = 0
    """What one block's backward keeps of them after its forward (the largest block's; none of a
    checkpointed block's: its recompute's are all ``block_made``)."""
    block_made: int = 0
    """All of one block's: alive through its forward."""
    root: int = 0
    """What the backward keeps of the root's (the head's weight, the final norm's)."""
    root_made: int = 0
    """All of the root's: alive through the forward."""


_COPIES: weakref.WeakKeyDictionary[nn.Module, Copies] = weakref.WeakKeyDictionary()


def copies_of(net: nn.Module) -> Copies | None:
    """What :func:`compute_dtypes` measured of ``net``'s last trace (None: not traced so)."""
    return _COPIES.get(net)


def forget_copies(net: nn.Module) -> None:
    """``net`` traced again, not as a rank computes: no earlier reading is left."""
    _COPIES.pop(net, None)


@contextlib.contextmanager
def compute_dtypes(net: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """While inside, ``net`` computes as an FSDP rank under ``param_dtype=dtype`` does (see above)."""
    blocks = blocks_or_empty(net)
    inside = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
    copies = Copies()
    _COPIES[net] = copies
    kept: dict[int, int] = {}  # block -> bytes of its copies its backward keeps
    made: dict[int, int] = {}  # block -> bytes of all its copies
    swaps: list[_Swap] = []
    handles = [u.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True) for u in (*blocks, net)]
    wrapped = _wrapped(net)
    for i, block in enumerate(blocks):
        mine = [m for m in block.modules() if _owned(m, dtype)]
        unit = [_Swap(block, mine, dtype, functools.partial(_note, kept, made, i))]
        # A recompute that bypasses the block's hooks (a checkpoint inside its forward) swaps module by module.
        unit += [_Swap(wrapped.get(id(m), m), [m], dtype, _unmeasured) for m in mine]
        handles.append(block.register_forward_pre_hook(functools.partial(_restore_after_backward, unit)))
        swaps += unit
    root = [m for m in net.modules() if id(m) not in inside and _owned(m, dtype)]
    swaps.append(_Swap(net, root, dtype, functools.partial(_note_root, copies)))
    handles += [h for s in swaps for h in s.handles]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for swap in swaps:
            swap.restore()
        copies.block = max(kept.values(), default=0)
        copies.block_made = max(made.values(), default=0)


def _note(kept: dict[int, int], made: dict[int, int], block: int, n: int, all_made: int) -> None:
    kept[block] = max(kept.get(block, 0), n)
    made[block] = max(made.get(block, 0), all_made)


def _unmeasured(n: int, all_made: int) -> None:
    """A module's own swap: only a recompute outside its block's hooks makes it (the block's copies then)."""


def _note_root(copies: Copies, n: int, all_made: int) -> None:
    copies.root, copies.root_made = n, all_made


def _restore_after_backward(unit: list[_Swap], module: nn.Module, args: tuple[object, ...]) -> None:
    """In the forward, a hook on the block's input: when its gradient is computed, the block's backward is
    done, and the copies a checkpointed block's recompute swapped in are let go (FSDP reshards then). The
    recompute stops at the last tensor it must save (PyTorch's early stop), before the block's post-hook."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if torch._C._current_graph_task_id() != -1 or first is None or not first.requires_grad:
        return  # a recompute, in the backward; or no gradient will come

    def done(grad: torch.Tensor) -> None:
        for swap in unit:
            swap.restore()

    first.register_hook(done)


def _wrapped(net: nn.Module) -> dict[int, nn.Module]:
    """The modules whose parameters PEFT's ``ParamWrapper`` (LoRA on a parameter: MoE experts' grouped
    weights, routers) reparametrizes with torch's ``parametrize`` in its forward, each to the outermost
    wrapper around it (they nest, one a parameter). A module's own swap must come before that wrapper
    takes its parameter (as FSDP2's gathered one is in place before it): at the wrapper, not at the module."""
    out: dict[int, nn.Module] = {}
    for module in net.modules():  # outer wrappers before the ones they wrap
        if type(module).__name__ != "ParamWrapper" or id(module) in out:
            continue
        inner = module
        while type(inner).__name__ == "ParamWrapper" and isinstance(
            base := getattr(inner, "base_layer", None), nn.Module
        ):
            out[id(inner)] = module
            inner = base
        out.update((id(sub), module) for sub in inner.modules())
    return out


def _owned(module: nn.Module, dtype: torch.dtype) -> list[tuple[str, nn.Parameter]]:
    """``module``'s own floating parameters not in ``dtype``, by name."""
    return [
        (n, p) for n, p in module._parameters.items() if p is not None and p.is_floating_point() and p.dtype != dtype
    ]


def _cast_inputs(dtype: torch.dtype) -> _Hook:
    """FSDP2's ``cast_forward_inputs``: a unit's floating tensor arguments in the compute dtype."""

    def cast(x: object) -> object:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, object]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook


class _Swap:
    """Hooks on ``unit`` that swap ``modules``' parameters for compute-dtype copies while it runs, then
    call ``done`` with the bytes of the copies its backward keeps, and of all of them."""

    def __init__(self, unit: nn.Module, modules: list[nn.Module], dtype: torch.dtype, done: Callable[[int, int], None]):
        self.modules, self.dtype, self.done = modules, dtype, done
        self.stack: list[tuple[list[tuple[nn.Module, str, nn.Parameter]], _Made]] = []
        self.handles = [unit.register_forward_pre_hook(self.pre), unit.register_forward_hook(self.post)]

    def pre(self, module: nn.Module, args: object) -> None:
        originals = [(m, n, p) for m in self.modules for n, p in _owned(m, self.dtype)]
        made: _Made = []
        copies: dict[int, torch.Tensor] = {}  # a tied weight (embeddings and head) is gathered once
        for m, name, p in originals:
            if id(p) not in copies:
                # Differentiable: the gradient reaches the parameter, as the reduce-scatter's does the shard.
                copies[id(p)] = p.to(self.dtype)
                made.append((StorageWeakRef(copies[id(p)].untyped_storage()), p.numel() * self.dtype.itemsize))
            m._parameters[name] = copies[id(p)]  # type: ignore[assignment]  # FSDP2 swaps its gathered ones in too
        self.stack.append((originals, made))

    def post(self, module: nn.Module, args: object, output: object) -> None:
        if not self.stack:
            return
        originals, made = self.stack.pop()
        self._put_back(originals)
        # What outlives the unit's forward is what its backward saved.
        self.done(sum(size for ref, size in made if not ref.expired()), sum(size for _, size in made))

    def restore(self) -> None:
        """Put back what a forward stopped early left swapped in."""
        while self.stack:
            self._put_back(self.stack.pop()[0])

    @staticmethod
    def _put_back(originals: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
        for m, name, p in reversed(originals):
            # torch's parametrize (PEFT's ParamWrapper: LoRA on MoE experts' and routers' weights) lets go of
            # what it was given by registering it back, a plain tensor as a buffer: the copy, not to be kept.
            m._buffers.pop(name, None)
            m._parameters[name] = p
