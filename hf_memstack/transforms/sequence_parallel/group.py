"""The process group sequence parallelism exchanges over: ``world / N`` groups of N contiguous ranks
(ranks ``0..N-1``, ``N..2N-1``, ...; on one node first, as DeepSpeed's Ulysses groups are), each
created with the default group's timeout - ``new_group`` without one waits torch's default (30
minutes) whatever timeout the job gave ``init_process_group``, so a stalled rank would hold its
peers that long (the same reason as ``hf_memstack/distributed/mesh.py``)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ...distributed.mesh import group_timeout

__all__ = ["check_process_group", "sequence_parallel_group"]


def check_process_group(size: int) -> None:
    """Raise, naming the fix, when ``sp:size`` cannot run here: no process group, or a world size
    that ``size`` does not divide."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"policy.sequence_parallel.size={size} (sp:{size}) shards each row over {size} processes, and no "
            "torch.distributed process group is initialised: launch with e.g. `torchrun --nproc_per_node "
            f"{size} train.py` and call torch.distributed.init_process_group() before prepare_model; or drop sp:{size}"
        )
    world = dist.get_world_size()
    if world % size:
        raise ValueError(
            f"policy.sequence_parallel.size={size} (sp:{size}) does not divide the world size {world}: the ranks "
            f"form groups of {size} contiguous ranks; use an sp size that divides {world}, or launch a multiple of "
            f"{size} processes"
        )


def sequence_parallel_group(size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` contiguous ranks (every rank must call it: each group's creation
    is collective). The whole world when ``size`` is the world size."""
    check_process_group(size)
    world, rank = dist.get_world_size(), dist.get_rank()
    if size == world:
        return dist.group.WORLD  # type: ignore[return-value]  # the default group: its timeout is the job's
    timeout = _default_timeout()
    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, timeout=timeout) if timeout is not None else dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None  # rank < world, and the groups cover every rank
    return mine


def _default_timeout() -> datetime.timedelta | None:
    default = dist.distributed_c10d._get_default_group()
    backend = dist.get_backend(default)
    return group_timeout(default, "cuda" if backend == "nccl" else "cpu")
