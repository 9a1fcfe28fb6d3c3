"""Mixed precision: resolve the policy's precision for a device, check the hardware, and run the
model's forward under autocast with fp32 outputs (Accelerate's recipe), so that a plain
``loss.backward()`` loop works for fp32 and bf16, and fp16 adds a GradScaler.

The autocast goes around the outer forward, as Accelerate's does. Code that replaces
``model.forward`` afterwards and calls the backbone itself (TRL's fused LM head) would run
outside it: a guard on the backbone refuses such a training forward instead of letting it
compute in fp32 under a bf16 record, and :func:`restore_autocast` puts the autocast back
around the replaced forward (the Trainer callback does)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from ..._device import device_of
from ..._unwrap import record_of, unwrap_model
from .._wrappers import AutocastForward, forward_wrapper, fused_lm_head_installed

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "AutocastBypassGuard",
    "ResolvedPrecision",
    "apply_precision",
    "check_accelerator_precision",
    "cpu_has_native_bf16",
    "resolve_precision",
    "restore_autocast",
    "precision_policy_problems",
    "verify_precision",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Accelerate's names for the same settings.
ACCELERATE_NAMES = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True, slots=True)
class ResolvedPrecision:
    """The precision that will run, on which device type, and why."""

    name: str  # fp32 | bf16 | fp16
    dtype: torch.dtype
    device_type: str
    reason: str

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 on CPU is emulated and ~2x slower than fp32 (pytorch#86270)."""
    probes = [getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None)]
    return any(p() for p in probes if p is not None)


def resolve_precision(requested: str, device: torch.device | str) -> ResolvedPrecision:
    """Turn ``fp32|bf16|fp16|auto`` into the precision that runs on ``device``.

    ``auto`` picks bf16 where the device runs it natively, else fp16 on CUDA, else fp32.

    Raises:
        RuntimeError: the device has no autocast for the requested dtype, or bf16 on a CUDA GPU without it.
    """
    device = torch.device(device)
    dt = device.type
    if requested == "auto":
        if dt == "cuda":
            if torch.cuda.is_bf16_supported():
                return ResolvedPrecision(
                    "bf16", torch.bfloat16, dt, f"auto: {torch.cuda.get_device_name(device)} supports bf16"
                )
            return ResolvedPrecision(
                "fp16",
                torch.float16,
                dt,
                f"auto: {torch.cuda.get_device_name(device)} has no bf16; fp16 with a GradScaler",
            )
        if dt == "cpu":
            if cpu_has_native_bf16():
                return ResolvedPrecision("bf16", torch.bfloat16, dt, "auto: this CPU has native bf16 (AVX512-BF16/AMX)")
            return ResolvedPrecision(
                "fp32", torch.float32, dt, "auto: this CPU has no native bf16 (bf16 would be ~2x slower than fp32)"
            )
        return ResolvedPrecision(
            "fp32", torch.float32, dt, f"auto: no mixed-precision rule for device type {dt!r}; fp32"
        )

    dtype = _DTYPES[requested]
    if requested == "fp32":
        return ResolvedPrecision("fp32", dtype, dt, "requested")
    if not torch.amp.is_autocast_available(dt):
        raise RuntimeError(
            f"policy.precision={requested!r}: device type {dt!r} has no autocast; use precision='fp32' "
            "or move the model to a CUDA GPU or the CPU before prepare_model"
        )
    if dt == "cuda" and requested == "bf16" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(
            f"policy.precision='bf16': {torch.cuda.get_device_name(device)} does not support bf16; "
            "use precision='fp16' (autocast + GradScaler) or 'auto'"
        )
    reason = "requested"
    if dt == "cpu" and requested == "bf16" and not cpu_has_native_bf16():
        warnings.warn(
            "policy.precision='bf16' on a CPU without AVX512-BF16/AMX: bf16 is emulated and about 2x slower "
            "than fp32 here (pytorch#86270); use precision='auto' or 'fp32' for speed",
            stacklevel=3,
        )
        reason = "requested (this CPU has no native bf16: slower than fp32)"
    if dt == "cpu" and requested == "fp16":
        warnings.warn(
            "policy.precision='fp16' on CPU runs (PyTorch's CPU autocast + GradScaler) but no CPU has fast fp16 "
            "kernels and Accelerate refuses fp16 on CPU; use it to test an fp16 loop, and bf16 to go fast",
            stacklevel=3,
        )
        reason = "requested (CPU fp16: for testing, not speed)"
    return ResolvedPrecision(requested, dtype, dt, reason)


def check_accelerator_precision(precision: ResolvedPrecision, accelerator: Accelerator) -> None:
    """Raise if an Accelerator was created with a different mixed precision than the policy's.

    Raises:
        ValueError: the two disagree; the message says how to make them agree.
    """
    acc = str(getattr(accelerator, "mixed_precision", "no"))
    want = ACCELERATE_NAMES[precision.name]
    if acc != want:
        raise ValueError(
            f"policy.precision resolves to {precision.name!r} but the Accelerator has mixed_precision={acc!r}; "
            f"create it with Accelerator(mixed_precision={want!r}) or use a policy with precision matching {acc!r}"
        )


def apply_precision(model: nn.Module, precision: ResolvedPrecision) -> None:
    """Run ``model.forward`` under autocast in ``precision.dtype`` and return fp32 outputs.

    The parameters stay in their dtype (fp32 master weights for mixed precision); only the
    computation is autocast. This is what ``Accelerator.prepare`` does to a model, without
    creating Accelerate's global state, so it works in a notebook with no Accelerator. The
    forward keeps its signature, docstring, pickling and ``torch.compile``-ability. The
    backbone (``model.base_model``) gets an :class:`AutocastBypassGuard`.
    """
    if precision.mixed:
        model.forward = AutocastForward(model, dtype=precision.dtype)  # type: ignore[method-assign]
        backbone = getattr(model, "base_model", None)
        if isinstance(backbone, nn.Module) and backbone is not model:
            backbone.register_forward_pre_hook(AutocastBypassGuard(model, precision.dtype))


def restore_autocast(model: nn.Module) -> bool:
    """Put hf_memstack's autocast back around the prepared model's forward when it was replaced
    after :func:`prepare_model` by one that no longer goes through it (TRL's trainers install
    their fused LM head this way, in ``__init__``): the new forward then runs under the policy's
    autocast with fp32 outputs, as the old one did. ``model`` may be wrapped (PEFT, DDP).

    Returns:
        True when the autocast was put back; False when nothing was to do (the autocast is
        still in place, or the policy's precision is not applied by hf_memstack).
    """

    record = cast("_AutocastRecord | None", record_of(model))
    if record is None or record.autocast_by != "hf_memstack":
        return False
    inner = unwrap_model(model)
    if forward_wrapper(inner, AutocastForward) is not None:
        return False
    inner.forward = AutocastForward(inner, dtype=record.precision.dtype)  # type: ignore[method-assign]
    return True


class _AutocastRecord(Protocol):
    """What :func:`restore_autocast` reads of ``model.memstack`` (a :class:`hf_memstack.record.MemstackRecord`,
    whose module imports this one: it is typed here by what is read)."""

    @property
    def autocast_by(self) -> str: ...
    @property
    def precision(self) -> ResolvedPrecision: ...


class AutocastBypassGuard:
    """A forward pre-hook on the backbone of a model whose forward hf_memstack autocasts: a
    training forward (train mode, gradients on) that reaches the backbone outside an autocast
    of the policy's dtype would compute in fp32 while ``model.memstack`` records bf16/fp16, so
    it is refused, with the fixes. This happens when ``model.forward`` was replaced after
    ``prepare_model`` by code calling the backbone directly (TRL's fused LM head) and nothing
    autocasts around it. Under ``loss:chunked`` it also says, once, that TRL's head computes
    the loss instead of hf_memstack's. Costs a few attribute reads per forward; it is skipped
    inside a compiled graph (dynamo traces the autocast there)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model = model
        self.dtype = dtype
        self.told_chunked = False
        self.looked_at: object = None
        """The forward last looked at for TRL's fused head (looked at again only when it changes)."""
        self.probe: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if torch.compiler.is_compiling() or not (module.training and torch.is_grad_enabled()):
            return
        record = self.model.__dict__.get("memstack")
        if record is None or record.fsdp is not None:  # FSDP2 computes in its param_dtype anyway
            return
        if record.loss.mode == "chunked" and not self.told_chunked:
            self._tell_if_trl_head(record.policy.to_string())
        device_type = self._device_type(module)
        if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == self.dtype:
            return
        raise RuntimeError(
            f"a training forward reached {type(module).__name__} (the backbone of this model prepared with policy "
            f"{record.policy.to_string()!r}) outside hf_memstack's {record.precision.name} autocast: its matmuls would run in "
            f"fp32 while model.memstack says {record.precision.name}. model.forward was replaced after prepare_model by code "
            "that calls the backbone itself (TRL's fused LM head in SFTTrainer/DPOTrainer/GRPOTrainer does), or the backbone "
            "was called directly. Fix: pass callbacks=[hf_memstack.integrations.trainer.MemstackCallback()] to the trainer "
            "(it puts the autocast back around TRL's forward), or set "
            f"{record.precision.name}=True in the SFTConfig/TrainingArguments (Accelerate's autocast then wraps TRL's forward), "
            "or call hf_memstack.transforms.precision.apply.restore_autocast(model) after building the trainer; when calling the backbone "
            f"yourself, run it under torch.autocast({device_type!r}, dtype=torch.{str(self.dtype).removeprefix('torch.')})"
        )

    def _device_type(self, module: nn.Module) -> str:
        # One parameter, looked up once (device_of walks the module tree: ~30 us a call); it keeps
        # its identity when the model moves, so its device stays the model's.
        if self.probe is None:
            self.probe = next(module.parameters(), None)
        return self.probe.device.type if self.probe is not None else device_of(module).type

    def __getstate__(self) -> dict[str, object]:
        # The forward looked at and the probe are the model's own: a copy looks its own up again.
        return {**self.__dict__, "looked_at": None, "probe": None}

    def _tell_if_trl_head(self, policy: str) -> None:
        forward = self.model.__dict__.get("forward")
        if forward is self.looked_at:
            return
        self.looked_at = forward
        if fused_lm_head_installed(self.model):
            self.told_chunked = True
            warnings.warn(trl_replaces_chunked_loss(policy), stacklevel=3)


def trl_replaces_chunked_loss(policy: str) -> str:
    """What to tell a user whose ``loss:chunked`` policy trains under TRL's fused LM head."""
    return (
        f"policy {policy!r} has loss:chunked, but TRL's trainer computes the training loss with its own chunked LM head "
        "(model(..., fused_lm_head=True) calls the backbone and lm_head.weight directly), so hf_memstack's chunked loss "
        "does not run in training: TRL's head takes its place, and it never builds the full logits either. "
        "MemstackCallback's memory/peak_mib measures TRL's head; prepare the model without loss:chunked to silence this"
    )


def precision_policy_problems(inner: nn.Module, precision: ResolvedPrecision, autocast_by: str) -> list[str]:
    """verify's ``policy`` part for precision: no autocast was added on top of an fp32 policy."""
    # Accelerate's prepare sets _original_forward when it wraps the forward in its own autocast.
    if (
        "_original_forward" in inner.__dict__
        and autocast_by != "accelerator.prepare"
        and precision.name != "fp16"
        and not precision.mixed
    ):
        return [
            "accelerator.prepare (e.g. Trainer with bf16=True/fp16=True) added autocast to a model whose policy "
            "is fp32: it trains in mixed precision while model.memstack says fp32"
        ]
    return []


def verify_precision(
    precision: ResolvedPrecision, autocast_by: str, linear_dtypes: set[torch.dtype], loss_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """verify's ``precision`` check: under mixed precision, Linear layers computed in the autocast
    dtype and the loss came back in fp32 (under fp32, every Linear in fp32)."""
    p = precision
    dtypes = linear_dtypes
    if not dtypes:
        return True, f"{p.name}: the model has no nn.Linear to observe"
    if not p.mixed:
        return dtypes == {torch.float32}, f"fp32: Linear outputs in {sorted(map(str, dtypes))}"
    ok = p.dtype in dtypes and loss_dtype == torch.float32
    if autocast_by == "accelerator.prepare" and p.dtype not in dtypes:
        return (
            ok,
            f"Linear outputs {sorted(map(str, dtypes))}: autocast comes from accelerator.prepare(model); verify after it",
        )
    detail = f"Linear outputs in {sorted(map(str, dtypes))}, loss in {loss_dtype}"
    if p.dtype not in dtypes:
        detail += (
            f": no Linear computed in {p.name}; model.forward was probably replaced after prepare_model, dropping "
            "hf_memstack's autocast (with Trainer/TRL set bf16/fp16 in TrainingArguments to match the policy)"
        )
    return ok, detail
