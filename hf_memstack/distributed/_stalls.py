"""When a collective of one of the package's distributed steps fails, name the rank that did not arrive.

A rank held up in its own code (a hang, a long computation on that rank only) or one that raised
where its peers went on into a collective leaves them waiting there until the process group's
timeout, and gloo then says only "Timed out waiting 60000ms for send operation" (on the ranks that
waited) or "Connection closed by peer" / "Application timeout caused pair closure" (on the others):
no rank is named, nor where. The group is broken by then, so no collective can ask; the group's
store still can. Inside :func:`watching` (the steps of ``measure_step``, ``verify``,
``find_batch_size`` and every agreement of :mod:`._ranks`) such a failure starts a roll call in the
store: this rank posts where it was, waits a few seconds for the others' posts, and raises a
:class:`DistributedStallError` naming the rank(s) that posted nothing (did not arrive: held up, or
their process ended) or the error a rank posted before it left for an agreement its peers never
reached; a rank that arrives after its peers gave up is told so. A rank's post counts only when it
was made after as many completed agreements as this rank's: every rank completes the same
agreements in the same order, so equal counts mean the same stretch of the program.

Cost when nothing fails: one store write per process (its pid and host, for the message) and a
counter per agreement. Under NCCL the watchdog ends the process on a timeout before Python sees an
error: the roll call serves gloo (CPU) groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator

import torch.distributed as dist

from ..errors import DistributedMismatchError
from ..files import loads_json

__all__ = ["DistributedStallError", "agreement_done", "is_collective_failure", "post_error", "watching"]

_GRACE_S = 3.0
"""How long a rank whose collective failed waits for the others' posts (each rank that also waited
posts as soon as its own collective fails, which the first one's leaving makes prompt)."""
_POLL_S = 0.05
_PREFIX = "hf_memstack/roll_call/"
_MAX_TEXT = 2000
# What gloo says when a collective cannot complete (its errors are plain RuntimeErrors).
_FAILURES = (
    "timed out waiting",
    "connection closed by peer",
    "caused pair closure",
    "connection reset by peer",
    "socket timeout",
)
_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.cc:\d+\] ")


class DistributedStallError(DistributedMismatchError):
    """A collective in one of the package's distributed steps could not complete (a rank did not
    arrive before the group's timeout, or a peer left): raised on each rank that met the failure,
    naming the rank(s) that did not arrive or failed and where this rank waited. The process group
    is unusable afterwards: end the run."""


class _State:
    agreements = 0
    """The agreements this process completed (the same count on every rank at the same point)."""
    introduced = False
    """This rank's pid and host are in the store."""


_state = _State()


def agreement_done() -> None:
    """Count one completed agreement (called by every agreement of :mod:`._ranks` after its collective)."""
    _state.agreements += 1


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that could not complete (timed out, or a peer closed the connection)."""
    if isinstance(error, DistributedMismatchError):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(f in str(error).lower() for f in _FAILURES)


@contextlib.contextmanager
def watching(step: str, *, error: BaseException | None = None, shared: bool = True) -> Iterator[None]:
    """Within: a collective that fails is reported as a :class:`DistributedStallError` naming the
    ranks that did not arrive or failed (or, on a rank whose own ``error`` is being shared, that error).
    Alone (no process group, one rank, or ``shared=False``: the model runs no collective): nothing is added."""
    if not shared or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    _introduce()
    start = time.monotonic()
    try:
        yield
    except Exception as failure:
        if not is_collective_failure(failure):
            raise
        if error is not None:  # this rank's own error is the story; the collective only failed after it
            raise error from failure
        raise _roll_call(step, failure, time.monotonic() - start) from failure


def post_error(step: str, error: BaseException) -> None:
    """Leave this rank's ``error`` in the store before it enters the agreement that shares it: a
    peer waiting in a collective this rank will never reach reads it there when that one fails."""
    with contextlib.suppress(Exception):  # the agreement shares the error anyway; the post only helps a stall
        _post({"where": step, "error": _text(error)})


def _introduce() -> None:
    if _state.introduced:
        return
    _state.introduced = True
    with contextlib.suppress(Exception):  # only the message's pid and host would be missing
        _store().set(f"{_PREFIX}who/{dist.get_rank()}", f"pid {os.getpid()} on {socket.gethostname()}")


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _post(fields: dict[str, object]) -> None:
    _store().set(f"{_PREFIX}{dist.get_rank()}", json.dumps({**fields, "after": _state.agreements}))


def _read(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode(errors="replace") if store.check([key]) else None


def _posts(store: dist.Store, others: list[int]) -> tuple[dict[int, dict[str, object]], set[int]]:
    """The others' posts from this stretch of the program, waiting up to ``_GRACE_S`` for missing
    ones; and the ranks whose post was already there at the first look."""
    posts: dict[int, dict[str, object]] = {}
    first: set[int] | None = None
    deadline = time.monotonic() + _GRACE_S
    while True:
        for r in others:
            text = None if r in posts else _read(store, f"{_PREFIX}{r}")
            post = loads_json(text, where=f"rank {r}'s post in the store") if text else None
            if isinstance(post, dict) and post.get("after") == _state.agreements:
                posts[r] = post
        first = set(posts) if first is None else first
        if len(posts) == len(others) or time.monotonic() > deadline:
            return posts, first
        time.sleep(_POLL_S)


def _roll_call(step: str, failure: BaseException, seconds: float) -> DistributedStallError:
    rank, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != rank]
    raw = _text(failure)
    try:
        _post({"where": step, "seconds": round(seconds, 1)})
        store = _store()
        posts, first = _posts(store, others)
        who = {r: _read(store, f"{_PREFIX}who/{r}") or "pid unknown" for r in others}
    except Exception as store_error:  # noqa: BLE001 - the message says what it could not learn
        return DistributedStallError(
            f"{step}: a collective failed on rank {rank} ({raw}), and the other ranks could not be asked why "
            f"(the process group's store: {_text(store_error)}): read every rank's output"
        )
    failed = {r: p for r, p in posts.items() if p.get("error")}
    missing = [r for r in others if r not in posts]
    if failed:
        said = "; ".join(f"rank {r}: {p['error']}" for r, p in failed.items())
        return DistributedStallError(
            f"{step} failed on rank(s) {sorted(failed)}, so every rank stops: {said}. Rank {rank} was waiting for "
            f"them in one of the step's collectives, which they never reached, until it failed ({raw})",
            failed_ranks=tuple(sorted(failed)),
        )
    if missing:
        named = ", ".join(f"rank {r} ({who[r]})" for r in missing)
        also = [r for r in others if r in posts]
        return DistributedStallError(
            f"{step}: {named} did not arrive: rank {rank} waited for it in a collective of {step!r} "
            f"({seconds:.1f} s in that step) until the collective failed ({raw})"
            + (f"; rank(s) {also} waited too" if also else "")
            + ". That rank is held up in its own code (a hang, or a long computation on it alone) or its process "
            "ended: read its output, or see where it is (py-spy dump --pid <its pid>); a rank that is only slower "
            "needs a longer process-group timeout (init_process_group(timeout=...), the recipe's --dist-timeout)",
            failed_ranks=tuple(missing),
        )
    if first == set(others):  # every other rank had given up before this one arrived
        where = "; ".join(f"rank {r} at {p.get('where')!r} after {p.get('seconds', '?')} s" for r, p in posts.items())
        return DistributedStallError(
            f"{step}: this rank ({rank}) arrived late: the other ranks stopped waiting for it ({where}: the process "
            f"group's timeout), so its collective failed ({raw}). Rank {rank} was held up in its own code before "
            "reaching them (a hang, or a long computation on this rank alone); a rank that is only slower needs a "
            "longer process-group timeout (init_process_group(timeout=...), the recipe's --dist-timeout)",
            failed_ranks=(rank,),
        )
    where = "; ".join(f"rank {r} at {p.get('where')!r}" for r, p in posts.items())
    return DistributedStallError(
        f"{step}: a collective failed on rank {rank} ({raw}) though every rank reached this point ({where}): "
        "read every rank's output"
    )


def _text(error: BaseException) -> str:
    # gloo's messages start with its source file and line ("[/.../gloo/transport/tcp/pair.cc:553] "): not for users.
    text = f"{type(error).__name__}: {_GLOO_SOURCE.sub('', str(error))}"
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + " ..."
