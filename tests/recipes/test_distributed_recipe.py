"""The recipe on 2 CPU processes (torchrun, gloo), as real subprocesses with timeouts: the
learning rate at every optimizer step equals the 1-process run's and transformers' own schedule;
a checkpoint cannot silently change the number of processes; a failing or hung rank ends the
whole run with its error within the process-group timeout."""

import time

import pytest
import torch
from recipe_utils import RECIPE, lm_args, read_report, run, snapshot, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _reference_lrs(name: str, lr: float, warmup: int, total: int) -> list[float]:
    """The learning rate of optimizer steps 1..total, straight from transformers."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


# One scheduler: the recipe hands --lr-scheduler's name to transformers' get_scheduler and steps
# whatever it builds the same way, so a second name (cosine, was) ran the same recipe code again
# under a second 2-process launch.
@pytest.mark.parametrize("scheduler", ["linear"])
def test_lr_schedule_is_the_same_on_two_processes(recipe, tiny_lm, tmp_path, scheduler):
    """Was: on 2 processes Accelerate's prepared scheduler stepped twice per optimizer step:
    --max-steps 8 --warmup-ratio 0 logged 1.5e-4, 1e-4, 5e-5, then 0 for steps 4-8."""
    # The same global batch on both: 8 x 2 accumulation on one process, 8 x 2 processes on two.
    common = [
        "--max-steps",
        "8",
        "--warmup-ratio",
        "0.25",
        "--log-every",
        "1",
        "--lr-scheduler",
        scheduler,
        "--global-batch-size",
        "16",
    ]
    one = run(recipe, lm_args(tiny_lm, tmp_path / "one", *common))
    torchrun(tiny_lm, tmp_path / "two", *common)
    two = read_report(tmp_path / "two")
    assert (one["world_size"], one["grad_accum"], two["world_size"], two["grad_accum"]) == (1, 2, 2, 1)
    lrs_one = [h["lr"] for h in one["history"]]
    lrs_two = [h["lr"] for h in two["history"]]
    assert [h["step"] for h in two["history"]] == list(range(1, 9))
    assert lrs_two == lrs_one == _reference_lrs(scheduler, 3e-3, warmup=2, total=8)
    print(f"\n{scheduler}: step, lr on 1 process, lr on 2 processes")
    for step, (a, b) in enumerate(zip(lrs_one, lrs_two), 1):
        print(f"  {step}  {a:.6g}  {b:.6g}")


def test_a_one_process_checkpoint_is_not_resumed_on_two(recipe, tiny_lm, tmp_path):
    """Was: the world size was not recorded: a 1-process checkpoint resumed on 2 processes
    doubled the global batch without a word."""
    out = tmp_path / "out"
    common = ["--max-steps", "4", "--save-every", "2"]
    run(recipe, lm_args(tiny_lm, out, *common, "--stop-after", "2"))
    before = snapshot(out)
    proc = torchrun(tiny_lm, out, *common, "--resume-from", "latest", check=False, timeout=300)
    assert proc.returncode != 0
    assert "world_size: 1 there, 2 now" in proc.stderr and "--allow-config-change" in proc.stderr, proc.stderr[-3000:]
    assert f'File "{RECIPE}"' not in proc.stderr  # no traceback through the recipe (torchrun prints its own summary)
    assert snapshot(out) == before


def _with_hook(tiny_lm, out, hook, *extra, timeout=300):
    """The recipe on 2 processes with a failure injected by the recipe's test hook (``what@where@rank``); the run
    is expected to fail, so its exit status is left to the test."""
    return torchrun(
        tiny_lm, out, *extra, env_extra={"HF_MEMSTACK_RECIPE_TEST_HOOK": hook}, check=False, timeout=timeout
    )


def test_a_failing_rank_ends_every_rank_with_its_error(tiny_lm, tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _with_hook(tiny_lm, out, "raise@step-2@rank1", "--max-steps", "8", "--dist-timeout", "30")
    assert proc.returncode != 0
    assert "failure injected at step-2 on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 200


def test_a_hung_rank_ends_the_run_within_the_timeout(tiny_lm, tmp_path):
    """Was: no process-group timeout: the other ranks waited PyTorch's default 30 minutes (gloo).
    Rank 1 hangs (never exits) after step 2; rank 0 waits in the next collective until
    --dist-timeout, fails, and torchrun then ends rank 1."""
    out = tmp_path / "out"
    start = time.monotonic()
    # 10 s: the ranks are in step at every collective before the hang (was 20 s: 10 s of waiting more, per run).
    proc = _with_hook(tiny_lm, out, "hang@step-2@rank1", "--max-steps", "8", "--dist-timeout", "10", timeout=400)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr[-3000:]
    assert elapsed < 300, elapsed  # 10 s of timeout plus the start-up of two processes on a busy 2-core machine


def test_a_setup_error_on_one_rank_ends_every_rank_with_it(tiny_lm, tmp_path):
    """A bad input seen by one rank only (say, a file missing on one node) ends every rank with
    that rank's message (one all-gather of the errors), instead of leaving the others waiting in
    the next collective; nothing is written."""
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _with_hook(tiny_lm, out, "reject@setup@rank1", "--max-steps", "2")
    assert proc.returncode != 0
    assert proc.stderr.count("error: test hook: bad input injected at setup on rank 1") == 2, proc.stderr[-3000:]
    assert f'File "{RECIPE}"' not in proc.stderr
    assert not out.exists() and time.monotonic() - start < 200
