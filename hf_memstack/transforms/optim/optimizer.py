"""make_optimizer: AdamW as the policy's optimizer rung says - fp32 or 8-bit moments, stepped after
the backward or inside it - so that the recipe, Trainer users and the estimator build the same thing.

Bytes per trainable parameter at the step (fp32 weights): AdamW 4 (weight) + 4 (gradient) + 8 (two
moments) = 16; 8-bit moments (torchao's ``AdamW8bit``: block-wise, 256 values per fp32 scale, tensors
under 4,096 values stay fp32) about 4 + 4 + 2 = 10; stepped in the backward the gradients are freed
one parameter at a time, so about 4 + 8 = 12, and both together about 6.

torchao was chosen for the 8-bit moments: it installs and runs on the CPU with our pinned PyTorch
(tested), is maintained by the PyTorch team and works with FSDP2's DTensors; bitsandbytes' CPU
optimizers are new and still have FSDP2 bugs (bnb#1633). torchao compiles its step per parameter
shape (tens of seconds once on a CPU; a few seconds on a GPU), and on a CPU its 8-bit step is slower
than fp32 AdamW's (it is memory that it saves, not time).
"""

from __future__ import annotations

import numbers
import warnings
import weakref
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ...policy import MemoryPolicy, OptimizerConfig
from ...record import record_of, unwrap_model
from ..precision.master_reconcile import reconcile_master_weights
from .bf16_adamw import BF16AdamW
from .eight_bit import _torchao_adamw
from .groups import ParamGroup, _check_hyperparameters, _param_groups, _tensor_of
from .in_backward import Factory, OptimizerInBackward, optimizer_in_backward_of

if TYPE_CHECKING:
    from ...policy.memory_policy import PolicyDict
    from ...record import MemstackRecord

__all__ = ["check_optimizer_policy", "check_training_settings", "make_optimizer"]


def check_optimizer_policy(cfg: OptimizerConfig) -> None:
    """Raise before anything is touched when the policy's optimizer cannot be built here.

    Raises:
        RuntimeError: ``state="8bit"`` and torchao is not installed (or does not import).
    """
    if cfg.state == "8bit":
        _torchao_adamw()


def check_training_settings(
    cfg: OptimizerConfig,
    *,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Raise when the training loop asks for what the optimizer rung cannot do; every problem at once.

    Stepping in the backward updates each parameter as soon as its gradient is complete, so it
    cannot sum gradients over micro-batches (pytorch#124523), clip them by their global norm (the
    norm needs every gradient, torchtune#1934) or let fp16's GradScaler skip a step on overflow.

    Raises:
        ValueError: naming each setting, its value and the fix (also, for any rung, a
            ``gradient_accumulation_steps`` that is not a positive integer, or a negative or nan ``max_grad_norm``).
    """
    _check_loop_values(gradient_accumulation_steps, max_grad_norm)
    if cfg.step != "in_backward":
        return
    problems = []
    if gradient_accumulation_steps != 1:
        problems.append(
            f"gradient_accumulation_steps={gradient_accumulation_steps}: each parameter is updated inside every "
            "backward, so gradients cannot be summed over micro-batches; use gradient_accumulation_steps=1 (a larger "
            "per-device batch, e.g. from find_batch_size) or policy.optimizer.step='after_backward'"
        )
    if max_grad_norm is not None and max_grad_norm > 0:
        problems.append(
            f"max_grad_norm={max_grad_norm}: clipping by the global norm needs every gradient before any "
            "update; set max_grad_norm=None (or 0) or policy.optimizer.step='after_backward'"
        )
    if grad_scaler is not None:
        problems.append(
            "a GradScaler (fp16): it must see every gradient before the step to skip it on overflow; use bf16 "
            "or policy.optimizer.step='after_backward'"
        )
    if problems:
        raise ValueError(
            "policy.optimizer.step='in_backward' cannot honour this training setup:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _check_loop_values(gradient_accumulation_steps: object, max_grad_norm: object) -> None:
    """A loop that accumulates 0 micro-batches never steps, and a negative clipping norm flips every gradient."""
    problems = []
    if (
        not isinstance(gradient_accumulation_steps, numbers.Integral)
        or isinstance(gradient_accumulation_steps, bool)
        or gradient_accumulation_steps < 1
    ):
        problems.append(
            f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be a positive integer (micro-batches "
            "per optimizer step), e.g. 1"
        )
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, numbers.Real)
        and not isinstance(max_grad_norm, bool)
        and cast(float, max_grad_norm) >= 0
    ):  # nan fails >= 0; cast: numbers.Real's stub declares < and <= only, and every Real compares with 0
        problems.append(
            f"max_grad_norm={max_grad_norm!r} must be None or a number >= 0 (0 or None: no clipping), e.g. 1.0"
        )
    if problems:
        raise ValueError("make_optimizer: " + "; ".join(problems))


def make_optimizer(
    model: nn.Module,
    policy: MemoryPolicy | str | PolicyDict | None = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    param_groups: list[ParamGroup] | None = None,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters of ``model``, as ``policy.optimizer`` says.

    Args:
        model: the (prepared) model; frozen parameters get no optimizer state.
        policy: the memory policy; default: the one ``prepare_model`` recorded on ``model`` (else fp32 AdamW).
        lr, betas, eps, weight_decay: AdamW's hyperparameters (per group when ``param_groups`` is given).
        param_groups: ``[{"params": [...], "weight_decay": 0.0}, ...]`` instead of every trainable parameter.
        gradient_accumulation_steps, max_grad_norm: what the training loop will do, checked against the
            optimizer (see :func:`check_training_settings`).

    Returns:
        ``torch.optim.AdamW`` (fp32), torchao's ``AdamW8bit`` (8-bit), or an
        :class:`OptimizerInBackward` holding one of those per parameter (``in_backward``): its
        ``step()`` and ``zero_grad()`` do nothing (the backward did the work), so the usual loop,
        the memory meter and the batch-size finder run unchanged.

    Raises:
        ValueError: settings the optimizer cannot honour; no trainable parameter.
        RuntimeError: 8-bit moments without torchao.
    """

    if not isinstance(model, nn.Module):
        raise TypeError(
            f"make_optimizer: model must be a torch.nn.Module (the prepared model), got {type(model).__name__}"
        )
    _check_hyperparameters(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
    # Plain floats for torch.optim (numpy scalars, or betas given as ints, which AdamW refuses).
    lr = lr if torch.is_tensor(lr) else float(lr)
    eps, weight_decay, betas = float(eps), float(weight_decay), (float(betas[0]), float(betas[1]))
    record = cast("MemstackRecord | None", record_of(model))  # the record prepare_model leaves is a MemstackRecord
    resolved = (
        MemoryPolicy.coerce(policy) if policy is not None else (record.policy if record is not None else MemoryPolicy())
    )
    cfg = resolved.optimizer
    if record is not None and (cfg, resolved.master_weights) != (record.policy.optimizer, record.policy.master_weights):
        raise ValueError(
            f"make_optimizer(policy={resolved.to_string()!r}) asks for optimizer {_describe(cfg, resolved.master_weights)}, "
            f"but the model was prepared with {record.policy.to_string()!r} "
            f"({_describe(record.policy.optimizer, record.policy.master_weights)}); drop the policy argument (the "
            "optimizer then follows the model's policy), or prepare the model with the optim: and weights: tokens you want"
        )
    grad_scaler = record.grad_scaler if record is not None else None
    check_training_settings(
        cfg,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_grad_norm=max_grad_norm,
        grad_scaler=grad_scaler,
    )
    check_optimizer_policy(cfg)
    # What trains is known now: the master weights follow it (a base frozen after prepare_model goes back to its dtype).
    reconcile_master_weights(model)
    defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    groups = _param_groups(model, param_groups, defaults)
    params = [
        cast(torch.Tensor, _tensor_of(item)) for g in groups for item in g["params"]
    ]  # _param_groups checked them
    _check_master_dtype(params, resolved.master_weights)
    if cfg.step == "in_backward":
        _check_in_backward_parameters(params)
    factory = _factory(cfg, resolved.master_weights)
    if cfg.step == "after_backward":
        return factory(groups, defaults)
    previous = optimizer_in_backward_of(model)
    if previous is not None:  # e.g. a notebook cell run twice: the old hooks would keep stepping with the old optimizer
        previous.remove_hooks()
        warnings.warn(
            "make_optimizer: this model already had an optimizer stepping in the backward; its hooks were removed and "
            "the new optimizer replaces it (do not use the old one)",
            stacklevel=2,
        )
    optimizer = OptimizerInBackward(groups, factory, defaults, names={p: n for n, p in model.named_parameters()})
    # verify() finds it here, to pause it: a check must not update the weights.
    unwrap_model(model).__dict__["_memstack_optimizer_in_backward"] = weakref.ref(optimizer)
    return optimizer


def _describe(cfg: OptimizerConfig, master_weights: str = "fp32") -> str:
    return f"state={cfg.state!r}, step={cfg.step!r}, master_weights={master_weights!r}"


def _check_master_dtype(params: list[torch.Tensor], master_weights: str) -> None:
    """Stochastic rounding writes bf16 values: over fp32 weights it would round them to bf16 at every
    step (refused). Plain AdamW over 16-bit weights loses the updates below their resolution (warned)."""
    if master_weights == "bf16":
        other = [p for p in params if p.is_floating_point() and p.dtype != torch.bfloat16]
        if other:
            raise ValueError(
                f"make_optimizer: policy.master_weights='bf16' (AdamW with bf16 stochastic rounding), but {len(other)} trainable "
                f"parameter(s) are {other[0].dtype} (the first of shape {tuple(other[0].shape)}): rounding them to bf16 at every "
                "step would lose their precision silently. Prepare the model with the policy first (prepare_model casts its "
                "trainable parameters to bf16; adapters added after prepare_model are PEFT's fp32: cast them with "
                "model.to(torch.bfloat16) or use 'weights:fp32')"
            )
        return
    sixteen = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]
    if sixteen:
        warnings.warn(
            f"make_optimizer: {len(sixteen)} trainable parameter(s) are {sixteen[0].dtype} and the policy keeps fp32 master "
            "weights: plain AdamW over 16-bit weights rounds away every update smaller than their resolution. Prepare the "
            "model with a mixed-precision policy ('bf16': prepare_model casts them to fp32), or train pure bf16 with "
            "stochastic rounding ('bf16+weights:bf16')",
            stacklevel=3,
        )


def _check_in_backward_parameters(params: list[torch.Tensor]) -> None:
    """Each parameter gets a hook that fires when its gradient is complete: a frozen one never has a
    gradient (and torch refuses the hook)."""
    frozen = [p for p in params if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"make_optimizer: param_groups holds {len(frozen)} frozen parameter(s) (requires_grad=False, the first "
            f"of shape {tuple(frozen[0].shape)}); policy.optimizer.step='in_backward' steps each parameter when its "
            "gradient is complete, and these have none: leave them out of param_groups, or unfreeze them first"
        )
    _check_not_replicated(params)


def _check_not_replicated(params: list[torch.Tensor]) -> None:
    """Stepping in the backward under DDP would update each replica with its own, not yet averaged,
    gradient: DDP's all-reduce finishes after the parameter's gradient hook has run. FSDP2's sharded
    parameters get their reduced gradient before the hook, so they are fine."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and not any(isinstance(p, DTensor) for p in params)
    ):
        raise ValueError(
            f"policy.optimizer.step='in_backward' on {dist.get_world_size()} processes without FSDP: under DDP each rank would "
            "step with its own gradient before the all-reduce averages it, and the replicas would drift apart; shard the "
            "model (policy 'fsdp', whose reduced gradients arrive before the step) or use policy.optimizer.step='after_backward'"
        )


def _factory(cfg: OptimizerConfig, master_weights: str = "fp32") -> Factory:
    if master_weights == "bf16" and cfg.state == "fp32":
        return lambda groups, defaults: BF16AdamW(groups, **defaults)
    if cfg.state == "8bit":
        adamw = _torchao_adamw()
        rounding = {"bf16_stochastic_round": True} if master_weights == "bf16" else {}
        return lambda groups, defaults: adamw(groups, **defaults, **rounding)
    # PyTorch's own defaults (foreach on CUDA, a loop on the CPU): what a hand-written loop gets;
    # the estimator traces this same optimizer, foreach when it estimates for CUDA (device=).
    return lambda groups, defaults: torch.optim.AdamW(groups, **defaults)
