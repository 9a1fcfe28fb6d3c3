"""verify's check of 4-bit base weights: after one forward + backward, which parameters are 4-,
16- and 32-bit, the layers recorded as 4-bit still are, none of them trains, and the adapters on
them got gradients."""

from __future__ import annotations

import torch
from torch import nn

from ...measure.accounting import tensor_bytes
from .._peft import adapters_on, is_tuner_layer, logical_name
from .apply import QuantResult, is_4bit

__all__ = ["verify_quant"]


def verify_quant(model: nn.Module, result: QuantResult) -> tuple[bool, str]:
    """After one forward + backward: the layers recorded as 4-bit still are (nothing replaced them
    with dense weights after ``prepare_model``), none of them trains, and the adapters on them got
    gradients; with the model's tensors counted as 4-, 16- and 32-bit. Returns (ok, detail)."""
    problems = []
    dense = [n for n, m in zip(result.names, result.layers) if not is_4bit(m.weight)]
    if dense:
        problems.append(
            f"{len(dense)} of the {len(result.layers)} 4-bit layers are no longer 4-bit (e.g. {dense[0]!r}): something "
            "replaced their weights with dense ones after prepare_model (hf_memstack.dequantize or merge_adapters, "
            "load_state_dict(..., assign=True) of a 16-bit checkpoint); train on the 4-bit model, merge after training"
        )
    trained = [n for n, m in zip(result.names, result.layers) if m.weight.requires_grad]
    if trained:
        problems.append(
            f"4-bit weights require grad ({trained[:3]}): they cannot train; freeze them (requires_grad_(False))"
        )
    adapters = adapters_on(model, {id(m) for m in result.layers})
    missing = [n for n, p in adapters if p.grad is None]
    if not any(is_tuner_layer(m) for m in model.modules()):
        problems.append(
            "the model has no adapters: its 4-bit weights are frozen, so only the other parameters (embeddings, "
            "norms, head) train; add LoRA adapters (peft.get_peft_model(model, LoraConfig(...)) after prepare_model), "
            "or drop quant:nf4 for a full fine-tune"
        )
    if missing:
        problems.append(f"adapters on the 4-bit layers got no gradient: {missing[:3]}")
    detail = f"{_census(model)}; adapters on the 4-bit layers: "
    detail += (
        f"{len(adapters) - len(missing)}/{len(adapters)} got gradients"
        if adapters
        else "none (the 4-bit layers stay as they are)"
    )
    return not problems, detail + ("" if not problems else ". " + "; ".join(problems))


def _census(model: nn.Module) -> str:
    """The parameters by width: 4-bit, 16-bit, 32-bit (each with its bytes and the kinds of tensors)."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {"4-bit": [], "16-bit": [], "32-bit": []}
    for name, p in model.named_parameters():
        width = "4-bit" if is_4bit(p) else f"{8 * p.element_size()}-bit"
        groups.setdefault(width, []).append((name, p))
    parts = []
    for width, members in groups.items():
        if not members:
            continue
        kinds = sorted({_kind(n) for n, _ in members})
        size = sum(tensor_bytes(p) for _, p in members)
        parts.append(
            f"{width}: {len(members)} tensor(s), {size / 2**20:.2f} MiB ({', '.join(kinds[:5])}{' ...' if len(kinds) > 5 else ''})"
        )
    return "; ".join(parts)


def _kind(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.default.weight`` -> ``lora_A``; ``...q_proj.base_layer.weight`` -> ``q_proj``."""
    parts = [
        p
        for p in logical_name(name.removesuffix(".weight").removesuffix(".bias")).split(".")
        if p not in ("default", "base_layer") and not p.isdigit()
    ]
    lora = next((p for p in parts if p.startswith("lora_")), None)
    return lora or (parts[-1] if parts else name)
