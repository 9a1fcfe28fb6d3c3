"""Which layers ``quant:nf4`` makes 4-bit, and the refusals about them: the ``nn.Linear`` layers of
the blocks, or those ``policy.quant.targets`` names (a PEFT wrapper's base layer in its place,
its adapters never); not a Conv1D, an embedding, a tied weight or a weight that trains; each of a
size the 4-bit blocks (and FSDP's shards) divide."""

from __future__ import annotations

from typing import cast

from torch import nn

from ...policy import QuantConfig
from .._peft import adapter_module_ids, base_layer_of, logical_name
from ..blocks import Blocks

__all__ = ["BNB_LOAD", "find_targets", "refuse_trainable_targets", "scaler_block_size"]

BNB_LOAD = "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))"


def find_targets(model: nn.Module, cfg: QuantConfig, blocks: Blocks | None) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers to quantize: the blocks' (default) or those ``cfg.targets`` names;
    PEFT's adapter layers never (they train), a PEFT wrapper's ``base_layer`` in its place."""
    adapters = adapter_module_ids(model)
    names = {id(m): n for n, m in model.named_modules()}
    if cfg.targets is None:
        if blocks is None:
            raise ValueError(
                f"policy.quant.mode='nf4' quantizes the linear layers of the repeated blocks, and {type(model).__name__} "
                "has no blocks hf_memstack can find; name the layers with policy.quant.targets (e.g. ['fc1', 'fc2']) "
                "or the blocks with policy.checkpointing.block_classes"
            )
        scope = [m for block in blocks.modules for m in block.modules() if id(m) not in adapters]
        odd = sorted(
            {
                f"{names[id(m)]} ({type(m).__name__})"
                for m in scope
                if _projection_like(m) and not isinstance(m, nn.Linear)
            }
        )
        if odd:
            raise ValueError(_unsupported(model, odd, "the blocks' projections"))
        found = [(names[id(m)], m) for m in scope if isinstance(m, nn.Linear)]
        if not found:
            raise ValueError(
                f"policy.quant.mode='nf4': the blocks of {type(model).__name__} hold no nn.Linear layer to quantize; "
                "name the layers with policy.quant.targets, or drop quant:nf4"
            )
        return _untied(model, found)
    return _untied(model, _named_targets(model, cfg.targets, adapters, names))


def _named_targets(
    model: nn.Module, targets: tuple[str, ...], adapters: set[int], names: dict[int, str]
) -> list[tuple[str, nn.Linear]]:
    found: dict[int, tuple[str, nn.Linear]] = {}
    for target in targets:
        hits = [
            m
            for n, m in model.named_modules()
            if id(m) not in adapters and (logical_name(n) == target or logical_name(n).endswith(f".{target}"))
        ]
        hits = [base_layer_of(m) for m in hits]
        if not hits:
            linear = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and id(m) not in adapters
                }
            )
            raise ValueError(
                f"policy.quant.targets: {target!r} matches no module of {type(model).__name__}; its linear layers are "
                f"named {linear[:12]}"
            )
        odd = sorted({f"{names[id(m)]} ({type(m).__name__})" for m in hits if not isinstance(m, nn.Linear)})
        if odd:
            raise ValueError(_unsupported(model, odd, f"policy.quant.targets {target!r}"))
        found.update((id(m), (names[id(m)], cast(nn.Linear, m))) for m in hits)  # odd refused any other kind
    return list(found.values())


def _unsupported(model: nn.Module, odd: list[str], what: str) -> str:
    return (
        f"policy.quant.mode='nf4': {what} in {type(model).__name__} include layers that are not nn.Linear ({', '.join(odd[:4])}"
        f"{' ...' if len(odd) > 4 else ''}): 4-bit weights run through F.linear only (torchao's NF4), so embeddings and "
        f"Transformers' Conv1D (GPT-2) cannot be quantized here. Load the model 4-bit with bitsandbytes ({BNB_LOAD}, which "
        "converts Conv1D) and drop quant:nf4, or set policy.quant.targets to nn.Linear layers only"
    )


def _untied(model: nn.Module, found: list[tuple[str, nn.Linear]]) -> list[tuple[str, nn.Linear]]:
    """A weight shared with another module (a head tied to the embeddings) cannot become 4-bit in one of them."""
    users: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        w = m.__dict__.get("_parameters", {}).get("weight")
        if w is not None:
            users.setdefault(id(w), []).append(n)
    tied = [(n, users[id(m.weight)]) for n, m in found if len(set(users.get(id(m.weight), []))) > 1]
    if tied:
        name, shared = tied[0]
        raise ValueError(
            f"policy.quant: {name!r} shares its weight with {[s for s in shared if s != name]} (tied weights): it cannot be "
            "4-bit in one and dense in the other; leave it out of policy.quant.targets"
        )
    return found


def refuse_trainable_targets(model: nn.Module, found: list[tuple[str, nn.Linear]]) -> None:
    """A model where every parameter trains is a base before its adapters (``get_peft_model`` after
    ``prepare_model`` freezes it): its quantized layers are frozen. Once anything is frozen, what
    trains was decided, and a trainable weight cannot become 4-bit."""
    if all(p.requires_grad for p in model.parameters()):
        return
    trainable = [n for n, m in found if m.weight.requires_grad]
    if trainable:
        raise ValueError(
            f"policy.quant.mode='nf4' would quantize weights that train ({', '.join(trainable[:3])}"
            f"{' ...' if len(trainable) > 3 else ''}), and 4-bit weights cannot train. Freeze them and train adapters on "
            "them (LoRA: peft.get_peft_model freezes the base), or leave them out with policy.quant.targets"
        )


def scaler_block_size(name: str, module: nn.Linear, block_size: int, shards: int) -> int:
    """Validate the layer's size against the blocks (and the shards) and pick its second-level block size."""
    rows, numel = module.out_features, module.weight.numel()
    if numel % block_size:
        raise ValueError(
            f"policy.quant.block_size={block_size}: {name!r} has {numel:,} weights ({tuple(module.weight.shape)}), not a "
            "multiple of the block size; use a block_size that divides it (e.g. 32) or leave the layer out with "
            "policy.quant.targets"
        )
    if rows % shards or (numel // shards) % block_size:
        raise ValueError(
            f"policy.quant with FSDP over {shards} ranks: {name!r} ({tuple(module.weight.shape)}) does not split into "
            f"{shards} shards of whole {block_size}-weight blocks; use a number of ranks that divides its "
            f"{rows} rows, or leave the layer out with policy.quant.targets"
        )
    per_shard = numel // block_size // shards
    return max(d for d in range(1, min(256, per_shard) + 1) if per_shard % d == 0)


def _projection_like(module: nn.Module) -> bool:
    """A layer with its own 2-D weight that is not a norm: a projection of another kind (Conv1D)."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return weight is not None and weight.dim() == 2 and not isinstance(module, nn.Embedding)
