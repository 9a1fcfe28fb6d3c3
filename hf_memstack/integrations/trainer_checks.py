"""Do the Trainer's arguments and optimizer agree with the policy the model was prepared with?

Trainer has its own switches for what a policy already does (bf16/fp16, gradient checkpointing,
torch_compile, fsdp) and builds plain AdamW unless given an optimizer: applied twice or against
the policy, they change training silently. These checks refuse the contradictions, each with its
fix, and warn about the harmless repeats, before any step runs.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import TrainingArguments

from ..record import MemstackRecord, record_of
from ..transforms.checkpointing.apply import CheckpointingGuard
from ..transforms.optim.bf16_adamw import rounds_stochastically
from ..transforms.optim.in_backward import OptimizerInBackward
from .trainer_sequence import sequence_parallel_problems

__all__ = ["check_optimizer", "check_training_arguments"]

# transformers >= 5.20 names it activation_checkpointing (gradient_checkpointing is a deprecated alias).
_CHECKPOINTING_FIELD = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def check_training_arguments(model: nn.Module, args: TrainingArguments) -> list[str]:
    """Compare ``args`` (``TrainingArguments`` or a subclass such as TRL's ``SFTConfig``) with the
    policy ``model`` was prepared with.

    ``gradient_checkpointing=True`` without keyword arguments (TRL's default) over a policy that
    already checkpoints is accepted: the policy's checkpointing is kept, and Trainer's call to
    ``activation_checkpointing_enable`` changes nothing and says so once.

    Returns:
        Warnings for settings that repeat what the policy already does (harmless, but to drop).

    Raises:
        ValueError: every setting that contradicts the policy or would apply part of it a second
            time in a way that changes training (listed together, each with its fix, naming the
            arguments' class).
    """
    record = _record(model)
    cls = type(args).__name__
    problems: list[str] = sequence_parallel_problems(record, args)  # sp:N: what its arithmetic cannot honour
    repeats: list[str] = []
    _check_checkpointing_args(model, args, record, problems)
    _check_precision_args(args, record, problems)
    _check_optimizer_args(args, record, problems)
    if getattr(args, "torch_compile", False):
        if record.policy.compile.mode != "none":
            problems.append(
                f"{cls}.torch_compile=True would compile the model a second time; the policy "
                f"{record.policy.to_string()!r} already compiles it ({record.policy.compile.mode}): set torch_compile=False"
            )
        else:
            repeats.append(
                f"{cls}.torch_compile=True compiles the model outside its hf_memstack policy, which "
                "model.memstack does not record; prefer adding compile to the policy (e.g. "
                f"'{record.policy.to_string()}+compile:regional') and torch_compile=False"
            )
    if getattr(args, "fsdp", None):
        problems.append(
            f"{cls}.fsdp={args.fsdp!r}: Trainer's FSDP would shard a model hf_memstack already "
            "checkpointed (and maybe sharded) without knowing where its checkpoints are; set fsdp='' and train "
            "with fsdp in the policy through the recipe (recipes/finetune.py) or your own loop, under torchrun"
        )
    if record.policy.fsdp.mode != "none":
        # Found by a new-user trial: Accelerate wraps the model in DDP, which fails on the DTensors
        # fully_shard made ("aten.cat.default got mixed torch.Tensor and DTensor").
        problems.append(
            f"the policy shards the model (fsdp:{record.policy.fsdp.mode}), and Trainer (through Accelerate) would "
            "wrap it in DDP, which cannot hold FSDP2's sharded parameters; train it with "
            "the recipe (recipes/finetune.py) or your own loop under torchrun, or prepare the model without fsdp"
        )
    if problems:
        raise ValueError(
            f"{cls} contradicts the model's hf_memstack policy "
            f"{record.policy.to_string()!r}:\n  - " + "\n  - ".join(problems)
        )
    return repeats


def _record(model: nn.Module | None) -> MemstackRecord:
    record = record_of(model) if isinstance(model, nn.Module) else None
    if record is None:
        raise _not_prepared(model)
    return record


def _given_model(model: nn.Module | None) -> nn.Module:
    """The model a Trainer callback was given: Trainer passes its model to every callback, so only a
    direct call without one gets None, which raises the checks' own "not prepared" error."""
    if model is None:
        raise _not_prepared(model)
    return model


def _not_prepared(model: object) -> ValueError:
    return ValueError(
        f"the model ({type(model).__name__}) was not prepared by hf_memstack: call "
        "hf_memstack.prepare_model(model, policy) before building the Trainer"
    )


def _checkpointing_field(args: TrainingArguments) -> str:
    """The field to name in a fix: TRL's configs document ``gradient_checkpointing`` (default True);
    Transformers >= 5.20 names it ``activation_checkpointing``."""
    return "gradient_checkpointing" if _is_trl(args) else _CHECKPOINTING_FIELD


def _is_trl(args: TrainingArguments) -> bool:
    return type(args).__module__.startswith("trl.")


def _check_checkpointing_args(
    model: nn.Module, args: TrainingArguments, record: MemstackRecord, problems: list[str]
) -> None:
    enabled = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not enabled:
        return
    field = _checkpointing_field(args)
    setting = f"{type(args).__name__}({field}=True)"
    kwargs = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    every_n, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    guard = getattr(model, "activation_checkpointing_enable", None)
    if not isinstance(guard, CheckpointingGuard):
        problems.append(
            f"{setting}, but {type(model).__name__} has no Transformers checkpointing API for Trainer to call; "
            f"checkpointing comes from the policy ({record.policy.to_string()!r}): set {field}=False"
        )
        return
    conflict = guard.conflict(
        kwargs or None,
        every_n_layers=every_n,
        offload=offload,
        caller=setting,
        fix=f"set {type(args).__name__}({field}=False)" + (" (TRL's configs default to True)" if _is_trl(args) else ""),
    )
    if conflict:
        problems.append(conflict)
    # Otherwise Trainer's call repeats the policy or asks for the default checkpointing over the
    # policy's own: the guard keeps the policy's and says so once, when Trainer calls it.


def _check_optimizer_args(args: TrainingArguments, record: MemstackRecord, problems: list[str]) -> None:
    """optim:in_backward updates each parameter inside the backward: what Trainer would do after it
    (clip by the global norm, accumulate micro-batches) cannot happen."""
    if record.policy.optimizer.step != "in_backward":
        return
    if (args.max_grad_norm or 0) > 0:
        problems.append(
            f"TrainingArguments.max_grad_norm={args.max_grad_norm}: the policy's optim:in_backward updates each "
            "parameter inside the backward, before a global gradient norm exists; set max_grad_norm=0"
        )
    if args.gradient_accumulation_steps != 1:
        problems.append(
            f"TrainingArguments.gradient_accumulation_steps={args.gradient_accumulation_steps}: with optim:in_backward "
            "every backward updates the weights, so gradients cannot be accumulated; set gradient_accumulation_steps=1 "
            "(a larger per_device_train_batch_size instead)"
        )


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise when the policy has an optimizer rung (optim:8bit, optim:in_backward, weights:bf16's
    stochastic rounding) and ``optimizer`` was not built for it: Trainer builds plain AdamW unless
    given one. Warn when a plain AdamW updates 16-bit weights (its small updates round away)."""
    record = _record(model)
    if optimizer is None:
        return
    cfg = record.policy.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    _check_holds_the_trainable(model, inner)
    fix = (
        "build it with the policy: Trainer(..., optimizers=(hf_memstack.make_optimizer(model, lr=args.learning_rate, "
        "weight_decay=args.weight_decay), None))"
    )
    if (cfg.state, cfg.step) != ("fp32", "after_backward"):
        built = (
            isinstance(inner, OptimizerInBackward)
            if cfg.step == "in_backward"
            else "8bit" in type(inner).__name__.lower()
        )
        if not built:
            raise ValueError(
                f"the policy {record.policy.to_string()!r} asks for an optimizer rung, but Trainer's optimizer is "
                f"{type(inner).__name__}; {fix}"
            )
    rounds = rounds_stochastically(inner)
    if record.policy.master_weights == "bf16" and not rounds:
        raise ValueError(
            f"the policy {record.policy.to_string()!r} trains pure bf16, which needs AdamW with bf16 stochastic "
            f"rounding, but Trainer's optimizer is {type(inner).__name__} (its updates below bf16's resolution "
            f"would round away); {fix}"
        )
    sixteen = [p for g in inner.param_groups for p in g["params"] if p.dtype in (torch.bfloat16, torch.float16)]
    if sixteen and not rounds:
        warnings.warn(
            f"Trainer's optimizer {type(inner).__name__} updates {len(sixteen)} {sixteen[0].dtype} parameter(s) without "
            "stochastic rounding: updates smaller than their resolution are lost. Prepare the model with a mixed "
            "precision policy (fp32 master weights), or 'bf16+weights:bf16' and " + fix,
            stacklevel=3,
        )


def _check_holds_the_trainable(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer built before PEFT added the adapters (TRL's ``peft_config``) holds the frozen base
    and none of what trains: the run would "succeed" and change nothing."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if trainable and len(missing) == len(trainable):
        raise ValueError(
            f"the optimizer given to Trainer holds none of the model's {len(trainable)} trainable parameters (e.g. {missing[0]!r}): "
            "it was built before they existed or trained - with TRL's peft_config, PEFT adds the adapters inside SFTTrainer, after "
            "make_optimizer saw the base. Add the adapters first (model = get_peft_model(model, config); prepare_model(model, "
            "policy); make_optimizer(model, ...)) and pass that model without peft_config"
        )


def _check_precision_args(args: TrainingArguments, record: MemstackRecord, problems: list[str]) -> None:
    cls = type(args).__name__
    asked = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    policy = record.precision.name
    if policy == "fp16" and record.precision.device_type == "cpu":
        # Accelerate creates neither an autocast nor a GradScaler for fp16 on the CPU
        # (accelerator.scaler is None): Trainer would run hf_memstack's fp16 autocast unscaled.
        problems.append(
            "the policy computes in fp16 on the CPU, where Accelerate (and so Trainer) creates no loss scaler "
            "(trainer.accelerator.scaler is None): fp16 gradients would underflow unscaled. Use a bf16 or fp32 "
            "policy on the CPU, train fp16 on a GPU (there fp16=True gives Trainer's GradScaler), or use your own "
            "loop with model.memstack.grad_scaler"
        )
        return
    if asked == "no":
        if policy == "fp16":
            problems.append(
                "the policy computes in fp16, which needs a loss scaler, and Trainer only creates one with "
                f"fp16=True: set {cls}(fp16=True)"
            )
        elif record.autocast_by == "accelerator.prepare":
            problems.append(
                f"the model was prepared for an Accelerator with mixed_precision={policy!r}; set "
                f"{cls}({policy}=True) so Trainer's Accelerator applies it"
            )
        return
    if policy == "fp32":
        problems.append(
            f"{cls}.{asked}=True autocasts a model whose policy is fp32; set {asked}=False, or "
            f"prepare the model with precision {asked!r} (e.g. '{asked}+ckpt')"
        )
    elif asked != policy:
        problems.append(
            f"{cls}.{asked}=True contradicts the policy's precision {policy!r}; set {asked}=False"
            + (" and fp16=True" if policy == "fp16" else "")
        )
    # The same precision in both is consistent: Trainer's autocast around the prepared model's own is
    # the same dtype twice, and it also covers code that bypasses model.forward (TRL's fused LM head).
