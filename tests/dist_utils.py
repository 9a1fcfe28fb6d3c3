"""Run a function on N CPU processes in a gloo group, with a timeout on the group and on the
whole run, so a distributed bug fails the test instead of hanging CI."""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

GROUP_TIMEOUT = 60.0
"""The process group's timeout in seconds, unless a test asks for another."""


def _worker(
    rank: int, world: int, init_file: str, out_dir: str, fn: Callable[..., Any], args: tuple, group_timeout: float
) -> None:
    import torch.distributed as dist

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}
    )
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=group_timeout),
    )
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - shipped back to the test, which re-raises
        result = ("error", traceback.format_exc())
    finally:
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        # Leave together: a rank tearing gloo down while its peer is still in a collective aborts.
        # (After a collective timed out the group is broken and the barrier fails: leave anyway.)
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is written; only the goodbye failed
            pass
        # Skip the interpreter's finalization: there, PyTorch's C++ teardown after gloo sometimes
        # aborts ("terminate called without an active exception", no Python frame; about 1 run in
        # 40 of the short error-path tests under pytest, which CI then counted as a failure). The
        # result is already written, so nothing is lost by leaving at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 180, group_timeout: float = GROUP_TIMEOUT
) -> list[Any]:
    """``fn(rank, world, *args)`` on each rank; returns each rank's result or raises with its traceback.
    ``group_timeout``: the process group's timeout (how long a collective waits for a missing rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "init")
        ctx = mp.start_processes(
            _worker,
            args=(world, init_file, tmp, fn, args, group_timeout),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout} s")
        results = []
        for rank in range(world):
            status, value = pickle.loads(Path(tmp, f"{rank}.pkl").read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """What a call did on this rank: ``("ok", its result)``, or its error's type name and message (so that
    a test can compare every rank's error, which run_ranks would otherwise raise for the first one)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - every rank's error is the subject of the test
        return type(e).__name__, str(e)


def timed(fn: Callable[[], Any]) -> tuple[tuple[str, Any], float]:
    """``outcome(fn)`` and how many seconds the call took."""
    start = time.monotonic()
    result = outcome(fn)
    return result, time.monotonic() - start


def train_losses(
    model: Any, optimizer: Any, batch: Callable[[int], dict[str, Any]], steps: Iterable[int]
) -> list[float]:
    """A plain loop: for each step, the model's own loss on ``batch(step)``, backward, step, zero the gradients.
    Each step's loss (on a rank, its own loss on its part of the batch)."""
    losses = []
    for step in steps:
        loss = model(**batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses
