"""grad_reach: which trainable parameters the loss cannot give a gradient, read from autograd's graph.

A parameter without a gradient is not always a bug: LLaVA reads a hidden layer from before its vision
tower's ``post_layernorm``, so that norm runs and nothing it computes reaches the loss - the unprepared
model gives it no gradient either. verify tells that apart from a gradient that was lost, with no
unprepared copy: a parameter is *unused by the loss* only on positive evidence, i.e. the graph of a
forward output of a module holding it reaches the parameter while the loss's graph does not, or it
sits inside a module that ran and none of whose outputs the loss's graph reaches. Anything
else without a gradient stays a failure: a module that never ran, a parameter used outside autograd
(``torch.no_grad``, ``.data``, ``.detach()``), one inside a module whose output was cut from the graph
(a hook that detached it), one the loss's graph reaches (a gradient dropped in the backward), and the
places where the graph hides parameters (reentrant checkpointing runs the block under ``no_grad``; a
compiled graph is one node: the hooks here record nothing while dynamo traces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.autograd.graph import Node
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradReach", "Unreached"]

_MAX_DEPTH = 4  # of nested outputs (tuples, dicts, ModelOutput) searched for tensors


@dataclass(frozen=True, slots=True)
class Unreached:
    """The trainable parameters without a gradient that the loss does not use (ids), and the modules
    whose output lost the graph although they hold a parameter without a gradient (names)."""

    unused: frozenset[int] = frozenset()
    cut: tuple[str, ...] = ()


@dataclass(slots=True)
class GradReach:
    """Forward hooks recording the graph of each module's outputs, and the walk of the loss's graph."""

    outputs: dict[int, list[Node]] = field(default_factory=dict)
    """Per module holding trainable parameters: the ``grad_fn`` of its forward's outputs."""
    cut: dict[int, str] = field(default_factory=dict)
    """Modules holding trainable parameters whose output, under grad mode, needed no gradient."""
    loss_nodes: set[Node] = field(default_factory=set)
    loss_params: set[int] = field(default_factory=set)

    def watch(self, model: nn.Module, in_backward: Callable[[], bool]) -> list[RemovableHandle]:
        """Hooks on every module holding trainable parameters, after any the model has (they see
        the output those hooks left); they record only the forward (not a checkpoint's recompute)."""

        def hook(name: str) -> Callable[[nn.Module, tuple[object, ...], object], None]:
            def record(module: nn.Module, args: tuple[object, ...], output: object) -> None:
                if in_backward() or torch.compiler.is_compiling() or not torch.is_grad_enabled():
                    return
                tensors = list(_float_tensors(output, _MAX_DEPTH))
                self.outputs.setdefault(id(module), []).extend(t.grad_fn for t in tensors if t.grad_fn is not None)
                if tensors and not any(t.requires_grad for t in tensors):
                    self.cut[id(module)] = name

            return record

        return [
            module.register_forward_hook(hook(name))
            for name, module in model.named_modules()
            if any(p.requires_grad for p in module.parameters())
        ]

    def walk_loss(self, loss: torch.Tensor) -> None:
        """Before the backward (which frees the graph's buffers): the nodes and parameters the loss reaches."""
        self.loss_params = _walk([loss.grad_fn], self.loss_nodes, stop=set())

    def unreached(self, model: nn.Module) -> Unreached:
        """Classify the trainable parameters left without a gradient by the backward."""
        missing = [(n, m, p) for n, m in model.named_modules() for p in m.parameters(recurse=False) if _missing(p)]
        if not missing:
            return Unreached()
        cut = tuple(
            name
            for module_id, name in self.cut.items()
            if any(n == name or n.startswith(f"{name}.") or not name for n, _, _ in missing)
        )
        if cut:  # whatever ran before the cut lost its gradient too: nothing here is the model's design
            return Unreached(cut=cut)
        starts = [node for _, m, _ in missing for node in self.outputs.get(id(m), ())]
        # Pruned at the loss's nodes: only the branches the loss does not use are walked.
        discarded = _walk(starts, set(), stop=self.loss_nodes)
        silent = self._silent(model)
        unused = frozenset(
            id(p)
            for n, _, p in missing
            if id(p) not in self.loss_params and (id(p) in discarded or any(_within(n, s) for s in silent))
        )
        return Unreached(unused=unused)

    def _silent(self, model: nn.Module) -> list[str]:
        """Modules that ran with a graph and none of whose outputs the loss's graph reaches: nothing
        inside them can reach the loss, whether it ran or not (SigLIP's pooling head, whose
        ``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling ``out_proj``)."""
        return [
            name
            for name, module in model.named_modules()
            if self.outputs.get(id(module)) and not any(node in self.loss_nodes for node in self.outputs[id(module)])
        ]

    def release(self) -> None:
        """Drop the graph nodes held (the discarded branches' buffers with them)."""
        self.outputs.clear()
        self.loss_nodes.clear()


def _within(name: str, module: str) -> bool:
    return not module or name == module or name.startswith(f"{module}.")


def _missing(p: nn.Parameter) -> bool:
    return p.requires_grad and p.grad is None


def _walk(starts: Iterable[Node | None], seen: set[Node], *, stop: set[Node]) -> set[int]:
    """The ids of the tensors held by the ``AccumulateGrad`` nodes reachable from ``starts`` (each node
    visited once: ``seen``), not going through the nodes of ``stop``."""
    reached: set[int] = set()
    stack = [s for s in starts if s is not None and s not in stop]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        stack += [n for n, _ in node.next_functions if n is not None and n not in seen and n not in stop]
    return reached


def _float_tensors(output: object, depth: int) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        if output.is_floating_point() or output.is_complex():
            yield output
    elif depth > 0 and isinstance(output, (tuple, list)):
        for item in output:
            yield from _float_tensors(item, depth - 1)
    elif depth > 0 and isinstance(output, dict):  # ModelOutput included
        for item in output.values():
            yield from _float_tensors(item, depth - 1)
