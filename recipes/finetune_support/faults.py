"""Test-only fault injection: the recipe's tests kill, fail or hang it at named points (between a
checkpoint's files and its manifest, at setup on one rank...) to prove the output directory and
the other ranks survive. Unset in real runs: one environment variable, read here only."""

from __future__ import annotations

import os
import signal
import sys
import time

from .common import RecipeError


def test_hook(point: str, rank: int = 0) -> None:
    """Test-only fault injection at named points, from HF_MEMSTACK_RECIPE_TEST_HOOK='kill@POINT'
    (SIGKILL this process), 'raise@POINT' (an exception), 'reject@POINT' (a RecipeError, as a bad
    input would) or 'hang@POINT', optionally '@rankN'. Unset in real runs."""
    spec = os.environ.get("HF_MEMSTACK_RECIPE_TEST_HOOK")
    if not spec:
        return
    action, _, rest = spec.partition("@")
    where, _, on_rank = rest.partition("@")
    if where != point or (on_rank and on_rank != f"rank{rank}"):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        # Said first, so that a test knows the process got here before it signals it.
        print(f"test hook: hanging at {point} on rank {rank}", file=sys.stderr, flush=True)
        time.sleep(10**6)
    elif action == "reject":
        raise RecipeError(f"test hook: bad input injected at {point} on rank {rank}")
    raise RuntimeError(f"test hook: failure injected at {point} on rank {rank}")
