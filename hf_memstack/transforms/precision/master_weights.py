"""apply_master_weights: the dtype the trainable parameters are kept and updated in
(``policy.master_weights``).

Transformers 5 loads a checkpoint in its saved dtype (``dtype="auto"``): a bf16 checkpoint comes
back bf16, and AdamW over bf16 weights rounds away every update smaller than half a bf16 step
(2^-8 relative) - the loss mixed precision exists to avoid. Two ways out, as the policy says:

* ``fp32`` (the default): under a mixed precision, the 16-bit trainable parameters are cast to
  fp32 master weights, and autocast computes in 16 bits from them - what a model loaded in fp32
  under Accelerate's or the Trainer's ``bf16=True`` trains as. PEFT's adapters are fp32 already
  (``autocast_adapter_dtype``); the frozen base is never cast.
* ``bf16`` (pure bf16, as torchtune trains on purpose): the trainable parameters are kept (or cast)
  in bf16, half the bytes of weights, gradients and AdamW's moments, and
  :func:`hf_memstack.make_optimizer` builds :class:`hf_memstack.transforms.optim.bf16_adamw.BF16AdamW` (AdamW with
  stochastic rounding): each update is computed in fp32 and rounded up or down at random, in
  proportion, so that it survives in expectation.

Each cast keeps the ``nn.Parameter`` object (tied weights stay tied) and runs before checkpointing,
compile and FSDP wrap the model. What trains may be decided after ``prepare_model`` (PEFT, TRL's
``peft_config``): the casts are recorded and reconciled with it where training starts, so that a
frozen parameter is never held upcast (:mod:`hf_memstack.transforms.precision.master_reconcile`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..._unwrap import unwrap_model
from ...policy import MemoryPolicy
from ..optim.bf16_adamw import warn_on_plain_steps_over_pure_bf16
from .master_reconcile import MasterWeightsLedger, ReconcileOnTrainingForward

__all__ = ["MasterWeightsPlan", "MasterWeightsResult", "apply_master_weights", "check_master_weights", "mark_pure_bf16"]

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True, slots=True)
class MasterWeightsResult:
    """What :func:`apply_master_weights` did."""

    mode: str
    """``fp32`` or ``bf16`` (the policy's ``master_weights``)."""
    cast: int = 0
    """Trainable parameters cast (0: they were in the master dtype already, or were left as loaded)."""
    cast_from: tuple[str, ...] = ()
    """The dtypes they had before."""
    ledger: MasterWeightsLedger | None = field(default=None, compare=False, repr=False)
    """The casts, reconciled with what trains when training starts (None: an unprepared model's default)."""

    def describe(self) -> str:
        kept = (
            "fp32 master weights"
            if self.mode == "fp32"
            else "pure bf16 (BF16AdamW, stochastic rounding: make_optimizer)"
        )
        if self.cast:
            kept += f"; {self.cast} trainable parameter(s) cast from {'/'.join(self.cast_from)} to {self.mode} by prepare_model"
        later = self.ledger.describe() if self.ledger is not None else ""
        return f"{kept}; {later}" if later else kept


@dataclass(frozen=True, kw_only=True, slots=True)
class MasterWeightsPlan:
    """The parameters to cast, found by the checks; casting them cannot fail."""

    mode: str
    dtype: torch.dtype
    params: tuple[nn.Parameter, ...] = ()
    trainable: tuple[nn.Parameter, ...] = ()
    """Every trainable parameter (pure bf16 marks them for the optimizer step check)."""
    cast_new: bool = False
    """16-bit parameters made trainable after prepare_model go to fp32 too (fp32 master weights under autocast)."""


def check_master_weights(
    model: nn.Module, policy: MemoryPolicy, *, mixed: bool, precision_name: str, before_adapters: bool
) -> MasterWeightsPlan:
    """Which trainable parameters to cast, and warnings for what is left as loaded.

    ``mixed``: the resolved precision autocasts. ``before_adapters``: every parameter trains because
    ``quant:nf4`` freezes the base only now and the adapters come next (their dtype is PEFT's).
    """
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]  # a tied parameter once
    if policy.master_weights == "bf16":
        # cast_new: adapters PEFT adds after prepare_model (fp32) train in bf16 too, as when PEFT came first.
        if before_adapters:  # the adapters PEFT adds next are what trains
            return MasterWeightsPlan(mode="bf16", dtype=torch.bfloat16, cast_new=True)
        return MasterWeightsPlan(
            mode="bf16",
            dtype=torch.bfloat16,
            params=tuple(p for p in trainable if p.dtype != torch.bfloat16),
            trainable=tuple(trainable),
            cast_new=True,
        )
    sixteen = [p for p in trainable if p.dtype in _SIXTEEN_BIT]
    if not sixteen or before_adapters:
        return MasterWeightsPlan(mode="fp32", dtype=torch.float32, cast_new=mixed)
    if mixed:
        return MasterWeightsPlan(mode="fp32", dtype=torch.float32, params=tuple(sixteen), cast_new=True)
    # Without autocast, fp32 master weights beside 16-bit frozen ones would meet in one matmul in two dtypes.
    warnings.warn(
        f"policy.precision={policy.precision!r}"
        + (f" (resolved to {precision_name!r} on this device)" if policy.precision != precision_name else "")
        + f" runs without autocast, and {len(sixteen)} trainable parameter(s) of "
        f"{type(model).__name__} are {sixteen[0].dtype}: they train in 16 bits, and AdamW's updates smaller than their "
        "resolution are lost. Use a mixed precision ('bf16': prepare_model keeps fp32 master weights), pure bf16 with "
        "stochastic rounding ('bf16+weights:bf16'), or load the model in fp32 (from_pretrained(..., dtype=torch.float32))",
        stacklevel=5,
    )
    return MasterWeightsPlan(mode="fp32", dtype=torch.float32)


def mark_pure_bf16(params: Iterable[nn.Parameter]) -> None:
    """Tag pure-bf16 trainable parameters for the optimizer step check (a plain optimizer stepping
    them warns once). FSDP2's ``fully_shard`` replaces every parameter with a sharded one, which
    ``prepare_model`` tags again."""
    for p in params:
        p._memstack_pure_bf16 = True  # type: ignore[attr-defined]  # read by the optimizer step check
    warn_on_plain_steps_over_pure_bf16()


def apply_master_weights(
    plan: MasterWeightsPlan, model: nn.Module | None = None, *, sharded: bool = False
) -> MasterWeightsResult:
    """Cast the planned parameters in place (the same ``nn.Parameter`` objects, so ties hold). With
    ``model``: record the casts, to be reconciled with what trains (``sharded``: FSDP will shard it,
    after which they stay), first at its first training forward."""
    before = tuple(sorted({str(p.dtype).removeprefix("torch.") for p in plan.params}))
    ledger = None
    if model is not None:
        ledger = MasterWeightsLedger(model, dtype=plan.dtype, cast_new=plan.cast_new, sharded=sharded)
        ledger.record(plan.params)
        # The innermost model's backbone (a Transformers model's ``base_model``): PEFT's wrappers and TRL's
        # fused head call the models around it by their forward, past their hooks, but this one by __call__.
        inner = unwrap_model(model)
        backbone = getattr(inner, "base_model", None)
        target = backbone if isinstance(backbone, nn.Module) and backbone is not inner else inner
        target.register_forward_pre_hook(ReconcileOnTrainingForward(ledger))
    with torch.no_grad():
        for p in plan.params:
            p.data = p.data.to(plan.dtype)
    if plan.mode == "bf16":
        mark_pure_bf16(plan.trainable)
    return MasterWeightsResult(mode=plan.mode, cast=len(plan.params), cast_from=before, ledger=ledger)
