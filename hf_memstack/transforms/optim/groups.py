"""The parameter groups and hyperparameters ``make_optimizer`` is given, read once and checked before
torch.optim sees them: each problem named with its fix, instead of a bare comparison error or a
run that silently trains nothing (a foreign parameter, a misspelt group key)."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from typing import Any, TypeAlias, cast

import torch
from torch import nn

# torch.optim's own type for a parameter group: its "params" and hyperparameters of any type.
ParamGroup: TypeAlias = dict[str, Any]


def _check_hyperparameters(*, lr: object, eps: object, weight_decay: object, betas: object, where: str = "") -> None:
    """Names the argument before torch.optim would fail on it with a bare comparison error (e.g.
    ``lr="1e-3"`` read from a config without a type), or would accept it and train on nonsense
    (``lr=inf`` or ``nan`` turns every weight into nan at the first step). ``lr`` may be a one-value
    float tensor, as torch.optim allows (e.g. for a learning rate changed inside a compiled step).
    ``where``: ``"param_groups[1]."`` for a group's own value."""

    def number(x: object, *, tensor: bool = False) -> bool:
        if tensor and torch.is_tensor(x) and x.numel() == 1 and x.is_floating_point():
            x = x.item()
        # numpy's too; cast: numbers.Real's stub declares < and <= only, and every Real compares with 0
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and cast(float, x) >= 0

    problems = [
        f"{where}{name}={value!r} must be a finite number >= 0{' (or a one-value float tensor)' if tensor else ''}, "
        f"e.g. {example}"
        for name, value, example, tensor in (
            ("lr", lr, "lr=1e-4", True),
            ("eps", eps, "eps=1e-8", False),
            ("weight_decay", weight_decay, "weight_decay=0.01", False),
        )
        if not number(value, tensor=tensor)
    ]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and b < 1 for b in betas)):
        problems.append(f"{where}betas={betas!r} must be two numbers in [0, 1), e.g. betas=(0.9, 0.999)")
    if problems:
        raise ValueError("make_optimizer: " + "; ".join(problems) + " (a value read from a file may need float(...))")


_GROUPS_EXAMPLE = 'param_groups=[{"params": [...], "weight_decay": 0.0}, {"params": [...]}]'


def _param_groups(model: nn.Module, param_groups: object, defaults: ParamGroup) -> list[ParamGroup]:
    """The groups as lists, each iterable read once (as torch.optim does: ``model.parameters()`` is a
    generator, and a check that iterates it first would leave the optimizer nothing), copied so the
    caller's dicts are not changed, and checked: every parameter is one of ``model``'s and at least
    one is trainable.

    Raises:
        TypeError: ``param_groups`` is not a list of dicts with ``"params"`` (or of parameters).
        ValueError: a group's hyperparameter; a parameter that ``model`` does not have; nothing trainable.
    """
    if param_groups is None:
        trainable = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        _check_group_parameters(model, trainable, given=False)
        return trainable
    if isinstance(param_groups, (str, bytes, dict, set, torch.Tensor)) or not isinstance(param_groups, Iterable):
        raise TypeError(
            f"make_optimizer: param_groups={_short(param_groups)} ({type(param_groups).__name__}) must be a list of "
            f"dicts, e.g. {_GROUPS_EXAMPLE}; or leave it out to optimize every trainable parameter"
        )
    groups = list(param_groups)
    if groups and all(
        torch.is_tensor(_tensor_of(g)) for g in groups
    ):  # parameters (or named ones) are one group, as for torch.optim
        groups = [{"params": groups}]
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"make_optimizer: param_groups[{i}]={_short(group)} ({type(group).__name__}) must be a dict with a "
                f"'params' entry, e.g. {_GROUPS_EXAMPLE}"
            )
        _check_group_keys(i, group)
        out.append({**group, "params": _group_params(i, group["params"])})
        options = {**defaults, **group}
        _check_hyperparameters(
            lr=options["lr"],
            eps=options["eps"],
            weight_decay=options["weight_decay"],
            betas=options["betas"],
            where=f"param_groups[{i}].",
        )
    _check_group_parameters(model, out, given=True)
    return out


# What AdamW reads from a group (torch.optim keeps any other key, e.g. a "name", and ignores it).
_GROUP_KEYS = (
    "params",
    "param_names",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def _check_group_keys(i: int, group: ParamGroup) -> None:
    """A misspelt setting (``"weight_decy"``) would be kept and ignored: the group trains with the default."""
    for key in group:
        close = difflib.get_close_matches(str(key), _GROUP_KEYS, n=1, cutoff=0.8) if key not in _GROUP_KEYS else []
        if close:
            raise ValueError(
                f"make_optimizer: param_groups[{i}] has {key!r}, which AdamW does not read (it would be ignored, and "
                f"the group would use the default); did you mean {close[0]!r}?"
            )


def _group_params(i: int, params: object) -> list[object]:
    if torch.is_tensor(params):
        return [params]
    if isinstance(params, (str, bytes, dict, set)) or not isinstance(params, Iterable):
        raise TypeError(
            f"make_optimizer: param_groups[{i}]['params'] has type {type(params).__name__}: it must be a parameter or "
            "an ordered iterable of them (a list, or model.parameters()); a set has no fixed order"
        )
    items = list(params)
    for item in items:
        tensor = _tensor_of(item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"make_optimizer: param_groups[{i}]['params'] holds {_short(tensor)} (type {type(tensor).__name__}): "
                "only the model's parameters (tensors) can be optimized"
            )
    return items


def _check_group_parameters(model: nn.Module, groups: list[ParamGroup], *, given: bool) -> None:
    """A parameter from another model (a copy, a model loaded twice) would be stepped while this one never
    changes: a run that trains nothing and says nothing."""
    own = {id(p) for p in model.parameters()}
    # _group_params checked that every item is a tensor (or a named one)
    tensors = [(i, cast(torch.Tensor, _tensor_of(item))) for i, g in enumerate(groups) for item in g["params"]]
    foreign = [(i, t) for i, t in tensors if id(t) not in own]
    if foreign:
        i, t = foreign[0]
        raise ValueError(
            f"make_optimizer: param_groups[{i}] holds {len(foreign)} tensor(s) that are not parameters of "
            f"{type(model).__name__} (the first has shape {tuple(t.shape)}): they would be updated while the model never "
            "changes; build the groups from this model's parameters (e.g. after prepare_model or PEFT wrapped it)"
        )
    if not any(t.requires_grad for _, t in tensors):
        where = " in param_groups" if given else ""
        raise ValueError(
            f"{type(model).__name__} has no trainable parameter (requires_grad){where}: nothing to optimize; "
            "unfreeze some, or check the PEFT config"
        )


def _tensor_of(item: object) -> object:
    """``(name, parameter)`` (from ``named_parameters()``, which torch.optim accepts) -> the parameter."""
    return item[1] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else item


def _short(value: object) -> str:
    if torch.is_tensor(_tensor_of(value)):
        return f"a tensor of shape {tuple(cast(torch.Tensor, _tensor_of(value)).shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
