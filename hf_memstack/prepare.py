"""prepare_model: validate a policy against a model and the machine, then apply checkpointing,
precision, compile and sharding in one fixed order."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._device import device_of, shard_device
from .blocks import Blocks, find_blocks
from .checkpointing import apply_checkpointing, uses_transformers_checkpointing
from .compile import CompileStats, apply_compile, check_backend
from .fsdp import apply_fsdp, check_accelerate_fsdp, check_fsdp_launch
from .policy import MemoryPolicy
from .precision import ResolvedPrecision, apply_precision, check_accelerator_precision, resolve_precision

__all__ = ["MemstackRecord", "describe", "prepare_model"]


@dataclass(slots=True)
class MemstackRecord:
    """What prepare_model applied; kept on the model as ``model.memstack``."""

    policy: MemoryPolicy
    precision: ResolvedPrecision
    autocast_by: str
    """``hf_memstack`` (the forward is wrapped here), ``accelerator.prepare`` or ``none`` (fp32)."""
    grad_scaler: torch.amp.GradScaler | None
    """fp16 without an Accelerator: scale the loss with it (see the README's fp16 loop)."""
    blocks: Blocks | None
    checkpointing: dict[str, Any]
    compile: CompileStats
    fsdp: dict[str, Any] | None
    prepare_seconds: float
    kv_cache_disabled: bool = False
    """``model.config.use_cache`` was turned off: training never reads the KV cache."""

    def describe(self) -> str:
        lines = [f"hf_memstack policy: {self.policy.to_string()}"]
        p = self.precision
        lines.append(f"  precision: {p.name} on {p.device_type} ({p.reason}); autocast by {self.autocast_by}"
                     + ("; GradScaler: model.memstack.grad_scaler" if self.grad_scaler is not None else ""))
        if self.blocks is not None:
            lines.append(f"  blocks: {len(self.blocks)} x {'/'.join(self.blocks.class_names)} (from {self.blocks.source})")
        ck = self.checkpointing
        if ck["method"] != "none":
            lines.append(f"  checkpointing: {self.policy.checkpointing.mode} via {ck['method']}, blocks {ck['checkpointed']}"
                         + (f" ({ck['note']})" if ck["note"] else ""))
        else:
            lines.append("  checkpointing: off")
        co = self.policy.compile
        if co.mode != "none":
            lines.append(f"  compile: {co.mode} ({len(self.compile.regions)} region(s), backend {co.backend}); "
                         f"graphs compiled {self.compile.graphs_compiled}, compiled calls {self.compile.graph_calls}")
        else:
            lines.append("  compile: off")
        lines.append(f"  fsdp: {self.fsdp}" if self.fsdp else "  fsdp: off")
        if self.kv_cache_disabled:
            lines.append("  kv cache: model.config.use_cache set to False for training (generate() uses its generation_config)")
        lines.append(f"  prepare_model took {self.prepare_seconds * 1000:.0f} ms")
        return "\n".join(lines)


def prepare_model(
    model: nn.Module,
    policy: MemoryPolicy | str | dict[str, Any] | None = None,
    *,
    accelerator: Any | None = None,
) -> nn.Module:
    """Apply a memory policy to ``model`` in place and return it.

    Args:
        model: a Transformers ``PreTrainedModel`` or any ``nn.Module``, already on its device.
        policy: a :class:`MemoryPolicy`, a string such as ``"bf16+compile+ckpt"`` (a ladder preset
            or ``+``-joined features), a dict, or a YAML path. ``None`` means fp32.
        accelerator: an ``accelerate.Accelerator`` the model will go through. Its
            ``mixed_precision`` must match the policy; ``accelerator.prepare(model)`` then applies
            autocast (and fp16's GradScaler) and this function does not. If the Accelerator
            shards (Accelerate's FSDP, e.g. ``fsdp_plugin=accelerate_fsdp_plugin(policy, model)``),
            ``accelerator.prepare`` shards too; its plugin must be FSDP2 and agree with the policy.
            Under an fsdp policy with an Accelerator that does not shard (CPU, torchrun), this
            function shards and autocasts, and the model must not go through ``accelerator.prepare``.

    Returns:
        The same model, with ``model.memstack`` (:class:`MemstackRecord`) saying what was applied.

    Raises:
        PolicyError (ValueError): the policy is invalid.
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: the model was prepared already; the device, compile backend or launch
            (FSDP without a process group) cannot run the policy.
        ValueError: blocks are needed and cannot be found; the accelerator's precision differs.

    Every check runs before the model is changed: on error the model is untouched.
    """
    start = time.perf_counter()
    policy = MemoryPolicy.coerce(policy)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (e.g. from AutoModel*.from_pretrained), got {type(model).__name__}")
    previous = getattr(model, "memstack", None)
    if isinstance(previous, MemstackRecord):
        raise RuntimeError(
            f"this {type(model).__name__} was already prepared with policy {previous.policy.to_string()!r}; "
            "prepare_model applies a policy once. Load a fresh model (from_pretrained) to apply another policy"
        )

    # Pre-flight: everything that can fail is checked before the model is touched.
    # Under FSDP the ranks first agree on the policy and the model (one all-gather), and the model
    # runs where fully_shard moves it (this rank's GPU, or the CPU under gloo), not where it loaded.
    broadcast_from_rank0 = check_fsdp_launch(policy.fsdp, policy.to_dict(), model)
    sharded_by_accelerate = check_accelerate_fsdp(policy, accelerator)
    if broadcast_from_rank0 and sharded_by_accelerate:
        raise ValueError(
            "a rank holds the model on the meta device, but the Accelerator shards it (Accelerate's FSDP loads "
            "weights its own way): load the model with from_pretrained on every rank, or launch with torchrun"
        )
    precision = resolve_precision(policy.precision, shard_device() if policy.fsdp.mode != "none" else device_of(model))
    if accelerator is not None:
        check_accelerator_precision(precision, accelerator)
    check_backend(policy.compile)
    ck = policy.checkpointing
    needs_blocks = (
        (ck.mode != "none" and not uses_transformers_checkpointing(model, ck))
        or policy.compile.mode == "regional"
        or policy.fsdp.mode != "none"
    )
    blocks = find_blocks(model, ck.block_classes) if needs_blocks else _find_blocks_or_none(model)
    if precision.mixed and any(p.requires_grad and p.dtype != torch.float32 for p in model.parameters()):
        warnings.warn(
            f"policy.precision={precision.name!r} is mixed precision, but the model's trainable parameters are "
            f"{next(p.dtype for p in model.parameters() if p.requires_grad)}: optimizer updates then lose precision. "
            "Load the model in fp32 (from_pretrained(..., dtype=torch.float32)) and let autocast compute in "
            f"{precision.name}",
            stacklevel=2,
        )

    # Training never reads the KV cache: building it costs memory and, under compile, a recompile
    # of the first block. Transformers only turns it off in checkpointed layers.
    kv_cache_disabled = bool(getattr(getattr(model, "config", None), "use_cache", False))
    if kv_cache_disabled:
        model.config.use_cache = False

    # The order matters (torchtitan's and Accelerate's FSDP2 order):
    # 1. checkpointing first, so compile and FSDP wrap the checkpointed blocks: a recompute then
    #    re-runs the compiled block, and FSDP's all-gather stays outside the checkpoint (else every
    #    recompute gathers the parameters again).
    checkpointing = apply_checkpointing(model, ck, blocks=blocks)
    # 2. precision: autocast goes around the root forward before compile, so a whole-model compile
    #    traces it instead of running outside the autocast region.
    #    An Accelerator applies it in accelerator.prepare, except to a model sharded here, which
    #    does not go through accelerator.prepare.
    autocast_by = "none"
    if precision.mixed:
        if accelerator is None or (policy.fsdp.mode != "none" and not sharded_by_accelerate):
            apply_precision(model, precision)
            autocast_by = "hf_memstack"
        else:
            autocast_by = "accelerator.prepare"
    # 3. compile, per block or whole, after checkpointing and before sharding.
    compile_stats = apply_compile(model, policy.compile, blocks=blocks)
    # 4. sharding last: FSDP2 shards each (checkpointed, compiled) block, then the root; or
    #    accelerator.prepare does, with the plugin built from this policy (accelerate_fsdp_plugin).
    fsdp = None
    if sharded_by_accelerate:
        fsdp = {"mode": policy.fsdp.mode, "by": "accelerator.prepare (Accelerate's FSDP2 plugin)"}
    elif policy.fsdp.mode != "none":
        assert blocks is not None
        fsdp = apply_fsdp(model, policy.fsdp, blocks=blocks, precision=precision, broadcast_from_rank0=broadcast_from_rank0)

    # fp16 needs a loss scaler. On FSDP2's sharded gradients (DTensors) torch.amp.GradScaler's
    # inf check is reduced over the mesh, so every rank skips the same steps (tested on 2 ranks).
    grad_scaler = None
    if precision.name == "fp16" and autocast_by == "hf_memstack":
        grad_scaler = torch.amp.GradScaler(precision.device_type)
    model.memstack = MemstackRecord(  # type: ignore[assignment]
        policy=policy,
        precision=precision,
        autocast_by=autocast_by,
        grad_scaler=grad_scaler,
        blocks=blocks,
        checkpointing=checkpointing,
        compile=compile_stats,
        fsdp=fsdp,
        prepare_seconds=time.perf_counter() - start,
        kv_cache_disabled=kv_cache_disabled,
    )
    return model


def describe(model: nn.Module) -> str:
    """A few lines saying what ``prepare_model`` applied to ``model``."""
    record = getattr(model, "memstack", None)
    if not isinstance(record, MemstackRecord):
        return f"{type(model).__name__}: not prepared by hf_memstack"
    return record.describe()


def _find_blocks_or_none(model: nn.Module) -> Blocks | None:
    try:
        return find_blocks(model)
    except ValueError:
        return None

