"""Accelerate's FSDP2 path: the plugin built from the policy, and the check that an Accelerator
which shards the model itself agrees with it, so that ``accelerator.prepare`` shards as
:func:`~hf_memstack.transforms.fsdp.apply_fsdp` would."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..policy import MemoryPolicy
from ..transforms.blocks import find_blocks
from ..transforms.fsdp import mixed_precision_policy, reshard_after_forward
from ..transforms.precision.apply import resolve_precision

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from ..policy import MemoryPolicy

__all__ = ["accelerate_fsdp_plugin", "check_accelerate_fsdp"]


def accelerate_fsdp_plugin(
    policy: MemoryPolicy | str | dict[str, object] | None, model: nn.Module
) -> FullyShardedDataParallelPlugin:
    """Accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2)`` built from the policy, for
    ``Accelerator(fsdp_plugin=...)`` on GPUs: ``accelerator.prepare`` then shards the same blocks,
    with the same mixed precision (fp32 gradient reduction), offload and resharding as
    :func:`apply_fsdp`, and Accelerate's ``backward``, ``clip_grad_norm_`` and ``save_state`` (sharded)
    work as usual. Checkpointing stays with ``prepare_model`` (Transformers' own), so the plugin's
    ``activation_checkpointing`` is off.

    Raises:
        ValueError: the policy has no fsdp, asks for hybrid_shard (use torchrun and the direct path),
            or the model's blocks cannot be found.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    policy = MemoryPolicy.coerce(policy)
    cfg = policy.fsdp
    if cfg.mode == "none":
        raise ValueError("policy.fsdp.mode='none': an FSDP plugin needs a sharding policy, e.g. 'bf16+ckpt+fsdp'")
    if cfg.mode == "hybrid_shard":
        raise ValueError(
            "policy.fsdp.mode='hybrid_shard' is not built into an Accelerate plugin here (Accelerate needs a "
            "ParallelismConfig for it); launch with torchrun so prepare_model shards directly, or use 'fsdp' (full_shard)"
        )
    blocks = find_blocks(model, policy.checkpointing.block_classes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(blocks.class_names),
        reshard_after_forward=reshard_after_forward(cfg),
        mixed_precision_policy=mixed_precision_policy(resolve_precision(policy.precision, device)),
        cpu_offload=cfg.cpu_offload,
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=False,
        cpu_ram_efficient_loading=False,
    )


def check_accelerate_fsdp(policy: MemoryPolicy, accelerator: Accelerator | None) -> bool:
    """True when ``accelerator`` will shard the model itself (Accelerate's FSDP); then its plugin
    must be FSDP2 and agree with the policy.

    Raises:
        ValueError: the Accelerator shards but the policy has no fsdp, or its plugin disagrees.
    """
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    if accelerator is None or accelerator.distributed_type != DistributedType.FSDP:
        return False
    plugin = accelerator.state.fsdp_plugin
    fix = "build the plugin from the policy: Accelerator(fsdp_plugin=hf_memstack.distributed.accelerate_fsdp_plugin(policy, model))"
    if policy.fsdp.mode == "none":
        raise ValueError(
            "the Accelerator shards the model with FSDP (an FSDP launch config or plugin) but policy.fsdp.mode='none'; "
            "add fsdp to the policy (e.g. 'bf16+ckpt+fsdp') so checkpointing and compile are placed inside the shards, "
            "or launch with a DDP config (recipes/configs/multi-gpu-ddp.yaml)"
        )
    problems = []
    if plugin.fsdp_version != 2:
        problems.append(f"fsdp_version={plugin.fsdp_version} (hf_memstack composes with FSDP2 only: fsdp_version: 2)")
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) != policy.fsdp.cpu_offload:
        problems.append(
            f"cpu_offload={type(plugin.cpu_offload).__name__} but policy.fsdp.cpu_offload={policy.fsdp.cpu_offload}"
        )
    if plugin.fsdp_version == 2 and plugin.reshard_after_forward != reshard_after_forward(policy.fsdp):
        problems.append(
            f"reshard_after_forward={plugin.reshard_after_forward} but policy.fsdp gives {reshard_after_forward(policy.fsdp)}"
        )
    if problems:
        raise ValueError(f"the Accelerator's FSDP plugin disagrees with the policy: {'; '.join(problems)}; {fix}")
    return True
