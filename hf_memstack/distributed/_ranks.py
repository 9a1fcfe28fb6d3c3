"""One rank's error ends every rank, with that rank's message, before the next collective.

A collective (an FSDP all-gather in the forward, a reduce-scatter in the backward, the finder's
agreements) waits for every rank of the group. A rank that raises just before one leaves its peers
waiting there until the process group times out, and they end with a gloo/NCCL timeout or
"Connection closed by peer" that says nothing of the real error. So every step whose failure one
rank could meet alone (building a batch, a forward that returns no loss, an argument check) is
followed by :func:`share_error`: one all-reduce of "did this rank fail", and only when some rank
did, one all-gather of each rank's error. Then every rank raises: the failing rank its own error
(type and traceback intact), every other rank a :class:`DistributedMismatchError` naming the
failed rank(s) and their messages. :func:`on_every_rank` wraps a step that way.

The all-reduce also carries a code for the step's name: ranks that reached different steps (one
skipped a step the others ran) are told so on every rank, instead of reducing unrelated values.

What no agreement can share - a rank held up inside its step, or one that raised while its peers were
inside FSDP's collectives - ends at the group's timeout; :mod:`._stalls` then names that rank (and its
error, posted before it left for the agreement) on every rank that waited.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DistributedMismatchError
from ._stalls import DistributedStallError, agreement_done, post_error, watching

__all__ = [
    "RankFailure",
    "on_every_rank",
    "reraise",
    "runs_collectives",
    "same_arguments_on_every_rank",
    "share_error",
    "world_size",
]

T = TypeVar("T")
_MAX_VALUES = 8


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What one rank reports when something failed on some rank."""

    rank: int
    step: str
    """The step this rank was at."""
    error: str | None
    """``"TypeName: message"`` of its error; None when this rank did not fail."""
    error_type: str | None = None

    def describe(self) -> str:
        return f"rank {self.rank}: {self.error}"


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def share_error(
    step: str,
    error: BaseException | None,
    *,
    values: Sequence[int] = (),
    peer_error: Callable[[list[RankFailure]], BaseException] | None = None,
) -> list[int]:
    """Agree with every rank that none failed ``step`` (one all-reduce); returns the minimum over
    the ranks of each of ``values``. Alone (no process group, or one rank), it raises ``error``.

    Args:
        step: what was just run, for the messages (``"find_batch_size's checks"``).
        error: this rank's error in ``step``, or None.
        values: integers to reduce by their minimum in the same all-reduce.
        peer_error: builds the error raised on the ranks that did not fail from the failures
            (default: a :class:`DistributedMismatchError` naming each failed rank and its message).

    Raises:
        ``error`` on the rank(s) where it happened; on every other rank ``peer_error(failures)``;
        :class:`DistributedMismatchError` on every rank when the ranks reached different steps.
    """
    if world_size() == 1 or isinstance(error, DistributedStallError):  # the group is broken after a stall
        if error is not None:
            reraise(error)
        return list(values)
    if len(values) > _MAX_VALUES:
        raise ValueError(f"share_error carries at most {_MAX_VALUES} values, got {len(values)}")
    if error is not None:
        post_error(step, error)
    with watching(step, error=error):
        return _share(step, error, values, peer_error)


def _share(
    step: str,
    error: BaseException | None,
    values: Sequence[int],
    peer_error: Callable[[list[RankFailure]], BaseException] | None,
) -> list[int]:
    # One tensor of the same size on every rank, whatever each passed: ranks whose all-reduces
    # differ in size make gloo abort the process. The step's code and the count of values both go
    # in as (x, -x), so their minimum tells whether every rank sent the same.
    code = (zlib.crc32(step.encode()) & 0x3FFFFFFF) * (_MAX_VALUES + 1) + len(values)
    padded = [*values, *[0] * (_MAX_VALUES - len(values))]
    t = torch.tensor([code, -code, int(error is None), *padded], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreement_done()
    same_step, none_failed = int(t[0]) == -int(t[1]), bool(t[2])
    if same_step and none_failed:
        return [int(v) for v in t[3 : 3 + len(values)]]
    reports: list[RankFailure | None] = [None] * world_size()
    mine = RankFailure(
        dist.get_rank(),
        step,
        None if error is None else f"{type(error).__name__}: {error}",
        None if error is None else type(error).__name__,
    )
    dist.all_gather_object(reports, mine)
    everyone = [r for r in reports if r is not None]
    if not same_step:
        where = "; ".join(f"rank {r.rank} at {r.step!r}" + (f" ({r.error})" if r.error else "") for r in everyone)
        raise DistributedMismatchError(
            f"the ranks reached different steps ({where}): every rank must make the same calls with the same arguments "
            "and batch shapes",
            failed_ranks=tuple(r.rank for r in everyone if r.step != step),
        )
    if error is not None:
        reraise(error)
    failed = [r for r in everyone if r.error is not None]
    if peer_error is not None:
        raise peer_error(failed)
    raise DistributedMismatchError(
        f"{step} failed on rank(s) {[r.rank for r in failed]}, so every rank stops: "
        + "; ".join(r.describe() for r in failed),
        failed_ranks=tuple(r.rank for r in failed),
    )


def same_arguments_on_every_rank(call: str, allowed: str = "", **arguments: object) -> None:
    """Check that every rank passed ``call`` the same ``arguments`` (one all-gather of small values).
    Arguments that steer which collectives run (a search's cap, whether an optimizer steps) must
    match: a rank that runs fewer collectives than its peers leaves them waiting until the timeout.

    Raises:
        DistributedMismatchError: on every rank, naming each rank's differing argument and rank 0's value.
    """
    if world_size() == 1:
        return
    everyone: list[dict[str, object] | None] = [None] * world_size()
    with watching(f"{call}: comparing the arguments"):
        dist.all_gather_object(everyone, arguments)
    agreement_done()
    reference = everyone[0] or {}
    differences = [
        (rank, f"rank {rank}: {key}={(theirs or {}).get(key)!r} where rank 0 has {reference[key]!r}")
        for rank, theirs in enumerate(everyone)
        for key in reference
        if (theirs or {}).get(key) != reference[key]
    ]
    if differences:
        raise DistributedMismatchError(
            f"{call} was called with different arguments on the ranks ({'; '.join(d for _, d in differences)}): pass the same "
            f"{', '.join(arguments)} on every rank" + (f" ({allowed})" if allowed else ""),
            failed_ranks=tuple(sorted({r for r, _ in differences})),
        )


def on_every_rank(step: str, fn: Callable[[], T], *, shared: bool = True) -> T:
    """``fn()`` on this rank, then :func:`share_error` for it: its result when no rank failed.
    With ``shared=False`` just ``fn()`` (a step other ranks may not run, see :func:`runs_collectives`).

    Raises:
        ``fn``'s error on the rank that raised it; :class:`DistributedMismatchError` naming that
        rank and its message on every other rank.
    """
    if not shared:
        return fn()
    try:
        with watching(step):  # a collective inside fn that a peer never reaches names that peer
            result = fn()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised here
        share_error(step, e)
        raise AssertionError("unreachable: share_error re-raises") from None
    share_error(step, None)
    return result


def runs_collectives(model: nn.Module) -> bool:
    """Whether a step of ``model`` holds collectives every rank must reach: it is sharded by FSDP2
    (``fully_shard``, also through Accelerate) or wrapped in DDP, in a group of several ranks.
    A plain model's step does not: one rank may measure or verify it alone (e.g. on rank 0 only),
    so no agreement is added there."""
    if world_size() == 1:
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    return any(isinstance(m, (FSDPModule, DistributedDataParallel)) for m in model.modules())


def reraise(error: BaseException) -> None:
    """Raise without leaving a frame -> error -> traceback -> frame cycle, which would keep a
    failed step's tensors alive until the next garbage collection."""
    try:
        raise error
    finally:
        del error


def _collective_device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo (and a "cpu:gloo,cuda:nccl" group) takes CPU ones.
    return (
        torch.device("cuda", torch.cuda.current_device()) if str(dist.get_backend()) == "nccl" else torch.device("cpu")
    )
