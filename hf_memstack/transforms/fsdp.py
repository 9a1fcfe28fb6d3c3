"""apply_fsdp: shard a model with PyTorch's FSDP2 (``fully_shard``) - each block, then the root -
with a mixed-precision policy derived from the memory policy's precision.

This is the step ``prepare_model`` composes; what a multi-rank run needs around it (the pre-flight
agreement, weights from rank 0, sharded checkpoints, Accelerate's plugin) is in ``distributed/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.mesh import device_mesh
from ..distributed.preflight import local_world_size
from ..distributed.weights import load_from_rank0
from ..policy import FSDPConfig
from .blocks import Blocks
from .precision.apply import ResolvedPrecision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

__all__ = ["FSDPResult", "apply_fsdp", "mixed_precision_policy", "reshard_after_forward"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPResult:
    """How the model was sharded."""

    mode: str
    """The policy's ``fsdp.mode``."""
    by: Literal["fully_shard", "accelerator.prepare"]
    """``fully_shard`` (hf_memstack sharded it) or ``accelerator.prepare`` (Accelerate's FSDP2 plugin will)."""
    world_size: int = 1
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    weights_from: Literal["each rank", "rank 0 broadcast", "accelerate"] = "each rank"
    """Where the weights in the shards came from."""

    def describe(self) -> str:
        if self.by == "accelerator.prepare":
            return f"{self.mode} by accelerator.prepare (Accelerate's FSDP2 plugin)"
        return (
            f"{self.mode} by fully_shard over {self.world_size} ranks, reshard_after_forward={self.reshard_after_forward}, "
            f"cpu_offload={self.cpu_offload}, weights from {self.weights_from}"
        )


def apply_fsdp(
    model: nn.Module,
    cfg: FSDPConfig,
    *,
    blocks: Blocks,
    precision: ResolvedPrecision,
    broadcast_from_rank0: bool = False,
) -> FSDPResult:
    """Shard ``model`` in place with ``fully_shard``: each block, then the root.

    Parameters are gathered in the policy's dtype for compute (bf16/fp16) while gradients are
    reduced in fp32; the sharded master parameters stay fp32. With ``broadcast_from_rank0`` (some
    rank built the model on the meta device), rank 0's weights fill every rank's shards afterwards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = reshard_after_forward(cfg)
    mp = mixed_precision_policy(precision)
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    mesh = _mesh(cfg, precision.device_type)
    # Rank 0 keeps references to its full tensors through sharding: they are what it broadcasts.
    full_state = model.state_dict() if broadcast_from_rank0 and dist.get_rank() == 0 else None
    for block in blocks.modules:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    # The root keeps the embeddings and head; it is not resharded after forward because its
    # parameters are needed again at the start of backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    _reshard_after_no_grad_forward(model)
    if broadcast_from_rank0:
        load_from_rank0(model, full_state, device=mesh.device_type)
    return FSDPResult(
        mode=cfg.mode,
        by="fully_shard",
        world_size=dist.get_world_size(),
        reshard_after_forward=reshard,
        cpu_offload=cfg.cpu_offload,
        weights_from="rank 0 broadcast" if broadcast_from_rank0 else "each rank",
    )


def _reshard_after_no_grad_forward(model: nn.Module) -> None:
    """A forward without gradients (evaluation, ``verify``, ``generate``) would leave the root's
    parameters unsharded (its ``reshard_after_forward=False`` keeps them for the backward, which
    never comes), and until the next backward ``model.parameters()`` then yields the unsharded
    tensors, not the DTensor shards: an optimizer built after an evaluation (measured on 2 gloo
    ranks) updated those and training went wrong from its first step. The root reshards after
    every forward without gradients (generation gathers its few root parameters once a token)."""

    def after(module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if not torch.is_grad_enabled():
            cast("FSDPModule", module).reshard()  # the hook is on the root, which fully_shard made an FSDPModule

    model.register_forward_hook(after)


def reshard_after_forward(cfg: FSDPConfig) -> bool:
    # shard_grad_op (ZeRO-2) keeps the gathered parameters from forward to backward.
    return cfg.reshard_after_forward if cfg.reshard_after_forward is not None else cfg.mode != "shard_grad_op"


def mixed_precision_policy(precision: ResolvedPrecision) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # Compute in the policy's dtype, reduce gradients in fp32: summing bf16 gradients over many
    # ranks loses precision (Accelerate's default FSDP2 policy reduces in the compute dtype).
    return MixedPrecisionPolicy(param_dtype=precision.dtype if precision.mixed else None, reduce_dtype=torch.float32)


def _mesh(cfg: FSDPConfig, device_type: str) -> DeviceMesh:
    world = dist.get_world_size()
    if cfg.mode == "hybrid_shard":
        local = local_world_size()
        return device_mesh(device_type, (world // local, local), ("replicate", "shard"))
    return device_mesh(device_type, (world,), ("shard",))
