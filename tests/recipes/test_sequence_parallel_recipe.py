"""The recipe with sequence parallelism (--policy ...+sp:2): on 2 processes under torchrun its loss curve is
the 1-process run's (the 2 ranks of the sequence group read the same rows, each trains on its half of
every row's tokens, the logged loss is their sum), and a run stopped after a checkpoint resumes to the
uninterrupted run's losses. What sp:N cannot run is refused before anything is loaded or written."""

import json
import shutil

import pytest
from recipe_utils import fails, lm_args, read_report, run, snapshot, torchrun

COMMON = ["--max-steps", "6", "--log-every", "1", "--batch-size", "8"]


def _without_dropout(tiny_lm, tmp_path):
    """The tiny LM with attention_dropout 0: its masks differ between a rank's slice and the whole rows,
    so only without it are the two runs' losses the same numbers (with it they differed by up to 0.2%)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_lm["model"], model)
    config = json.loads((model / "config.json").read_text())
    config["attention_dropout"] = 0.0
    (model / "config.json").write_text(json.dumps(config))
    return {**tiny_lm, "model": model}


def _losses(report):
    return [h["loss"] for h in report["history"]]


@pytest.mark.slow
@pytest.mark.distributed
def test_sp2_on_two_processes_logs_the_one_process_loss_curve_and_resumes(recipe, tiny_lm, tmp_path):
    tiny_lm = _without_dropout(tiny_lm, tmp_path)
    one = run(recipe, lm_args(tiny_lm, tmp_path / "one", *COMMON))
    # One sp:2 run, stopped after its checkpoint at step 3 and resumed (crash-safe resume), checked
    # against the 1-process run: its curve is that run's, before the stop and after the resume. (Was
    # an uninterrupted sp:2 run too, a third launch of two processes: its curve is the 1-process one.)
    out = tmp_path / "sp2"
    stopped = ["--policy", "fp32+sp:2", "--save-every", "3"]
    torchrun(tiny_lm, out, *COMMON, *stopped, "--stop-after", "3", timeout=600)
    assert (out / "checkpoints" / "step-0000003").is_dir()
    torchrun(tiny_lm, out, *COMMON, *stopped, "--resume-from", "latest", timeout=600)
    sp2 = read_report(out)
    assert (sp2["world_size"], sp2["grad_accum"], sp2["policy"]) == (2, 1, "fp32+sp:2")
    print("\nstep, loss on 1 process (sp:1), on 2 processes (sp:2, stopped after 3 and resumed)")
    for step, (a, b) in enumerate(zip(_losses(one), _losses(sp2)), 1):
        print(f"  {step}  {a:.6f}  {b:.6f}")
    assert [h["step"] for h in sp2["history"]] == list(range(1, 7))
    assert _losses(sp2) == pytest.approx(_losses(one), rel=1e-4)  # fp32: the same sums in another order
    assert sp2["final_metrics"]["eval_loss"] == pytest.approx(one["final_metrics"]["eval_loss"], rel=1e-4)


def test_sp2_on_one_process_is_refused_before_anything_is_written(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "out"
    fails(
        recipe, lm_args(tiny_lm, out, *COMMON, "--policy", "fp32+sp:2"), capsys, "sp:2 needs a multiple of 2 processes"
    )
    assert snapshot(out) is None


def test_sp2_with_the_batch_size_finder_is_refused(recipe, tiny_lm, tmp_path, capsys):
    args = lm_args(
        tiny_lm, tmp_path / "out", "--policy", "fp32+sp:2", "--batch-size", "auto", "--memory-budget", "1GiB"
    )
    fails(recipe, args, capsys, "batch_size='auto'", "--batch-size N")
