"""The device mesh FSDP2 shards over, each of its process groups with the timeout of the default group.

``init_device_mesh`` makes a new process group for each mesh dimension that is not the whole world
(``fsdp:hybrid_shard``'s replicate and shard groups, from 4 ranks on) without a timeout, so those
groups wait torch's default (30 minutes; 10 under NCCL) whatever timeout the job gave
``init_process_group``: measured on 4 gloo ranks started with a 7 s timeout, both groups had 0:30:00,
and a rank that stalled in one of their collectives would have held its peers half an hour.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "group_timeout", "sequence_parallel_mesh"]


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``, whose groups all time out as the default group does."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    default = dist.distributed_c10d._get_default_group()
    timeout = group_timeout(default, device_type)
    for name in names:
        group = mesh.get_group(name)
        if group is not default and timeout is not None and group_timeout(group, device_type) != timeout:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    return mesh


def sequence_parallel_mesh(device_type: str, sp_size: int) -> DeviceMesh:
    """The 2-D ``("dp", "sp")`` mesh of ``sp:N``: ``world // N`` data-parallel groups of N contiguous
    ranks (SP innermost: a sequence group's all-to-alls stay within a node), each group with the
    default group's timeout. FSDP2 shards over its flattened ``dp x sp`` ranks, which with SP innermost
    are every rank in rank order: the 1-D mesh ``fsdp`` shards over without SP.

    Raises:
        ValueError: the world size is not a multiple of ``sp_size``.
    """
    world = dist.get_world_size()
    if sp_size < 1 or world % sp_size:
        raise ValueError(
            f"sequence_parallel.size={sp_size}: the {world} ranks do not split into groups of {sp_size}; launch a "
            f"multiple of {sp_size} processes or choose an sp:N that divides {world}"
        )
    return device_mesh(device_type, (world // sp_size, sp_size), ("dp", "sp"))


def group_timeout(group: dist.ProcessGroup, device_type: str) -> datetime.timedelta | None:
    """How long ``group``'s collectives on ``device_type`` wait for a missing rank (None: this
    backend does not say)."""
    try:
        timeout = group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):  # a backend without options (a fake or custom one)
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None
