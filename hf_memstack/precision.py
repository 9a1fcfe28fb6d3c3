"""Mixed precision: resolve the policy's precision for a device, check the hardware, and run the
model's forward under autocast with fp32 outputs (Accelerate's recipe), so that a plain
``loss.backward()`` loop works for fp32 and bf16, and fp16 adds a GradScaler."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._wrappers import AutocastForward

__all__ = ["ResolvedPrecision", "apply_precision", "check_accelerator_precision", "cpu_has_native_bf16", "resolve_precision"]

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
                return ResolvedPrecision("bf16", torch.bfloat16, dt, f"auto: {torch.cuda.get_device_name(device)} supports bf16")
            return ResolvedPrecision("fp16", torch.float16, dt, f"auto: {torch.cuda.get_device_name(device)} has no bf16; fp16 with a GradScaler")
        if dt == "cpu":
            if cpu_has_native_bf16():
                return ResolvedPrecision("bf16", torch.bfloat16, dt, "auto: this CPU has native bf16 (AVX512-BF16/AMX)")
            return ResolvedPrecision("fp32", torch.float32, dt, "auto: this CPU has no native bf16 (bf16 would be ~2x slower than fp32)")
        return ResolvedPrecision("fp32", torch.float32, dt, f"auto: no mixed-precision rule for device type {dt!r}; fp32")

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


def check_accelerator_precision(precision: ResolvedPrecision, accelerator: Any) -> None:
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
    forward keeps its signature, docstring, pickling and ``torch.compile``-ability.
    """
    if precision.mixed:
        model.forward = AutocastForward(model, dtype=precision.dtype)  # type: ignore[method-assign]
