"""The pre-flight checks prepare_model runs on the model itself, before any change: not prepared
already, no checkpointing, compile or optimizer set by hand, weights to apply the policy to; and the
warnings for a training setup that would train little or nothing. The policy's own checks live with
each transformation (``check_*`` next to ``apply_*``).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .policy import MemoryPolicy
from .record import record_of
from .transforms.blocks import Blocks, find_blocks, no_blocks_reason
from .transforms.optim.in_backward import optimizer_in_backward_of
from .transforms.quant.apply import QuantPlan

__all__ = [
    "TrainingInEvalModeCheck",
    "base_before_adapters",
    "check_not_prepared",
    "check_not_set_by_hand",
    "check_weights",
    "find_policy_blocks",
    "warn_on_training_setup",
]


def check_not_prepared(model: nn.Module) -> None:
    previous = record_of(model)
    if previous is not None:
        raise RuntimeError(
            f"this {type(model).__name__} (or the model it wraps) was already prepared with policy "
            f"{previous.policy.to_string()!r}; prepare_model applies a policy once, before any DDP/PEFT/compile wrapper "
            "sees it. Load a fresh model (from_pretrained) to apply another policy"
        )


def check_not_set_by_hand(model: nn.Module) -> None:
    """Checkpointing, compile or an optimizer stepping in the backward, applied before the policy,
    would stack with the policy's, or be misreported."""
    if optimizer_in_backward_of(model) is not None:
        raise ValueError(
            f"{type(model).__name__} already has an optimizer stepping in the backward (make_optimizer was called before "
            "prepare_model): build the optimizer after prepare_model, so that it follows the policy's optim: tokens"
        )
    checkpointed = [
        n or type(model).__name__
        for n, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True
    ]
    if checkpointed:
        raise ValueError(
            f"{type(model).__name__} already has activation checkpointing on ({len(checkpointed)} module(s), e.g. "
            f"{checkpointed[0]!r}: gradient_checkpointing_enable() was called): checkpointing is set by the policy. Call "
            "model.gradient_checkpointing_disable() (or load a fresh model) and put it in the policy, e.g. 'bf16+ckpt'"
        )
    _check_no_compile_wrapper(model)
    compiled = [
        n or "<the model>" for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None
    ]
    if compiled:
        raise ValueError(
            f"{type(model).__name__} is already compiled in place (module.compile() on {compiled[:3]}): compile is set by the "
            "policy, after checkpointing. Load a fresh model and put it in the policy, e.g. 'bf16+compile:regional'"
        )


def _check_no_compile_wrapper(model: nn.Module) -> None:
    """A ``torch.compile`` wrapper (``OptimizedModule``) around the model, or inside it (a PEFT model over a
    compiled base): it would trace the forward that checkpointing and the loss head change next, and
    verify would find compile applied outside the policy only after the fact."""
    wrappers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "OptimizedModule"]
    if not wrappers:
        return
    name, wrapper = wrappers[0]
    original = type(wrapper.__dict__.get("_modules", {}).get("_orig_mod")).__name__
    where = (
        f"this model is a torch.compile wrapper (OptimizedModule around {original})"
        if not name
        else f"this {type(model).__name__} holds a torch.compile wrapper at {name!r} (OptimizedModule around {original})"
    )
    fix = (
        f"call prepare_model on the {original} itself (model._orig_mod)"
        if not name
        else f"build the {type(model).__name__} on the {original} itself (not compiled), then call prepare_model on it"
    )
    raise ValueError(
        f"{where}: torch.compile was called before prepare_model, and compile must come after checkpointing and the "
        f"loss head. {fix[0].upper()}{fix[1:]}, then put compile in the policy (e.g. 'bf16+ckpt+compile' or "
        "'bf16+ckpt+compile:regional'), or call torch.compile on the model prepare_model returns"
    )


def check_weights(model: nn.Module, policy: MemoryPolicy) -> None:
    # Integer and 4-bit weights are checked with the rest of quantization (check_quant).
    if policy.fsdp.mode == "none" and any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device (no weights) and the policy does not shard: load the "
            "weights (from_pretrained) before prepare_model; only an fsdp policy fills meta ranks, from rank 0 "
            "(hf_memstack.distributed.from_pretrained_for_fsdp)"
        )


def base_before_adapters(model: nn.Module, quant: QuantPlan) -> bool:
    """A 16-bit base quantized before its adapters (get_peft_model comes next and freezes it): QLoRA's usual load."""
    return bool(quant.targets) and all(p.requires_grad for p in model.parameters())


def warn_on_training_setup(model: nn.Module, policy: MemoryPolicy, blocks: Blocks | None, quant: QuantPlan) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        warnings.warn(
            f"no parameter of {type(model).__name__} requires grad: nothing will train (a PEFT model with every adapter "
            "frozen?). Unfreeze what should train (requires_grad_(True), or the PEFT config) before training",
            stacklevel=4,
        )
    if base_before_adapters(model, quant):
        warnings.warn(
            f"policy.quant.mode='nf4' freezes the {len(quant.targets)} linear weights it makes 4-bit (4-bit weights cannot train): "
            "add LoRA adapters next (peft.get_peft_model(model, LoraConfig(...)), QLoRA's order), else only the other "
            "parameters (embeddings, norms, head) train; for a full fine-tune drop quant:nf4",
            stacklevel=4,
        )
    ck = policy.checkpointing
    if ck.mode == "every_n" and blocks is not None and ck.every_n >= len(blocks):
        warnings.warn(
            f"policy.checkpointing.every_n={ck.every_n} with {len(blocks)} blocks: only block 0 is checkpointed; use a smaller "
            "every_n (or 'ckpt' for every block)",
            stacklevel=4,
        )


def find_policy_blocks(model: nn.Module, policy: MemoryPolicy, *, needed: bool) -> Blocks | None:
    """The model's blocks (the override's, when the policy needs them), else None. A model with no
    blocks at all (a config with 0 layers) is refused under a token that works per block, even one
    applied through Transformers' API (``ckpt``): it would checkpoint nothing, and say nothing.

    Raises:
        ValueError: blocks are needed and cannot be found, or the model has none and a token needs them.
    """
    block_classes = policy.checkpointing.block_classes
    try:
        return find_blocks(model, block_classes if needed else None)
    except ValueError:
        reason = None if block_classes else no_blocks_reason(model)
        per_block = _per_block_tokens(policy)
        if reason is not None and per_block:
            tokens = " and ".join(repr(t) for t, _ in per_block)
            verbs = " or ".join(dict.fromkeys(v for _, v in per_block))
            raise ValueError(
                f"{type(model).__name__} has 0 blocks ({reason}), so the policy's {tokens} "
                f"{'has' if len(per_block) == 1 else 'have'} no block to {verbs}: "
                f"drop {tokens} from the policy {policy.to_string()!r}, or, if the model has repeated blocks hf_memstack "
                "does not find, name their class: MemoryPolicy(checkpointing={'mode': 'full', 'block_classes': ['MyBlock']})"
            ) from None
        if needed:
            raise
        return None


def _per_block_tokens(policy: MemoryPolicy) -> list[tuple[str, str]]:
    """The policy's features that work block by block: (its token, or ``policy.<field>.mode`` for a
    setting without one; what it does to each block)."""
    on = {  # the token's head: (on, its field, what it does to a block)
        "ckpt": (policy.checkpointing.mode != "none", "checkpointing", "checkpoint"),
        "compile": (policy.compile.mode == "regional", "compile", "compile"),
        "fsdp": (policy.fsdp.mode != "none", "fsdp", "shard"),
        "mlp": (policy.mlp.mode != "default", "mlp", "tile"),
        # without targets, nf4 quantizes the blocks' linear layers
        "quant": (policy.quant.mode != "none" and policy.quant.targets is None, "quant", "quantize"),
    }
    tokens = {t.partition(":")[0]: t for t in policy.to_string().split("+")[1:]}
    return [
        (tokens.get(head) or f"policy.{field}.mode={getattr(policy, field).mode!r}", verb)
        for head, (active, field, verb) in on.items()
        if active
    ]


class TrainingInEvalModeCheck:
    """A forward pre-hook: warns once when a forward that records gradients runs in eval mode,
    where checkpointing is off (and dropout too). Checked at that forward, not when the policy is
    applied: from_pretrained returns models in eval mode and Trainer (like the recipe) calls
    model.train() before its first step, so only a loop that really trains in eval mode hears it.
    A module-level class (not a closure), so prepared models still deep-copy and pickle."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.warned = False

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        # Inside a compiled graph the check would be traced (and break the graph): skipped there,
        # first, so that the graph guards on nothing of it.
        # Every module, not only this one: a PEFT wrapper around a model from from_pretrained trains, its model not.
        if (
            torch.compiler.is_compiling()
            or self.warned
            or not torch.is_grad_enabled()
            or all(m.training for m in module.modules())
        ):
            return
        self.warned = True
        warnings.warn(
            f"{self.name} is running a forward with gradients in eval mode: checkpointing (and dropout) only run in training "
            "mode, so this step keeps every activation; call model.train() before training (from_pretrained returns models "
            "in eval mode; transformers.Trainer and the recipe call it for you)",
            stacklevel=4,
        )
