"""PEFT's tuner layers seen by duck typing (PEFT is optional): which modules wrap a base layer,
which are the adapters inside them, and the names users give the layers they wrap."""

from __future__ import annotations

from typing import cast

from torch import nn

__all__ = ["adapter_module_ids", "adapters_on", "base_layer_of", "is_tuner_layer", "logical_name"]


def is_tuner_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA's ``Linear`` and friends) wraps its ``base_layer``."""
    return type(module).__module__.startswith("peft.") and isinstance(getattr(module, "base_layer", None), nn.Module)


def base_layer_of(module: nn.Module) -> nn.Module:
    while is_tuner_layer(module):
        module = _wrapped(module)
    return module


def _wrapped(tuner_layer: nn.Module) -> nn.Module:
    # is_tuner_layer saw that base_layer is a Module (nn.Module's __getattr__ is typed Tensor | Module).
    return cast(nn.Module, tuner_layer.base_layer)


def adapter_module_ids(model: nn.Module) -> set[int]:
    """Every module inside a PEFT tuner layer but its base layer: the adapters (LoRA's A and B)."""
    out: set[int] = set()
    for m in model.modules():
        if is_tuner_layer(m):
            base = {id(b) for b in _wrapped(m).modules()}
            out |= {id(sub) for sub in m.modules() if id(sub) not in base and sub is not m}
    return out


def logical_name(name: str) -> str:
    """A module's name as the user sees it: without PEFT's ``base_model.model.`` and ``.base_layer``."""
    name = name.removeprefix("base_model.model.")
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def adapters_on(model: nn.Module, layers: set[int]) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters of the PEFT tuner layers that wrap a 4-bit layer."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for m in model.modules():
        if is_tuner_layer(m) and id(base_layer_of(m)) in layers:
            base = {id(p) for p in _wrapped(m).parameters()}
            out += [(names.get(id(p), "?"), p) for p in m.parameters() if p.requires_grad and id(p) not in base]
    return out
