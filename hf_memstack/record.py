"""The record ``prepare_model`` leaves on a model (``model.memstack``), and how to find it again
through the wrappers a model goes through after preparation: DDP (``.module``), ``torch.compile``
(``._orig_mod``), PEFT (``get_base_model()``) and Accelerate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from . import _unwrap
from ._unwrap import RecordBase, unwrap_model
from .policy import MemoryPolicy
from .transforms.blocks import Blocks
from .transforms.checkpointing.apply import CheckpointingResult
from .transforms.compile import CompileStats
from .transforms.fsdp import FSDPResult
from .transforms.loss_head.result import LossHeadResult
from .transforms.packed_attention import PackedAttentionResult
from .transforms.precision.apply import ResolvedPrecision
from .transforms.precision.master_weights import MasterWeightsResult
from .transforms.quant.apply import QuantResult
from .transforms.sequence_parallel.apply import SequenceParallelResult
from .transforms.tiled_mlp import TiledMLPResult

__all__ = ["MemstackRecord", "record_of", "unwrap_model"]

AutocastBy = Literal["hf_memstack", "accelerator.prepare", "none"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemstackRecord(RecordBase):
    """What :func:`hf_memstack.prepare_model` applied; kept on the model as ``model.memstack``."""

    policy: MemoryPolicy
    """A private copy of the policy as applied (changing the caller's policy object later changes nothing here)."""
    precision: ResolvedPrecision
    """The precision that runs, on which device, and why."""
    autocast_by: AutocastBy
    """Who applies autocast: ``hf_memstack`` (the forward is wrapped), ``accelerator.prepare`` or ``none`` (fp32)."""
    grad_scaler: torch.amp.GradScaler | None
    """fp16 without an Accelerator: scale the loss with it (see the README's fp16 loop)."""
    blocks: Blocks | None
    """The repeated blocks (None when the model has none and the policy needs none)."""
    checkpointing: CheckpointingResult
    """How checkpointing was applied and to which blocks."""
    compile: CompileStats
    """Compiled regions and live counters of graphs compiled and called."""
    fsdp: FSDPResult | None
    """How the model was sharded (None: not sharded)."""
    prepare_seconds: float
    """Wall time of ``prepare_model``."""
    kv_cache_disabled: bool = False
    """``model.config.use_cache`` was turned off: training never reads the KV cache."""
    loss: LossHeadResult = field(default_factory=lambda: LossHeadResult(mode="default"))
    """How the training loss of the output head is computed."""
    mlp: TiledMLPResult = field(default_factory=lambda: TiledMLPResult(mode="default"))
    """Whether and how each block's MLP runs over tiles of tokens."""
    packing_guard: bool = False
    """The forward refuses packed batches that would let samples attend to each other (:mod:`hf_memstack.data.boundaries`)."""
    attention: PackedAttentionResult = field(default_factory=PackedAttentionResult)
    """Whether SDPA runs per sample on packed rows (:mod:`hf_memstack.transforms.packed_attention`)."""
    chunkable_loss: bool = False
    """The model is a causal LM whose loss ``loss:chunked`` can compute (the ladder's first memory
    rung for it, when the policy does not chunk already)."""
    quant: QuantResult = field(default_factory=QuantResult)
    """Which linear layers hold 4-bit weights (quantized here or loaded so)."""
    master_weights: MasterWeightsResult = field(default_factory=lambda: MasterWeightsResult(mode="fp32"))
    """The dtype the trainable parameters are kept in, and how many were cast to it."""
    sequence_parallel: SequenceParallelResult = field(default_factory=SequenceParallelResult)
    """Whether and over how many ranks each row's tokens are sharded (``sp:N``, Ulysses attention)."""

    def describe(self) -> str:
        """A few lines saying what was applied, and how."""
        lines = [f"hf_memstack policy: {self.policy.to_string()}"]
        p = self.precision
        lines.append(
            f"  precision: {p.name} on {p.device_type} ({p.reason}); autocast by {self.autocast_by}"
            + ("; GradScaler: model.memstack.grad_scaler" if self.grad_scaler is not None else "")
        )
        if self.blocks is not None:
            lines.append(
                f"  blocks: {len(self.blocks)} x {'/'.join(self.blocks.class_names)} (from {self.blocks.source})"
            )
        ck = self.checkpointing
        if ck.method != "none":
            lines.append(
                f"  checkpointing: {self.policy.checkpointing.mode} via {ck.method}, blocks {list(ck.checkpointed)}"
                + (f" ({ck.note})" if ck.note else "")
            )
        else:
            lines.append("  checkpointing: off")
        co = self.policy.compile
        if co.mode != "none":
            lines.append(
                f"  compile: {co.mode} ({len(self.compile.regions)} region(s), backend {co.backend}); "
                f"graphs compiled {self.compile.graphs_compiled}, compiled calls {self.compile.graph_calls}"
            )
        else:
            lines.append("  compile: off")
        lines.append(f"  fsdp: {self.fsdp.describe()}" if self.fsdp else "  fsdp: off")
        lines.append(f"  loss: {self.loss.describe()}")
        lines.append(f"  4-bit base: {self.quant.describe()}")
        lines.append(f"  master weights: {self.master_weights.describe()}")
        if self.attention.applied:
            lines.append(f"  attention: {self.attention.describe()}")
        if self.sequence_parallel.applied:
            lines.append(f"  sequence parallel: {self.sequence_parallel.describe()}")
        if self.mlp.mode != "default":
            lines.append(f"  mlp: {self.mlp.describe()}")
        op = self.policy.optimizer
        if (op.state, op.step) != ("fp32", "after_backward"):
            lines.append(
                f"  optimizer: AdamW with {op.state} state, stepped {op.step.replace('_', ' ')} "
                "(build it with hf_memstack.make_optimizer(model, lr=...))"
            )
        if self.kv_cache_disabled:
            lines.append(
                "  kv cache: model.config.use_cache set to False for training (generate() uses its generation_config)"
            )
        lines.append(f"  prepare_model took {self.prepare_seconds * 1000:.0f} ms")
        return "\n".join(lines)


def record_of(model: nn.Module) -> MemstackRecord | None:
    """``model.memstack`` of the prepared model inside ``model`` (through DDP, compile, PEFT), or None."""
    record = _unwrap.record_of(model)
    # MemstackRecord is RecordBase's one subclass: the check narrows the type, it rejects nothing.
    return record if isinstance(record, MemstackRecord) else None
