"""A mixture-of-experts model's router load-balancing loss, as its own forward adds it: found in its
modeling module, its numbers read where the forward reads them, refused when called another way -
so the chunked loss trains the routers exactly as the model's loss does."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# The one signature every Transformers causal LM with a router loss calls it with (Mixtral's pattern):
# load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask).
_ROUTER_LOSS_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")

RouterLoss = Callable[..., "torch.Tensor | int"]
"""A model's ``load_balancing_loss_func`` (0 when the forward gave it no router logits)."""


def _router_loss_function(target: PreTrainedModel) -> RouterLoss | None:
    """The model's own ``load_balancing_loss_func`` (from its modeling module, through subclasses),
    or None for a model without a router loss; refuse one called another way (Doge's extra argument)."""
    # A class whose module is no longer imported has no function to look at (hasattr(None, ...) was False too).
    modules = (m for cls in type(target).__mro__ if (m := sys.modules.get(cls.__module__)) is not None)
    function = next((m.load_balancing_loss_func for m in modules if hasattr(m, "load_balancing_loss_func")), None)
    if function is None:
        return None  # no router loss in this family (DeepSeek-V3, Llama-4, ... train without one)
    name = type(target).__name__
    parameters = tuple(inspect.signature(function).parameters)
    if parameters != _ROUTER_LOSS_PARAMETERS:
        raise ValueError(
            f"policy.loss.mode='chunked': {name} adds a router load-balancing loss through load_balancing_loss_func"
            f"{parameters}, not the {_ROUTER_LOSS_PARAMETERS} form the chunked loss reproduces; drop loss:chunked for this "
            "model (its own loss then trains the routers)"
        )
    missing = [
        what
        for what, value in zip(("num_experts", "num_experts_per_tok", "router_aux_loss_coef"), _router_numbers(target))
        if value is None
    ]
    if missing:
        raise ValueError(
            f"policy.loss.mode='chunked': {name} adds a router load-balancing loss, but hf_memstack cannot find its "
            f"{', '.join(missing)} (on the model or its config) to reproduce it; drop loss:chunked for this model"
        )
    return function


def _router_numbers(model: PreTrainedModel) -> tuple[int | None, int | None, float | None]:
    """``(num_experts, top_k, coefficient)`` as the model's forward reads them (its own attributes,
    set from the config at init; JetMoE calls the coefficient ``aux_loss_coef``), else the config's."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def first(*names: str, sources: tuple[object, ...] = (model, config)) -> object:
        return next((getattr(o, n) for o in sources for n in names if getattr(o, n, None) is not None), None)

    # cast: the model's and config's numbers, as the model's forward reads them (None: not found)
    return cast(
        "tuple[int | None, int | None, float | None]",
        (
            first("num_experts", "num_local_experts"),
            first("num_experts_per_tok"),
            first("router_aux_loss_coef", "aux_loss_coef"),
        ),
    )


def _router_logits_on(model: PreTrainedModel, arguments: Mapping[str, object]) -> bool | None:
    """``output_router_logits`` as the model's forward resolves it (the call's, else the config's);
    None for a model that has no such option."""
    if arguments.get("output_router_logits") is not None:
        return bool(arguments["output_router_logits"])
    return getattr(model.config, "output_router_logits", None)
