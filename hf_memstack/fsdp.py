"""apply_fsdp: shard a model with PyTorch's FSDP2 (``fully_shard``) - each block, then the root -
with a mixed-precision policy derived from the memory policy's precision."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .blocks import Blocks
from .policy import FSDPConfig
from .precision import ResolvedPrecision

__all__ = ["apply_fsdp", "check_fsdp_launch", "load_sharded_checkpoint", "save_pretrained_full", "save_sharded_checkpoint"]

_HOW_TO_LAUNCH = (
    "launch with several processes, e.g. `torchrun --nproc_per_node 2 train.py` or "
    "`accelerate launch --config_file recipes/configs/fsdp.yaml train.py`, and call "
    "torch.distributed.init_process_group() (or create an Accelerator) before prepare_model; "
    "or drop fsdp from the policy (e.g. 'bf16+ckpt')"
)


def check_fsdp_launch(cfg: FSDPConfig, policy: dict[str, Any] | None = None) -> None:
    """Raise RuntimeError when FSDP is asked for without an initialised process group, or when the
    ranks were given different policies (checked with one small all-gather, before any sharding
    collective could wait forever on a rank that shards differently)."""
    if cfg.mode == "none":
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"policy.fsdp.mode={cfg.mode!r} needs a torch.distributed process group, and none is initialised: {_HOW_TO_LAUNCH}")
    if policy is not None:
        policies: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(policies, policy)
        differing = [r for r, p in enumerate(policies) if p != policies[0]]
        if differing:
            raise RuntimeError(
                f"the ranks were given different memory policies: rank 0 has {policies[0]}, rank(s) {differing} have "
                f"{[policies[r] for r in differing]}; pass the same policy on every rank (e.g. from one config file)"
            )
    if cfg.mode == "hybrid_shard":
        local = _local_world_size()
        if dist.get_world_size() % local:
            raise RuntimeError(
                f"policy.fsdp.mode='hybrid_shard': world size {dist.get_world_size()} is not a multiple of the "
                f"processes per node ({local}); use mode='full_shard'"
            )


def apply_fsdp(model: nn.Module, cfg: FSDPConfig, *, blocks: Blocks, precision: ResolvedPrecision) -> dict[str, Any]:
    """Shard ``model`` in place with ``fully_shard``: each block, then the root.

    Parameters are gathered in the policy's dtype for compute (bf16/fp16) while gradients are
    reduced in fp32; the sharded master parameters stay fp32.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    reshard = cfg.reshard_after_forward
    if reshard is None:
        reshard = cfg.mode != "shard_grad_op"
    mp = MixedPrecisionPolicy(param_dtype=precision.dtype if precision.mixed else None, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    mesh = _mesh(cfg, precision.device_type)
    for name, _ in zip(blocks.names, blocks.modules):
        # Shard what runs: a checkpoint wrapper or compiled module replaced the block in its parent.
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fully_shard(getattr(parent, child), mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    # The root keeps the embeddings and head; it is not resharded after forward because its
    # parameters are needed again at the start of backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    return {"mode": cfg.mode, "world_size": dist.get_world_size(), "reshard_after_forward": reshard, "cpu_offload": cfg.cpu_offload}


def _local_world_size() -> int:
    import os

    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _mesh(cfg: FSDPConfig, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if cfg.mode == "hybrid_shard":
        local = _local_world_size()
        return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))


def save_pretrained_full(model: nn.Module, save_directory: str, **kwargs: Any) -> None:
    """Gather the full state dict on rank 0 (in CPU memory) and write it with ``save_pretrained``
    (safetensors), loadable by ``from_pretrained`` in one process. Call it on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        original = type(model)
        # FSDP2 swaps the class for a generated `FSDP<Class>`: save under the model's own class name.
        model.__class__ = next(c for c in original.__mro__ if not c.__name__.startswith("FSDP"))
        try:
            model.save_pretrained(save_directory, state_dict=state, safe_serialization=True, **kwargs)
        finally:
            model.__class__ = original
    dist.barrier()


def save_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str) -> None:
    """Each rank writes its own shards of the model and optimizer (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)


def load_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str) -> None:
    """Load what :func:`save_sharded_checkpoint` wrote into an already sharded model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
