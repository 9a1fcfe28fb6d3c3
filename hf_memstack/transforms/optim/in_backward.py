"""OptimizerInBackward: an optimizer per parameter, stepped by a hook as soon as the parameter's gradient
is complete, which then frees it (``optim:in_backward``): the gradients are never all alive at once."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...record import unwrap_model
from .groups import ParamGroup

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT, StateDict

__all__ = ["OptimizerInBackward", "optimizer_in_backward_of"]

Factory = Callable[[list[ParamGroup], ParamGroup], torch.optim.Optimizer]


class OptimizerInBackward(torch.optim.Optimizer):
    """Updates each parameter inside the backward, as soon as its gradient is complete (a
    post-accumulate-grad hook, which FSDP2 also calls on its sharded parameters), then frees the
    gradient: the gradients are never all alive at once (torchtune's optimizer-in-backward).

    Each parameter has its own optimizer (``optimizers[param]``); ``param_groups`` hold the
    hyperparameters, so learning-rate schedulers work as usual. ``step()`` and ``zero_grad()`` do
    nothing; ``state_dict()`` / ``load_state_dict()`` save and restore every parameter's optimizer.

    Raises (from the backward): RuntimeError when a parameter's gradient completes twice without a
    ``step()`` call in between - gradient accumulation, which this optimizer cannot do.
    """

    def __init__(
        self,
        params: ParamsT,
        factory: Factory,
        defaults: ParamGroup,
        *,
        names: dict[nn.Parameter, str] | None = None,
    ) -> None:
        super().__init__(params, defaults)
        self._names = dict(names or {})  # for messages: "model.layers.0.weight has shape ..."
        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._groups: dict[int, ParamGroup] = {}
        for group in self.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.optimizers[p] = factory([{"params": [p]}], options)
                self._groups[id(p)] = group
        self.state = _MergedState(self.optimizers)  # type: ignore[assignment]
        self._stepped: set[int] = set()
        self._paused = False
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in self.optimizers]

    def _step_parameter(self, param: nn.Parameter) -> None:
        if self._paused or param.grad is None:
            return
        if id(param) in self._stepped:
            raise RuntimeError(
                "OptimizerInBackward: a parameter's gradient completed twice without optimizer.step() in between - "
                "gradient accumulation, which an optimizer stepping in the backward cannot do (each backward already "
                "updated the weights). Call optimizer.step() after every backward (with gradient_accumulation_steps=1), "
                "or use policy.optimizer.step='after_backward'"
            )
        self._stepped.add(id(param))
        inner = self.optimizers[param]
        _copy_hyperparameters(self._groups[id(param)], inner.param_groups[0])
        inner.step()
        param.grad = None  # the point: this gradient is not needed any more

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to update (the backward did); marks the end of an optimizer step."""
        self._stepped.clear()
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The backward already freed each gradient after its update."""
        for p in self.optimizers:
            if p.grad is not None:  # e.g. left by a paused backward
                p.grad = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: backward leaves the gradients in place and updates nothing (for checks such as ``verify``)."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def state_dict(self) -> StateDict:  # type: ignore[override]
        order = list(self.optimizers)
        return {
            "optimizers": [self.optimizers[p].state_dict() for p in order],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "shapes": [list(p.shape) for p in order],
        }

    def load_state_dict(self, state_dict: StateDict) -> None:  # type: ignore[override]
        """Restore what :meth:`state_dict` saved, after checking (before anything changes) that it was
        saved for parameters of these shapes, in this order.

        Raises:
            ValueError: a state dict of another form, for another number of parameters or groups, or
                for a parameter of another shape (named, with both shapes); this optimizer is unchanged.
        """
        self._check_loadable(state_dict)
        for optimizer, inner in zip(self.optimizers.values(), state_dict["optimizers"]):
            optimizer.load_state_dict(inner)
        for group, options in zip(self.param_groups, state_dict["param_groups"]):
            group.update(options)
        self._stepped.clear()

    def _check_loadable(self, state_dict: object) -> None:
        if (
            not isinstance(state_dict, dict)
            or not isinstance(state_dict.get("optimizers"), list)
            or not isinstance(state_dict.get("param_groups"), list)
        ):
            keys = sorted(state_dict)[:6] if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"OptimizerInBackward.load_state_dict: the state dict (keys {keys}) is not one an OptimizerInBackward "
                "saved (it needs 'optimizers' and 'param_groups'); a torch.optim optimizer's state dict cannot be "
                "loaded here: load the state saved from make_optimizer's optimizer for the same policy"
            )
        saved, groups = state_dict["optimizers"], state_dict["param_groups"]
        if len(saved) != len(self.optimizers) or len(groups) != len(self.param_groups):
            raise ValueError(
                f"this OptimizerInBackward has {len(self.optimizers)} parameters in {len(self.param_groups)} group(s), "
                f"the state dict {len(saved)} in {len(groups)}: load a state saved from the same model and trainable "
                "parameters"
            )
        shapes = state_dict.get("shapes")
        for i, (param, inner) in enumerate(zip(self.optimizers, saved)):
            shape = tuple(shapes[i]) if isinstance(shapes, list) and i < len(shapes) else _state_shape(inner)
            if shape is not None and shape != tuple(param.shape):
                name = self._names.get(param, f"parameter {i}")
                raise ValueError(
                    f"OptimizerInBackward.load_state_dict: {name} has shape {tuple(param.shape)} but the state dict's "
                    f"parameter {i} has shape {shape}: it was saved from another model (or other trainable "
                    "parameters); load a state saved from this model, with the same parameters trainable"
                )

    def remove_hooks(self) -> None:
        """Stop stepping in the backward (e.g. before building another optimizer for this model)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _MergedState(MutableMapping):
    """``optimizer.state`` of an :class:`OptimizerInBackward`: every parameter's state, as one
    mapping, so the meter, the finder and ``optimizer_state_bytes`` see it as any optimizer's."""

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: nn.Parameter) -> object:
        return self._optimizers[param].state[param]

    def __setitem__(self, param: nn.Parameter, value: object) -> None:
        self._optimizers[param].state[param] = value

    def __delitem__(self, param: nn.Parameter) -> None:
        del self._optimizers[param].state[param]

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (p for p, o in self._optimizers.items() if p in o.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _state_shape(inner: object) -> tuple[int, ...] | None:
    """The parameter's shape as its saved moments show it (a state saved before ``"shapes"`` was recorded)."""
    state = inner.get("state") if isinstance(inner, dict) else None
    for value in (state or {}).values():
        for key, tensor in value.items() if isinstance(value, dict) else ():
            if key != "step" and torch.is_tensor(tensor) and tensor.dim() > 0:
                return tuple(tensor.shape)
    return None


def _copy_hyperparameters(source: ParamGroup, target: ParamGroup) -> None:
    """A scheduler changed ``source`` (the outer group): pass it on. torchao keeps ``lr`` as a tensor."""
    for key, value in source.items():
        if key == "params" or key not in target:
            continue
        if torch.is_tensor(target[key]) and not torch.is_tensor(value):
            target[key].fill_(value)
        else:
            target[key] = value


def optimizer_in_backward_of(model: nn.Module) -> OptimizerInBackward | None:
    """The :class:`OptimizerInBackward` that :func:`make_optimizer` attached to ``model``'s parameters, if alive."""

    ref = unwrap_model(model).__dict__.get("_memstack_optimizer_in_backward")
    optimizer = ref() if ref is not None else None
    return optimizer if isinstance(optimizer, OptimizerInBackward) and optimizer._handles else None
