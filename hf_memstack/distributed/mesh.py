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

__all__ = ["device_mesh", "group_timeout"]


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


def group_timeout(group: dist.ProcessGroup, device_type: str) -> datetime.timedelta | None:
    """How long ``group``'s collectives on ``device_type`` wait for a missing rank (None: this
    backend does not say)."""
    try:
        timeout = group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):  # a backend without options (a fake or custom one)
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None
