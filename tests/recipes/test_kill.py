"""Kill test: a run SIGKILLed again and again - at chosen points of training and of every stage
of a checkpoint save, and at random moments during training - and restarted each time with the
same `--resume-from latest` command, ends with weights bitwise identical to an uninterrupted run
(CPU, fp32), with the same logged history and no half-written checkpoint left behind."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from finetune_support.checkpoint_dirs import list_checkpoints
from recipe_utils import RECIPE, ROOT, assert_same_weights, lm_args, read_report, run

pytestmark = pytest.mark.slow

# 12 optimizer steps of 8 x 2 accumulation (one epoch is 7 steps: the run crosses an epoch),
# a checkpoint every 2 steps, the newest 2 kept.
COMMON = ["--max-steps", "12", "--save-every", "2", "--keep-last", "2", "--global-batch-size", "16", "--log-every", "1"]

# Each restart is killed at the next of these points (the point must be reached: exit by SIGKILL).
KILL_POINTS = [
    "committed",  # run_config.yaml and the manifest written, no step yet
    "step-3",  # mid-training, one step after the checkpoint of step 2
    "save-4:state-written",  # mid-save: Accelerate's files in step-4.tmp, no trainer_state, no manifest
    "save-6:files-written",  # mid-save: every file but the manifest (step 4 was saved on the way)
    "save-6:manifest-written",  # mid-save: complete, but still step-6.tmp (never resumed)
    "save-8:rotating",  # step 8 renamed in; step 4's manifest gone, its folder half-removed
    "step-11",  # mid-training, in the second epoch
    # The last save renamed in, its rotation not begun: no later save rotates, the resumed run must
    # (CI once left step 8 beside 10 and 12 after a timed kill landed there).
    "save-12:renamed",
    "model:written",  # the final model in model.tmp, not yet swapped in
]


def _restart(
    args: list[str], env: dict[str, str], *, kill_at: str | None = None, kill_after_s: float | None = None
) -> int:
    """One `python recipes/finetune.py ... --resume-from latest`; returns its exit status (-9: killed)."""
    env = {**env, **({"HF_MEMSTACK_RECIPE_TEST_HOOK": f"kill@{kill_at}"} if kill_at else {})}
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    fired = threading.Event()

    def stop() -> None:  # nothing below can wait forever on a stuck process
        fired.set()
        proc.kill()

    watchdog = threading.Timer(300, stop)
    watchdog.start()
    try:
        if kill_after_s is not None:
            # A timed kill at a random moment once training runs (the progress bar has started).
            for line in proc.stdout:
                if "train:" in line or "resumed from" in line:
                    time.sleep(kill_after_s)
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.communicate()
    finally:
        watchdog.cancel()
    assert not fired.is_set(), "a restart ran for 300 s and was stopped"
    return proc.returncode


def _check_resumable(recipe, out) -> None:
    """Whatever a kill left, a restart finds a complete checkpoint to resume (or none yet): no
    folder newer than the newest complete one looks like a checkpoint without being one."""
    found = list_checkpoints(out)
    newest = max([c.step for c in found if c.problem is None], default=-1)
    assert not [c for c in found if c.problem and c.step > newest], found


def _check_same_run(recipe, reference, out) -> None:
    assert_same_weights(reference, out)
    ours, theirs = read_report(out), read_report(reference)
    assert [(h["step"], h["loss"], h["lr"]) for h in ours["history"]] == [
        (h["step"], h["loss"], h["lr"]) for h in theirs["history"]
    ]
    # Nothing half-written is left: the newest 2 complete checkpoints, no .tmp, no model.tmp.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000010", "step-0000012"]
    assert all(c.problem is None for c in list_checkpoints(out))
    assert not (out / "model.tmp").exists() and not (out / "model.old").exists()
    # Every entry of the directory is one the recipe recorded in its manifest.
    manifest = json.loads((out / "recipe_manifest.json").read_text())
    recorded = {n.split("/")[0] for k in ("files", "dirs", "trees") for n in manifest[k]} | {"recipe_manifest.json"}
    assert {p.name for p in out.iterdir()} <= recorded


def test_killed_and_resumed_equals_uninterrupted(recipe, tiny_lm, tmp_path):
    reference = tmp_path / "reference"
    run(recipe, lm_args(tiny_lm, reference, *COMMON))
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("HF_MEMSTACK_RECIPE_TEST_HOOK", None)

    # 1. Killed at each chosen point in turn, restarted by the same command each time.
    out = tmp_path / "at_points"
    args = [str(a) for a in lm_args(tiny_lm, out, *COMMON, "--resume-from", "latest")]
    for point in KILL_POINTS:
        assert _restart(args, env, kill_at=point) == -signal.SIGKILL, f"kill point {point} was not reached"
        _check_resumable(recipe, out)
    assert _restart(args, env) == 0
    _check_same_run(recipe, reference, out)

    # 2. Killed at random moments of training (the same seed each time: the test is repeatable).
    out = tmp_path / "timed"
    args = [str(a) for a in lm_args(tiny_lm, out, *COMMON, "--resume-from", "latest")]
    rng, timed = random.Random(12), []
    for _ in range(2):
        delay = rng.uniform(0.0, 1.5)
        status = _restart(args, env, kill_after_s=delay)
        timed.append(f"+{delay:.2f} s" + (" (killed)" if status == -signal.SIGKILL else " (it finished first)"))
        _check_resumable(recipe, out)
    assert _restart(args, env) == 0
    _check_same_run(recipe, reference, out)
    print(
        f"\nkill points survived: {len(KILL_POINTS)} chosen {KILL_POINTS} and {len(timed)} timed, after training started: {timed}"
    )
