"""One test per finding of issue 12 ("Recipe v2"), each run on the real script with a tiny model.
Every one of them failed on the first version of the recipe (the finding's behaviour is quoted
in each docstring). The multi-process findings are in test_distributed_recipe.py, the bad data
files in test_bad_data.py, the output-directory cases in test_output_dir.py."""

import json
import math
import shutil

import pytest
import yaml
from finetune_support.checkpoint_dirs import list_checkpoints
from recipe_utils import (
    assert_same_weights,
    fails,
    lm_args,
    read_report,
    run,
    snapshot,
    weights,
)


def _checkpoints(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _restep(ckpt, step):
    """Make a copied checkpoint's trainer_state.json and checkpoint.json say ``step`` (sizes to match)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "step": step}))
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    files = {name: (ckpt / name).stat().st_size for name in manifest["files"]}
    (ckpt / "checkpoint.json").write_text(json.dumps({**manifest, "step": step, "files": files}))


# ----------------------------------------------------------------------------- checkpoints


def test_resume_from_earlier_checkpoint_refuses_then_discards_the_abandoned_branch(recipe, tiny_lm, tmp_path, capsys):
    """Was: keep_last sorted by name, deleted the checkpoint just written and kept the abandoned
    later one, which --resume-from latest then resumed."""
    common = ["--max-steps", "8", "--save-every", "2", "--keep-last", "2"]
    run(recipe, lm_args(tiny_lm, tmp_path / "full", *common))
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, *common))
    assert _checkpoints(out) == ["step-0000006", "step-0000008"]
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *common, "--keep-last", "1", "--resume-from", out / "checkpoints" / "step-0000006"),
        capsys,
        "later checkpoints exist (step-0000008)",
        "--resume-from latest",
        "new --output-dir",
        "--discard-later-checkpoints",
    )
    assert snapshot(out) == before
    # Branch from step 6 for real: the abandoned step 8 and its final model go first; the new step 8 stays.
    report = run(
        recipe,
        lm_args(
            tiny_lm,
            out,
            *common,
            "--keep-last",
            "1",
            "--resume-from",
            out / "checkpoints" / "step-0000006",
            "--discard-later-checkpoints",
        ),
    )
    assert _checkpoints(out) == ["step-0000008"]
    state = json.loads((out / "checkpoints" / "step-0000008" / "trainer_state.json").read_text())
    assert state["step"] == 8 and report["steps"] == 8
    assert_same_weights(tmp_path / "full", out)  # the branch replays steps 7-8 exactly


def test_checkpoints_are_ordered_by_step_not_by_name(recipe, tiny_lm, tmp_path):
    """Was: sorted by folder name, so step 10000000 came before step 9999999."""
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "2", "--save-every", "2"))
    real = out / "checkpoints" / "step-0000002"
    for name in ("step-9999999", "step-10000000"):
        copy = out / "checkpoints" / name
        shutil.copytree(real, copy)
        _restep(copy, int(name.split("-")[1]))  # a copy says which step it is, as a saved one does
    steps = [c.step for c in list_checkpoints(out)]
    assert steps == [2, 9999999, 10000000]
    cfg = recipe.parse_config(lm_args(tiny_lm, out, "--max-steps", "2", "--resume-from", "latest"))
    assert recipe.plan_output(cfg).resume.path.name == "step-10000000"


def test_latest_never_resumes_a_tmp_folder(recipe, tiny_lm, tmp_path, capsys):
    """Was: --resume-from latest picked step-N.tmp folders (saves that never finished)."""
    common = ["--max-steps", "8", "--save-every", "2", "--keep-last", "5"]
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, *common, "--stop-after", "4"))
    # A save of step 6 cut short after all its files were written, even its manifest: still a .tmp.
    shutil.copytree(out / "checkpoints" / "step-0000004", out / "checkpoints" / "step-0000006.tmp")
    fails(
        recipe,
        lm_args(tiny_lm, out, *common, "--resume-from", out / "checkpoints" / "step-0000006.tmp"),
        capsys,
        "not a complete checkpoint",
        "a .tmp folder is a save that never finished",
    )
    capsys.readouterr()
    run(recipe, lm_args(tiny_lm, out, *common, "--resume-from", "latest"))
    assert "resumed from " + str(out / "checkpoints" / "step-0000004") in capsys.readouterr().out
    assert _checkpoints(out) == [
        "step-0000002",
        "step-0000004",
        "step-0000006",
        "step-0000008",
    ]  # the .tmp was cleaned up


def test_truncated_trainer_state_is_a_clear_error(recipe, tiny_lm, tmp_path, capsys):
    """Was: a trainer_state.json truncated by a kill crashed with a JSONDecodeError."""
    common = ["--max-steps", "8", "--save-every", "2"]
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, *common, "--stop-after", "4"))
    state = out / "checkpoints" / "step-0000004" / "trainer_state.json"
    state.write_text(state.read_text()[:40])
    before = snapshot(out)
    err = fails(
        recipe,
        lm_args(tiny_lm, out, *common, "--resume-from", "latest"),
        capsys,
        "step-0000004 is newer than the last complete checkpoint but incomplete",
        "trainer_state.json has 40 bytes",
        "delete it to resume from step-0000002",
    )
    assert "JSONDecodeError" not in err and "Traceback" not in err
    # Even when the manifest agrees with the truncated size, it is a named error, not a traceback.
    manifest = out / "checkpoints" / "step-0000004" / "checkpoint.json"
    m = json.loads(manifest.read_text())
    m["files"]["trainer_state.json"] = 40
    manifest.write_text(json.dumps(m))
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *common, "--resume-from", out / "checkpoints" / "step-0000004"),
        capsys,
        "not a complete checkpoint: trainer_state.json is not readable JSON",
    )
    assert snapshot(out) == before


def test_resume_from_the_final_checkpoint(recipe, tiny_lm, tmp_path):
    """Was: resuming from the final checkpoint saved the model, then crashed on an empty history."""
    out = tmp_path / "out"
    first = run(recipe, lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "4"))
    before = weights(out)
    again = run(recipe, lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "4", "--resume-from", "latest"))
    assert again["steps"] == 4 and again["history"] == first["history"]
    assert again["first_logged_loss"] == first["first_logged_loss"]
    after = weights(out)
    assert all((before[k] == after[k]).all() for k in before)


# ----------------------------------------------------------------------------- silently changed runs


def test_resume_into_a_new_directory_compares_the_settings(recipe, tiny_lm, tmp_path, capsys):
    """Was: resuming into a new output directory from another run's checkpoint skipped the check:
    --batch-size 16 --lr 0.5 --policy bf16 were replaced by the checkpoint's values while
    run_config.yaml recorded the requested ones."""
    common = ["--max-steps", "8", "--save-every", "4"]
    run(recipe, lm_args(tiny_lm, tmp_path / "a", *common, "--stop-after", "4"))
    ckpt = tmp_path / "a" / "checkpoints" / "step-0000004"
    b = tmp_path / "b"
    changed = ["--batch-size", "16", "--lr", "0.5", "--policy", "bf16"]
    fails(
        recipe,
        lm_args(tiny_lm, b, *common, *changed, "--resume-from", ckpt),
        capsys,
        "different settings that change the run",
        "batch_size: '8' there, '16' now",
        "lr: 0.003 there, 0.5 now",
        "policy: 'fp32' there, 'bf16' now",
        "--allow-config-change",
    )
    assert not b.exists()
    # With --allow-config-change the requested values are the ones that run, and the ones recorded.
    report = run(recipe, lm_args(tiny_lm, b, *common, *changed, "--resume-from", ckpt, "--allow-config-change"))
    assert report["batch_size"] == 16 and report["precision"] == "bf16" and report["policy"] == "bf16"
    saved = yaml.safe_load((b / "run_config.yaml").read_text())
    assert saved["lr"] == 0.5 and saved["batch_size"] == "16" and saved["policy"] == "bf16"
    # From step 5 on, the schedule (linear, no warm-up at 8 steps) continues at the new peak lr.
    import torch
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=8)
    expected = []
    for _ in range(8):
        expected.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    resumed_rows = [h for h in report["history"] if h["step"] > 4]
    assert [h["lr"] for h in resumed_rows] == pytest.approx([expected[h["step"] - 1] for h in resumed_rows], rel=1e-12)


def test_changed_data_is_refused_on_resume(recipe, tiny_lm, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    shutil.copy(tiny_lm["data"], data)
    args = lm_args(tiny_lm, tmp_path / "out", "--max-steps", "8", "--save-every", "4")
    args[args.index("--dataset") + 1] = str(data)
    run(recipe, [*args, "--stop-after", "4"])
    with open(data, "a") as f:
        f.write(json.dumps({"text": "the cat ran to the park"}) + "\n")
    fails(recipe, [*args, "--resume-from", "latest"], capsys, "data_sha256:", "--allow-config-change")


# ----------------------------------------------------------------------------- failures after writing, types


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (["--lr", "nan"], "lr=nan is not a finite number"),
        (["--epochs", "inf", "--max-steps", "0"], "epochs=inf is not a finite number"),
        (
            ["--lr-scheduler", "cosinee"],
            "lr_scheduler='cosinee' is not a transformers scheduler (did you mean 'cosine'?)",
        ),
        (["--policy", "BACKEND_NOPE"], "compile.backend='nope' is not a torch.compile backend"),
        (["--batch-size", "auto", "--memory-budget", "100KB"], "batch_size=auto with memory_budget='100KB'"),
    ],
)
def test_setup_errors_leave_nothing_and_the_next_run_works(recipe, tiny_lm, tmp_path, capsys, bad, fragment):
    """Was: these failed after run_config.yaml was written; the traceback left a directory that
    the next run with the same --output-dir refused as 'a different run'."""
    if "BACKEND_NOPE" in bad:
        policy = tmp_path / "policy.yaml"
        policy.write_text("compile:\n  mode: full\n  backend: nope\n")
        bad = ["--policy", str(policy)]
    out = tmp_path / "out"
    fails(recipe, lm_args(tiny_lm, out, "--max-steps", "2", *bad), capsys, fragment)
    assert not out.exists()
    assert run(recipe, lm_args(tiny_lm, out, "--max-steps", "2"))["steps"] == 2


@pytest.mark.parametrize(
    "yaml_text, fragment",
    [
        ("lr: [1, 2]\n", "lr=[1, 2] (list) must be float"),
        ("seq_len: null\n", "seq_len=None (NoneType) must be int"),
        ("5\n", "holds a int ('5'), not a mapping"),
        ("grad_clip: .nan\n", "grad_clip=nan is not a finite number"),
    ],
)
def test_config_file_values_of_the_wrong_type(recipe, tiny_lm, tmp_path, capsys, yaml_text, fragment):
    """Was: TypeError tracebacks for lr: [1,2], seq_len: null and a YAML file that is just 5;
    grad_clip: .nan silently turned clipping off."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    fails(recipe, ["--config", config, "--output-dir", tmp_path / "out"], capsys, fragment)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- smaller findings


def test_relative_and_home_paths(recipe, tiny_lm, tmp_path, monkeypatch):
    """Was: ./out and out were two different runs to the resume check; ~ was not expanded."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    common = ["--max-steps", "4", "--save-every", "2"]
    run(recipe, lm_args(tiny_lm, "out", *common, "--stop-after", "2"))
    report = run(recipe, lm_args(tiny_lm, "./out", *common, "--resume-from", "latest"))
    assert report["steps"] == 4 and (tmp_path / "out" / "model").is_dir()
    (tmp_path / "home").mkdir()
    shutil.copy(tiny_lm["data"], tmp_path / "home" / "data.jsonl")
    args = lm_args(tiny_lm, "~/runs/x", "--max-steps", "2")
    args[args.index("--dataset") + 1] = "~/data.jsonl"
    run(recipe, args)
    assert (tmp_path / "home" / "runs" / "x" / "report.json").is_file() and not (tmp_path / "~").exists()


def test_first_logged_loss_is_the_real_loss(recipe, tiny_lm, tmp_path):
    """Was: with --log-every 1 the first logged loss was 0.0 (the memory meter's step was
    recorded as NaN and left out)."""
    every1 = run(recipe, lm_args(tiny_lm, tmp_path / "a", "--max-steps", "4", "--log-every", "1"))["history"]
    every2 = run(recipe, lm_args(tiny_lm, tmp_path / "b", "--max-steps", "4", "--log-every", "2"))["history"]
    # A fresh tiny Llama predicts about uniformly over its 21-word vocabulary: loss near ln(21).
    assert abs(every1[0]["loss"] - math.log(21)) < 0.5, every1[0]
    # Logging does not change training: steps 1-2 averaged are the log-every-2 run's first line.
    assert (every1[0]["loss"] + every1[1]["loss"]) / 2 == pytest.approx(every2[0]["loss"], rel=1e-6)


def test_gradient_accumulation_rounds_up_like_the_finder(recipe, tiny_lm, tmp_path):
    """Was: round(64 / 20) = 3 accumulation steps (global batch 60) while the batch-size finder's
    result says ceil: 4 (global batch 80, never less than asked)."""
    args = lm_args(tiny_lm, tmp_path / "out", "--max-steps", "1", "--global-batch-size", "64")
    args[args.index("--batch-size") + 1] = "20"
    report = run(recipe, args)
    assert report["grad_accum"] == math.ceil(64 / 20) == 4


def test_stop_after_without_checkpoints_is_refused(recipe, tiny_lm, tmp_path, capsys):
    fails(
        recipe,
        lm_args(tiny_lm, tmp_path / "out", "--max-steps", "4", "--stop-after", "2"),
        capsys,
        "stop_after=2 needs --save-every",
    )
    assert not (tmp_path / "out").exists()


def test_resume_latest_before_the_first_checkpoint_starts_again(recipe, tiny_lm, tmp_path, capsys):
    """A run killed before its first checkpoint is restarted by the same --resume-from latest
    command (one command for every restart of a preemptible job), and its settings are still checked."""
    out = tmp_path / "out"
    common = ["--max-steps", "4", "--save-every", "2"]
    run(recipe, lm_args(tiny_lm, tmp_path / "full", *common))
    run(recipe, lm_args(tiny_lm, out, *common, "--stop-after", "2"))
    shutil.rmtree(out / "checkpoints")
    fails(
        recipe,
        lm_args(tiny_lm, out, *common, "--lr", "1e-2", "--resume-from", "latest"),
        capsys,
        "lr: 0.003 there, 0.01 now",
    )
    capsys.readouterr()
    run(recipe, lm_args(tiny_lm, out, *common, "--resume-from", "latest"))
    assert "no checkpoint in" in capsys.readouterr().out
    assert_same_weights(tmp_path / "full", out)
    assert read_report(out)["steps"] == 4
