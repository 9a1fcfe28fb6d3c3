"""A 16-bit model from a 4-bit base and its LoRA adapters: dequantize the base, merge the adapters
into it, save (``merge_adapters``); or only dequantize (``dequantize``).

PEFT's own ``merge_and_unload`` cannot do this on a 4-bit base: on torchao's NF4 weights it fails
(it adds to ``weight.data``), and on bitsandbytes' it quantizes the merged weights back to 4 bits,
adding a second rounding. Here each merged weight is computed once, in fp32, from what training
saw - the dequantized 4-bit weight plus PEFT's own ``get_delta_weight`` of each active adapter -
and cast to the 16-bit dtype; PEFT's ``unload`` then removes the adapter layers. The merged model
computes what the 4-bit model with its adapters computed, up to that one cast::

    model = prepare_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), "bf16+quant:nf4")
    model = PeftModel.from_pretrained(model, "out/model")      # the adapters the recipe saved
    merge_adapters(model, dtype=torch.bfloat16).save_pretrained("merged")   # a plain 16-bit checkpoint
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from ._unwrap import peft_class
from .record import record_of
from .transforms._peft import base_layer_of, is_tuner_layer
from .transforms.quant.apply import _backend_of, four_bit_weight, unpack_bnb_weight

if TYPE_CHECKING:
    from bitsandbytes.nn import Params4bit
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["dequantize", "merge_adapters"]


# What this module calls on PEFT's and torchao's objects. nn.Module types an attribute it does not define
# as Tensor | Module, so the calls are typed through these (casts, after the checks that found them).
class _PeftModel(Protocol):
    def unload(self) -> nn.Module: ...


class _LoraLayer(Protocol):
    active_adapters: list[str]

    def get_delta_weight(self, adapter: str) -> torch.Tensor: ...


class _NF4Weight(Protocol):
    def get_original_weight(self) -> torch.Tensor: ...


def dequantize(model: nn.Module, *, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every 4-bit weight of ``model`` with a dense one in ``dtype``, in place: torchao's
    NF4 weights on the same ``nn.Linear``; bitsandbytes' ``Linear4bit`` modules by ``nn.Linear``
    layers. Returns ``model``. The dense weights are frozen, as the 4-bit ones were.

    Raises:
        TypeError: ``dtype`` is not a floating dtype.
    """
    _check_dtype(dtype)
    for parent, child, module in _four_bit_layers(model):
        dense = _dense_weight(module).to(dtype)
        if _backend_of(module.weight) == "torchao":
            module.weight = nn.Parameter(dense, requires_grad=False)
        else:
            setattr(parent, child, _linear(module, dense))
    return model


def merge_adapters(model: nn.Module, *, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Merge the active LoRA adapters of a PEFT ``model`` into its 4-bit base and return the base
    model, every floating parameter in ``dtype`` (a plain model: ``save_pretrained`` writes a 16-bit
    checkpoint). ``model`` is used up: its layers are replaced.

    Raises:
        TypeError: ``model`` is not a PEFT model, or ``dtype`` is not a floating dtype.
        ValueError: the model has no adapter left, or none of its adapters is active (``delete_adapter``
            removed the active one); an adapter PEFT cannot express as a weight delta here (DoRA, a LoRA bias).
    """
    _check_dtype(dtype)
    if not (peft_class(model) and hasattr(model, "unload")):
        raise TypeError(
            f"merge_adapters needs a PEFT model (peft.get_peft_model or PeftModel.from_pretrained), got "
            f"{type(model).__name__}; for a model without adapters use hf_memstack.dequantize(model)"
        )
    _check_active_adapters(model)
    record = record_of(model)
    for layer in [m for m in model.modules() if is_tuner_layer(m) and four_bit_weight(base_layer_of(m)) is not None]:
        _merge_into_base(layer, dtype)
    base = cast("_PeftModel", model).unload()
    dequantize(base, dtype=dtype)  # 4-bit layers that had no adapter
    for p in base.parameters():
        if p.dtype.is_floating_point:
            p.data = p.data.to(dtype)
    if record is not None and record.kv_cache_disabled:  # prepare_model turned the cache off for training only
        cast("PretrainedConfig", base.config).use_cache = True
    if record is not None and record.attention.applied:  # and ran SDPA per sample on packed rows
        cast("PreTrainedModel", base).set_attn_implementation("sdpa")
    return base


def _check_active_adapters(model: nn.Module) -> None:
    """Adapters to merge: PEFT keeps a deleted adapter's name as the active one (and then fails on it
    with ``KeyError``), and merging the adapters that are left but not active would merge nothing."""
    adapters = list(getattr(model, "peft_config", None) or {})
    try:
        active = [a for a in getattr(model, "active_adapters", None) or () if a in adapters]
    except (KeyError, AttributeError):  # the active adapter's config is gone
        active = []
    if not adapters:
        raise ValueError(
            f"merge_adapters: this {type(model).__name__} has no adapters left (peft_config lists none; delete_adapter "
            "removed the last), so there is nothing to merge. Load the adapters to merge (model.load_adapter(path, "
            "adapter_name='default')), or take the base model without them: base = model.unload(), then "
            "hf_memstack.dequantize(base) for a 4-bit base"
        )
    if not active:
        raise ValueError(
            f"merge_adapters: none of this {type(model).__name__}'s adapters {adapters} is active (delete_adapter removed "
            f"the active one), so nothing would be merged. Choose the adapter to merge: model.set_adapter({adapters[0]!r})"
        )


def _merge_into_base(layer: nn.Module, dtype: torch.dtype) -> None:
    """``layer.base_layer`` becomes a dense ``nn.Linear`` holding base + every active adapter's delta."""
    base = base_layer_of(layer)
    lora = cast("_LoraLayer", layer)  # a PEFT tuner layer: merge_adapters picked it with is_tuner_layer
    adapters = [a for a in lora.active_adapters if a in getattr(layer, "lora_A", {})]
    unmergeable = [
        a for a in adapters if getattr(layer, "use_dora", {}).get(a) or getattr(layer, "lora_bias", {}).get(a)
    ]
    if unmergeable:
        raise ValueError(
            f"adapter(s) {unmergeable} use DoRA or a LoRA bias, which merge_adapters does not merge; merge them with "
            "PEFT on a 16-bit base (load the base in bf16, PeftModel.from_pretrained, merge_and_unload)"
        )
    weight = _dense_weight(base).float()
    for adapter in adapters:
        weight += lora.get_delta_weight(adapter).float()
    layer.base_layer = _linear(base, weight.to(dtype))


def _four_bit_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, layer) for each layer holding a 4-bit weight."""
    out = []
    for parent in model.modules():
        for child, module in parent.named_children():
            if four_bit_weight(module) is not None:
                out.append((parent, child, module))
    return out


def _dense_weight(module: nn.Module) -> torch.Tensor:
    """The weight a 4-bit layer computes with, dense, in its dequantization dtype."""
    weight = module.weight
    if _backend_of(weight) == "torchao":
        return cast("_NF4Weight", weight).get_original_weight()
    import bitsandbytes.functional as bnbf  # present: the weight is one of its Params4bit

    params = cast("Params4bit", weight)
    # On a CPU with AVX512-BF16, Linear4bit's first no-grad eval forward repacks the codes into a
    # layout only its CPU kernel reads; dequantize_4bit on it gives garbage.
    unpack_bnb_weight(params)
    return bnbf.dequantize_4bit(params.data, params.quant_state)


def _linear(module: nn.Module, weight: torch.Tensor) -> nn.Linear:
    """A plain ``nn.Linear`` with ``weight`` and the layer's bias (frozen, as the 4-bit layer was)."""
    bias = getattr(module, "bias", None)
    linear = nn.Linear(
        weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype
    )
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(weight.dtype), requires_grad=bias.requires_grad)
    return linear


def _check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dtype={dtype!r} must be a floating torch dtype, e.g. torch.bfloat16 (a 16-bit merged model) or torch.float32"
        )
