"""Issue 18, "found by trying the README as a new user would": the recipe's finder, its warnings,
file modes, log lines and the README's commands, each on the real script."""

from __future__ import annotations

import os
import re
import stat
import sys
import warnings
from pathlib import Path

import pytest
from recipe_utils import ACCELERATE, AUTO_BATCH, RECIPE, ROOT, fails, launch, lm_args, reset_accelerate, run, snapshot

README = ROOT / "README.md"


def _eager_compile_policy(tmp_path: Path) -> str:
    """A compile policy whose compile is cheap on CPU (the eager backend): the recipe treats it as
    any compile policy (every batch padded to --seq-len)."""
    path = tmp_path / "compiled.yaml"
    path.write_text("precision: fp32\ncompile:\n  mode: full\n  backend: eager\n")
    return str(path)


def _with_policy(args: list, policy: str) -> list:
    args = list(args)
    args[args.index("--policy") + 1] = policy
    return args


@pytest.mark.parametrize("compiled", [True, False], ids=["compile", "eager"])
def test_the_finder_measures_the_batches_training_runs(recipe, tiny_lm, tmp_path, monkeypatch, compiled):
    """Issue 18: under compile every training batch is padded to --seq-len, while the finder measured
    batches padded to the longest sample (45 of 2048 tokens in the README's command). Every batch
    the finder measures has the shape of the widest batch the training loader yields."""
    import hf_memstack

    shapes: list[tuple[int, tuple[int, ...]]] = []
    real = hf_memstack.find_batch_size

    def spy(model, make_batch, *args, **kwargs):  # the real finder, on make_batch's batches, recorded
        def recorded(n):
            batch = make_batch(n)
            shapes.append((n, tuple(batch["input_ids"].shape)))
            return batch

        return real(model, recorded, *args, **kwargs)

    monkeypatch.setattr(hf_memstack, "find_batch_size", spy)
    args = lm_args(tiny_lm, tmp_path / "out", *AUTO_BATCH)
    if compiled:
        args = _with_policy(args, _eager_compile_policy(tmp_path))
    reset_accelerate()
    job = recipe.setup(recipe.parse_config([str(a) for a in args]))
    try:
        widths = [batch["input_ids"].shape[1] for batch in job.train_dl]
    finally:
        job.accelerator.end_training()
    assert shapes, "the finder built no batch"
    assert all(shape == (n, max(widths)) for n, shape in shapes), (shapes, sorted(set(widths)))
    if compiled:
        assert set(widths) == {16}  # --seq-len
    assert job.batch_size in {n for n, _ in shapes}  # the answer is a size the finder ran


def _eval_mode_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "eval mode" in str(w.message)]


def test_the_recipe_does_not_warn_about_eval_mode(recipe, tiny_lm, tmp_path):
    """from_pretrained returns models in eval mode and the recipe trains in train mode: the project's
    own script must not tell its users to call model.train()."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(recipe, _with_policy(lm_args(tiny_lm, tmp_path / "out", "--max-steps", "2"), "fp32+ckpt"))
    assert not _eval_mode_warnings(caught)


@pytest.mark.slow
def test_recipes_trainer_does_not_warn_about_eval_mode(tmp_path):
    """recipes/trainer.py (MiniLM through Trainer, with checkpointing) runs without the eval-mode warning."""
    done = launch(
        [
            sys.executable,
            "-W",
            "always",
            ROOT / "recipes" / "trainer.py",
            "--policy",
            "fp32+ckpt",
            "--max_steps",
            "2",
            "--output_dir",
            tmp_path / "out",
        ]
    )
    assert "eval mode" not in done.stderr + done.stdout, done.stderr[-3000:]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def test_saved_files_follow_the_umask(recipe, tiny_lm, tmp_path, umask_022):
    """safetensors writes its files 0600 (a temporary file renamed into place): the recipe's weights,
    checkpoints and merged LoRA model were unreadable by the team while every other file was 0644."""
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "2", "--save-every", "2", "--lora-r", "4", "--merge-lora"))
    modes = _modes(out)
    for name in (
        "model/adapter_model.safetensors",
        "model/merged/model.safetensors",
        "checkpoints/step-0000002/model.safetensors",
    ):
        assert name in modes, sorted(modes)
    assert set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items() if v != 0o644}


def test_full_model_weights_follow_the_umask(recipe, tiny_lm, tmp_path, umask_022):
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "2"))
    assert stat.S_IMODE((out / "model" / "model.safetensors").stat().st_mode) == 0o644


def test_log_lines_say_what_they_measured(recipe, tiny_lm, tmp_path, capsys):
    """Under compile on CPU no meter measures the peak: the log says why once, and no line prints
    None. A run shorter than --log-every has one log line: the summary does not read 'loss X -> X'."""
    args = _with_policy(
        lm_args(tiny_lm, tmp_path / "out", "--max-steps", "3", "--log-every", "10"), _eager_compile_policy(tmp_path)
    )
    capsys.readouterr()
    report = run(recipe, args)
    out = capsys.readouterr().out
    assert "None" not in out, out
    assert "peak memory is not logged on this run" in out and "under compile" in out
    assert [h["step"] for h in report["history"]] == [3]
    loss = report["history"][0]["loss"]
    assert f"loss {loss:.4f} (one log line, the mean over steps 1-3" in out
    assert f"loss {loss:.4f} -> {loss:.4f}" not in out


def test_the_readme_names_checkpoints_as_the_recipe_writes_them(recipe, tiny_lm, tmp_path):
    run(recipe, lm_args(tiny_lm, tmp_path / "out", "--max-steps", "2", "--save-every", "2"))
    written = [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()]
    assert written == ["step-0000002"]
    mentions = re.findall(r"checkpoints/(step-[^\s/`),]+)", README.read_text())
    assert mentions, "the README no longer says where checkpoints go"
    pattern = re.compile(r"step-(\d{7}|N{7})(\.tmp)?")
    assert all(pattern.fullmatch(m) for m in mentions), mentions


def test_memory_plot_without_matplotlib_is_refused_before_anything_runs(recipe, tiny_lm, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without matplotlib sees
    out = tmp_path / "out"
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--memory-plot"),
        capsys,
        "memory_plot=True",
        "pip install 'hf_memstack[plot]'",
    )
    assert snapshot(out) is None


def _readme_main_command() -> list[str]:
    """The README's 'run the main job' command, without its install steps."""
    block = re.search(r"# 1\. run the main job[^\n]*\n([^\n]+)", README.read_text())
    assert block, "the README lost its main command"
    command = block.group(1).split("&&")[-1].split()
    if command[:2] == ["accelerate", "launch"]:
        return [*ACCELERATE, *command[2:]]
    assert command[0] in ("python", "python3"), command
    return [sys.executable, *command[1:]]


@pytest.mark.slow
def test_the_readmes_main_command_ends_a_refusal_cleanly(tmp_path):
    """Issue 18: under `accelerate launch` a refusal printed its message, then Accelerate's
    CalledProcessError traceback. The README's main command ends with the one message, status 2."""
    command = _readme_main_command()
    assert command[-1].endswith("recipes/finetune.py")
    done = launch([*command, "--bad-flag"], check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "CalledProcessError" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("finetune.py: error: unknown argument(s) '--bad-flag'; see --help for the flags") == 1, (
        done.stderr[-3000:]
    )


@pytest.mark.slow
def test_accelerate_launch_quiet_keeps_the_launchers_traceback_out(tiny_lm, tmp_path):
    """What the README says for one process under accelerate launch anyway: -q leaves the recipe's one message."""
    done = launch(
        [*ACCELERATE, "-q", "--num_processes", "1", "--cpu", RECIPE, "--bad-flag"],
        check=False,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "finetune.py: error: unknown argument(s) '--bad-flag'" in done.stderr
