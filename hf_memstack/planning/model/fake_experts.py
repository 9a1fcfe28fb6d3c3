"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) on the estimator's fake tensors.

Transformers runs a layer of experts with its ``grouped_mm`` implementation by default: the
``tokens x num_experts_per_tok`` routed rows sorted by expert, then one ``torch._grouped_mm`` per
projection over all of them, the experts told apart by offsets. Every tensor it makes has a shape
set by the batch, ``num_experts_per_tok`` and the layer's sizes, not by which experts the router
picks, so a trace without values measures it for any routing (equal to the meter's real step, to
the byte). Two things stand in the way, both handled here:

* PyTorch 2.13's fake kernel of ``aten._grouped_mm`` accepts bf16 only (it checks what the CUDA
  kernel takes), where the CPU runs fp32 too: fp32 experts (full fine-tuning's master weights,
  an fp32 checkpoint) are given the output the kernel returns - contiguous, of the shape its
  meta function gives - without the check (:class:`GroupedMMInAnyDtype`); its backward is two more
  ``_grouped_mm`` calls, given theirs alike.
* The ``eager`` implementation picks each expert's tokens by the router's values (``nonzero``:
  shapes that depend on the data); it is refused naming the implementations a trace can follow.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..._unwrap import PeftWrapper
from ...record import unwrap_model
from ..estimate.depth import text_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["GroupedMMInAnyDtype", "experts_on_fake_tensors"]

# Transformers' experts implementations whose tensors' shapes do not depend on the routing.
TRACEABLE = ("grouped_mm", "batched_mm")


def experts_on_fake_tensors(net: nn.Module, config: PretrainedConfig) -> contextlib.AbstractContextManager[object]:
    """What a trace of ``net`` runs under: nothing for a model without experts; for a mixture of
    experts, ``torch._grouped_mm`` in any dtype (:class:`GroupedMMInAnyDtype`).

    Raises:
        ValueError: its experts run an implementation whose shapes depend on the routing (``eager``)
            or that runs only on a GPU; the message names the field and the ones a trace follows.
    """
    inner = cast(PeftWrapper, net).get_base_model() if callable(getattr(net, "get_base_model", None)) else net
    model = unwrap_model(inner)
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if not (callable(can_set) and can_set()):
        return contextlib.nullcontext()
    _check_routing(config)
    used = getattr(getattr(model, "config", None), "_experts_implementation", None) or "grouped_mm"
    if used not in TRACEABLE:
        raise ValueError(
            f"the estimator cannot trace {type(model).__name__} ({type(config).__name__}) with "
            f"experts_implementation={used!r}: "
            + (
                "its experts pick their tokens by the router's values (shapes that depend on the data, which a trace "
                "without values cannot follow)"
                if used == "eager"
                else "that implementation's kernels run only on a GPU"
            )
            + f". It traces {' and '.join(repr(t) for t in TRACEABLE)} (Transformers' default is 'grouped_mm', whose "
            "memory does not depend on the routing): model.set_experts_implementation('grouped_mm'), or "
            "from_pretrained(..., experts_implementation='grouped_mm'); or measure the model as it is with "
            "hf_memstack.measure_step or find_batch_size"
        )
    return GroupedMMInAnyDtype()


def _check_routing(config: PretrainedConfig) -> None:
    """Experts per token between 1 and the experts there are: else the router's top-k fails inside
    the trace with PyTorch's own words (a config typo, not a bug to report)."""
    text = text_config(config)
    experts_field = next((f for f in _EXPERTS_FIELDS if isinstance(getattr(text, f, None), int)), None)
    k_field = next((f for f in _TOP_K_FIELDS if isinstance(getattr(text, f, None), int)), None)
    if experts_field is None or k_field is None:
        return
    experts, k = getattr(text, experts_field), getattr(text, k_field)
    if experts < 1 or not 1 <= k <= experts:
        raise ValueError(
            f"model= a {type(config).__name__} with {experts_field}={experts} and {k_field}={k}: each token is routed to "
            f"{k_field} of the {experts_field} experts, so "
            + (f"{experts_field} must be at least 1" if experts < 1 else f"{k_field} must be between 1 and {experts}")
            + "; fix the config "
            "(config.json's fields of those names)"
        )


# The config fields Transformers' mixtures of experts name their experts and experts per token by.
_EXPERTS_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_k")


class GroupedMMInAnyDtype(TorchDispatchMode):
    """``aten._grouped_mm`` on fake tensors of any dtype: the output the CPU kernel returns (its meta
    function's shape, contiguous, in the inputs' dtype or ``out_dtype``), where PyTorch's fake kernel
    accepts bf16 alone. Other calls, and bf16 ones, go on as they are. Entered inside the fake mode
    and below the memory tracker, so the tracker sees the output as any other."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        a, b = args[0], args[1]
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        size: tuple[int, ...]
        if a.dim() == 2 and b.dim() == 2:  # a weight gradient: one matrix per group
            size = (offs.size(0), a.size(0), b.size(1))
        elif a.dim() == 2:  # the routed rows times each expert's matrix
            size = (a.size(0), b.size(-1))
        elif b.dim() == 2:
            size = (a.size(1), b.size(1))
        else:  # batched
            size = (a.size(0), a.size(1), b.size(-1))
        return torch.empty(size, dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)
