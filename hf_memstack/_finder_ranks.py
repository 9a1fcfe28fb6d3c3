"""How the batch-size finder's ranks agree: every decision that could differ between ranks (a
probe fitted, a cache entry is valid, the next size) goes through one all-reduce of the minimum.

Every agreement sends the same four numbers ``[tag, -tag, a, b]``: a rank that reached a
different point of the search than its peers (a bug, or diverging inputs) is detected from the
tag and raises on every rank, instead of silently reducing unrelated values together. An error on
one rank is agreed the same way, so every rank leaves with it and none waits in a collective.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .errors import BudgetTooSmallError, DistributedMismatchError

__all__ = ["agree", "agree_no_error", "is_local_leader", "world_size"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_local_leader() -> bool:
    """The rank that writes node-local files: local rank 0 (every node has its own cache folder)."""
    import os

    if world_size() == 1:
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def agree(tag: str, a: int, b: int = 0) -> tuple[int, int]:
    """The minimum of ``a`` and of ``b`` over all ranks (themselves with one process)."""
    if world_size() == 1:
        return a, b
    code = zlib.crc32(tag.encode()) & 0x7FFFFFFF
    t = torch.tensor([code, -code, a, b], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    low, high = int(t[0]), -int(t[1])
    if low != high:
        raise DistributedMismatchError(
            f"the batch-size finder's ranks reached different points of the search (this rank: {tag!r}); "
            "every rank must call find_batch_size with the same model, arguments and batch shapes"
        )
    return int(t[2]), int(t[3])


def agree_no_error(error: BaseException | None, tag: str, *, budget: int, fits: bool = True) -> bool:
    """Agree that no rank failed (one all-reduce, also carrying ``fits``); returns whether every rank fits.

    Raises:
        the rank's own error on the rank that failed; on every other rank a
        :class:`BudgetTooSmallError` (when the failure was one) or a :class:`DistributedMismatchError`
        naming the failed rank(s) and their errors.
    """
    if world_size() == 1:
        if error is not None:
            _reraise(error)
        return fits
    ok, all_fit = agree(tag, int(error is None), int(fits))
    if ok:
        return bool(all_fit)
    failures: list[tuple[int, str, str] | None] = [None] * world_size()
    mine = None if error is None else (dist.get_rank(), type(error).__name__, str(error))
    dist.all_gather_object(failures, mine)
    if error is not None:
        _reraise(error)
    failed = [f for f in failures if f is not None]
    text = "; ".join(f"rank {r}: {name}: {msg}" for r, name, msg in failed)
    if all(name == BudgetTooSmallError.__name__ for _, name, _ in failed):
        raise BudgetTooSmallError(f"another rank's budget cannot hold the step ({text})", budget_bytes=budget)
    raise DistributedMismatchError(f"find_batch_size failed on another rank ({tag}): {text}",
                                   failed_ranks=tuple(r for r, _, _ in failed))


def _reraise(error: BaseException) -> None:
    """Raise without leaving a frame -> error -> traceback -> frame cycle, which would keep the
    failed step's tensors alive until the next garbage collection."""
    try:
        raise error
    finally:
        del error


def _collective_device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo (and a "cpu:gloo,cuda:nccl" group) takes CPU ones.
    return torch.device("cuda", torch.cuda.current_device()) if str(dist.get_backend()) == "nccl" else torch.device("cpu")
