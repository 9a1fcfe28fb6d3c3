"""A run directory someone else could write into never makes the recipe write, remove or read
outside it, and one run at a time writes into it.

Was (issue 38): a planted ``recipe_manifest.json.tmp`` or ``report.json.tmp`` symlink had the
manifest or report written into the file it points to; a ``checkpoints/step-N(.tmp)`` symlink had
the next save's sweep or the rotation delete ``checkpoint.json`` in the linked folder, then die on
``OSError: Cannot call rmtree on a symbolic link``; a ``checkpoint.json`` listing ``../../../x``
was refused only after the outside file was stat'ed, and its size printed; JSON nested 100,000
deep ended in a RecursionError; a ``trainer_state.json`` with ``step = 10**18`` trained zero steps
and saved the checkpoint's weights as the final model; two runs at once in one directory had one
die on a raw FileNotFoundError when the other's save swept its ``.tmp``. Round 2: a folder planted
at ``report.json`` lost the report after the whole run (IsADirectoryError), one at
``recipe_manifest.json.tmp`` was found only after --overwrite had removed the previous run; a
manifest name over 255 bytes stopped --overwrite halfway with 'File name too long'; a file name or a
checkpoint's logged step with terminal escapes was printed raw; a NaN logged loss made report.json
invalid JSON; a FIFO at model.safetensors read as "no file named model.safetensors"."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from recipe_utils import (
    RECIPE,
    ROOT,
    fails,
    lm_args,
    load_recipe,
    read_report,
    reset_accelerate,
    run,
    snapshot,
    torchrun,
)

# A run stopped at step 4 of 8, checkpoints at steps 2 and 4: resuming it saves at 6 and 8 (each
# save sweeps stale folders first, then rotates: --keep-last 2 removes step 4 at the save of 8).
STOPPED = ["--max-steps", "8", "--save-every", "2"]
# A finished run of 4 steps, checkpoints at 2 and 4: resuming it trains nothing and writes the
# manifest, run_config.yaml, the model and the report again.
FINISHED = ["--max-steps", "4", "--save-every", "2"]


def _made(tiny_lm, root: Path, *args: str) -> Path:
    out = root / "out"
    reset_accelerate()
    load_recipe().main([str(a) for a in lm_args(tiny_lm, out, *args)])
    reset_accelerate()
    return out


@pytest.fixture(scope="module")
def stopped(tiny_lm, tmp_path_factory):
    return _made(tiny_lm, tmp_path_factory.mktemp("stopped"), *STOPPED, "--stop-after", "4")


@pytest.fixture(scope="module")
def finished(tiny_lm, tmp_path_factory):
    return _made(tiny_lm, tmp_path_factory.mktemp("finished"), *FINISHED)


def _copy(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "runs" / "out"
    shutil.copytree(base, out, symlinks=True)
    return out


def _rewrite_checkpoint_manifest(ckpt: Path, **fields) -> None:
    """Make checkpoint.json agree with the files again (sizes), as a forger would."""
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"] = {name: (ckpt / name).stat().st_size for name in manifest["files"]}
    manifest.update(fields)
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


# ----------------------------------------------------------------------------- files written through a link
@pytest.mark.parametrize(
    "name", ["recipe_manifest.json.tmp", "report.json.tmp", "run_config.yaml.tmp", "memory.png", "report.json"]
)
def test_a_planted_link_at_a_name_the_recipe_writes_is_never_written_through(recipe, tiny_lm, finished, tmp_path, name):
    out = _copy(finished, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the recipe's file\n")
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(victim)
    report = run(recipe, lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest", "--memory-plot"))
    assert report["steps"] == 4
    assert victim.read_bytes() == b"not the recipe's file\n"
    # The link itself was replaced by the recipe's own file (or removed with its temporary).
    assert not (out / name).is_symlink()
    assert json.loads((out / "report.json").read_text())["steps"] == 4


# ----------------------------------------------------------------------------- checkpoint folders that are links
def _outside_checkpoint(stopped: Path, tmp_path: Path, *, complete: bool) -> Path:
    """A checkpoint folder outside the run (a copy of its step 4), complete or missing a listed file."""
    outside = tmp_path / "elsewhere" / "ckpt"
    shutil.copytree(stopped / "checkpoints" / "step-0000004", outside)
    if not complete:
        (outside / "optimizer.bin").unlink()
    return outside


@pytest.mark.parametrize(
    "entry, complete",
    [
        ("step-0000013.tmp", True),  # a "stale save": the next save's sweep removed it
        ("step-0000003", False),  # an incomplete checkpoint older than the newest: swept too
        ("step-0000005", False),  # an incomplete one newer than the newest complete one
        ("step-0000004", True),  # the newest complete one, replaced by a link: resumed, then rotated away
    ],
)
def test_a_checkpoint_entry_that_is_a_link_is_refused_up_front(
    recipe, tiny_lm, stopped, tmp_path, capsys, entry, complete
):
    out = _copy(stopped, tmp_path)
    outside = _outside_checkpoint(stopped, tmp_path, complete=complete)
    link = out / "checkpoints" / entry
    if link.exists():
        shutil.rmtree(link)
    link.symlink_to(outside, target_is_directory=True)
    before, around = snapshot(out), snapshot(outside)
    fails(
        recipe,
        lm_args(tiny_lm, out, *STOPPED, "--resume-from", "latest"),
        capsys,
        f"checkpoints/{entry} is a symlink (to {outside})",
        "nothing was loaded or written",
        "Remove the link",
    )
    assert snapshot(outside) == around and snapshot(out) == before


def test_a_manifest_that_is_a_link_is_refused(recipe, tiny_lm, finished, tmp_path, capsys):
    """recipe_manifest.json decides what --overwrite removes: one read through a link is not this run's."""
    out = _copy(finished, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.copy2(out / "recipe_manifest.json", outside)
    (out / "recipe_manifest.json").unlink()
    (out / "recipe_manifest.json").symlink_to(outside)
    before, around = snapshot(out), outside.read_bytes()
    fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, "--overwrite"),
        capsys,
        f"recipe_manifest.json is a symlink (to {outside})",
        "Remove the link",
    )
    assert snapshot(out) == before and outside.read_bytes() == around


# ----------------------------------------------------------------------------- checkpoint.json names
@pytest.mark.parametrize("listed", ["../../../outside.bin", "ABSOLUTE", "a/../../outside.bin"])
def test_a_listed_name_outside_the_checkpoint_is_refused_before_it_is_touched(
    recipe, tiny_lm, finished, tmp_path, capsys, listed
):
    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step-0000004"
    outside = (ckpt / "../../../outside.bin").resolve()
    outside.write_bytes(b"x" * 12345)  # a size only a stat of the outside file could print
    listed = str(outside) if listed == "ABSOLUTE" else listed
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"][listed] = 7
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    err = fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, "--resume-from", str(ckpt)),
        capsys,
        f"lists {listed!r}, not a file inside the checkpoint",
    )
    assert "12345" not in err and "12,345" not in err
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- JSON that is not what it seems
def _fifo_unblocker(path: Path, after_s: float) -> threading.Timer:
    """If a read of the FIFO ``path`` blocks, open it for writing after ``after_s`` (the read then
    ends): a regression fails the test instead of hanging it."""

    def unblock() -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    timer = threading.Timer(after_s, unblock)
    timer.start()
    return timer


@pytest.mark.parametrize("kind", ["nested", "fifo"])
@pytest.mark.parametrize("name", ["recipe_manifest.json", "checkpoint.json", "trainer_state.json"])
def test_json_read_from_the_run_directory_is_a_clear_error(recipe, tiny_lm, finished, tmp_path, capsys, name, kind):
    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step-0000004"
    path = out / name if name == "recipe_manifest.json" else ckpt / name
    path.unlink()
    if kind == "nested":
        path.write_text("[" * 100_000)
    else:
        os.mkfifo(path)
    if name == "trainer_state.json":
        _rewrite_checkpoint_manifest(ckpt)
    expected = "nested too deeply" if kind == "nested" else "a FIFO"
    timer = _fifo_unblocker(path, 60) if kind == "fifo" else None
    start = time.monotonic()
    try:
        fails(recipe, lm_args(tiny_lm, out, *FINISHED, "--resume-from", str(ckpt)), capsys, name, expected)
    finally:
        if timer is not None:
            timer.cancel()
    assert time.monotonic() - start < 50


# ----------------------------------------------------------------------------- the step a checkpoint says it is at
@pytest.mark.parametrize("where", ["folder-name", "total"])
def test_a_received_step_past_the_run_or_its_folder_is_refused(recipe, tiny_lm, finished, tmp_path, capsys, where):
    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step-0000004"
    huge = 10**18
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["step"] = huge
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _rewrite_checkpoint_manifest(ckpt, **({"step": huge} if where == "total" else {}))
    if where == "total":  # the folder (and checkpoint.json's step) made to agree: only the run's total can tell
        ckpt = ckpt.rename(ckpt.with_name(f"step-{huge:07d}"))
        shutil.rmtree(out / "checkpoints" / "step-0000002")
        expected = [f"step={huge}", "past this run's last step", "4", "--max-steps"]
    else:
        expected = [f"step={huge}", "step-0000004", "resume from a checkpoint this recipe wrote"]
    before = snapshot(out)
    fails(recipe, lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest"), capsys, "trainer_state.json", *expected)
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- one run at a time
def _start(tiny_lm, out: Path, hook: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["HF_MEMSTACK_RECIPE_TEST_HOOK"] = hook
    return subprocess.Popen(
        [sys.executable, str(RECIPE), *[str(a) for a in lm_args(tiny_lm, out, *args)]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the first run never wrote {path} (exit {proc.wait()}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_second_run_is_refused_while_the_first_runs_and_a_killed_run_blocks_nothing(
    recipe, tiny_lm, tmp_path, capsys
):
    out = tmp_path / "out"
    # The first run saves step 2, then hangs in step 3 (holding the directory) until killed.
    first = _start(tiny_lm, out, "hang@step-3", *STOPPED)
    try:
        _wait_for(out / "checkpoints" / "step-0000002", first)
        for extra in (["--resume-from", "latest"], ["--overwrite"], []):
            fails(
                recipe,
                lm_args(tiny_lm, out, *STOPPED, *extra),
                capsys,
                f"output_dir={str(out)!r} is in use by another run of this recipe (pid {first.pid}",
                "nothing was loaded or written",
            )
        assert first.poll() is None  # still running: the refusals touched nothing of it
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    # Killed, its lock went with it: the same command resumes.
    report = run(recipe, lm_args(tiny_lm, out, *STOPPED, "--resume-from", "latest"))
    assert report["steps"] == 8 and [h["step"] for h in report["history"]][-1] == 8
    manifest = json.loads((out / "recipe_manifest.json").read_text())
    assert "recipe.lock" in manifest["files"]  # claimed: --overwrite keeps it, the foreign-file check knows it
    report = run(recipe, lm_args(tiny_lm, out, *STOPPED, "--overwrite"))
    assert report["steps"] == 8


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *_descendants(int(child))]
    return found


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_rank_0_holds_the_lock_and_a_refusal_ends_both_ranks(tiny_lm, tmp_path):
    """Only the main process (RANK 0) takes the lock; refused, it ends the whole run with its
    message; a 2-process run killed (its whole process group) blocks nothing."""
    from recipe_utils import TORCHRUN

    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [*TORCHRUN, str(RECIPE), *[str(a) for a in lm_args(tiny_lm, out, *STOPPED)]],
        cwd=ROOT,
        env={**env, "HF_MEMSTACK_RECIPE_TEST_HOOK": "hang@step-3"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for(out / "checkpoints" / "step-0000002", first)
        start = time.monotonic()
        proc = torchrun(tiny_lm, out, *STOPPED, "--resume-from", "latest", check=False, timeout=300)
        assert proc.returncode != 0 and time.monotonic() - start < 200
        assert "is in use by another run of this recipe (pid " in proc.stderr, proc.stderr[-3000:]
        holder = int(proc.stderr.split("of this recipe (pid ")[1].split(")")[0])
        assert holder in _descendants(first.pid)  # the first run's rank 0
        assert first.poll() is None
        os.kill(holder, signal.SIGKILL)  # torchrun then stops rank 1 and ends
        first.wait(timeout=120)
    finally:
        for pid in [first.pid, *_descendants(first.pid)]:  # torchrun's workers run in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.wait(timeout=60)
    torchrun(tiny_lm, out, *STOPPED, "--resume-from", "latest")
    assert read_report(out)["steps"] == 8 and read_report(out)["world_size"] == 2


def test_a_run_planned_on_an_empty_directory_is_refused_if_another_took_it_meanwhile(recipe, tiny_lm, tmp_path):
    """Two runs started at once on a new directory both find it empty; the one that reaches its
    first write second finds the other's files (and, while it runs, its lock) and writes nothing."""
    from finetune_support.run_lock import lock_for_writing, release_run_locks

    out = tmp_path / "out"
    late = recipe.plan_output(recipe.parse_config([str(a) for a in lm_args(tiny_lm, out, *FINISHED)]))
    run(recipe, lm_args(tiny_lm, out, *FINISHED))  # the other run, start to finish
    before = snapshot(out)
    try:
        with pytest.raises(recipe.RecipeError) as e:
            lock_for_writing(out, planned_on=late.entries)
    finally:
        release_run_locks()
    assert "another run wrote into it" in str(e.value) and "nothing was written" in str(e.value)
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- the user's own files
@pytest.mark.parametrize("name, content", [("c.json", "[" * 100_000), ("c.yaml", "[" * 100_000), ("c.yaml", None)])
def test_a_config_file_nested_too_deeply_or_a_fifo_is_a_clear_error(recipe, tmp_path, capsys, name, content):
    path = tmp_path / name
    path.write_text(content) if content is not None else os.mkfifo(path)
    timer = _fifo_unblocker(path, 30) if content is None else None
    start = time.monotonic()
    try:
        with pytest.raises(recipe.RecipeError) as e:
            recipe.parse_config(["--config", str(path)])
    finally:
        if timer is not None:
            timer.cancel()
    assert f"--config {str(path)!r}" in str(e.value) or f"--config {path}" in str(e.value)
    assert ("a FIFO" if content is None else "nested too deeply") in str(e.value)
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("text", ["[" * 100_000, '{"text": "a"}\n' + "[" * 100_000 + "\n"], ids=["array", "lines"])
def test_data_nested_too_deeply_is_a_clear_error(tmp_path, text):
    from finetune_support.common import RecipeError
    from finetune_support.rows import read_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    with pytest.raises(RecipeError) as e:
        read_rows(path)
    assert str(path) in str(e.value) and "nested too deeply" in str(e.value)


# ----------------------------------------------------------------------------- names the recipe writes, taken
@pytest.mark.parametrize("name", ["model", "checkpoints"])
def test_a_file_where_the_recipe_writes_a_folder_is_refused_up_front(recipe, tiny_lm, finished, tmp_path, capsys, name):
    out = _copy(finished, tmp_path)
    shutil.rmtree(out / name)
    (out / name).write_text("mine")
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, "--overwrite"),
        capsys,
        f"{name} is a file of yours, where the recipe writes its {name}/ folder",
        "nothing was loaded or written",
    )
    assert snapshot(out) == before


def test_a_lock_file_that_is_a_hard_link_is_refused_and_never_written(recipe, tiny_lm, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("not the recipe's")
    (out / "recipe.lock").unlink()
    os.link(victim, out / "recipe.lock")
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest"),
        capsys,
        "recipe.lock is a file with 2 names",
        "never a hard link",
    )
    assert victim.read_text() == "not the recipe's" and snapshot(out) == before


def test_a_file_of_yours_named_like_the_lock_is_yours(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "recipe.lock").write_text("my notes on locks")
    before = snapshot(out)
    fails(recipe, lm_args(tiny_lm, out, *FINISHED), capsys, "holds files this recipe did not write (recipe.lock)")
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "name, args",
    [
        ("report.json", ["--resume-from", "latest"]),
        ("run_config.yaml", ["--resume-from", "latest"]),
        ("recipe_manifest.json.tmp", ["--overwrite"]),
    ],
)
def test_a_folder_where_the_recipe_writes_a_file_is_refused_before_anything_is_removed(
    recipe, tiny_lm, finished, tmp_path, capsys, name, args
):
    out = _copy(finished, tmp_path)
    shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)
    (out / name).mkdir()
    (out / name / "mine.txt").write_text("mine")
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, *args),
        capsys,
        f"{name} is a directory, where the recipe writes a file of its own",
        "nothing was loaded, removed or written",
    )
    assert snapshot(out) == before


@pytest.mark.parametrize("kind, args", [("dirs", ["--resume-from", "latest"]), ("files", ["--overwrite"])])
def test_a_listed_name_too_long_for_a_file_name_is_refused_before_anything_is_removed(
    recipe, tiny_lm, finished, tmp_path, capsys, kind, args
):
    out = _copy(finished, tmp_path)
    manifest = json.loads((out / "recipe_manifest.json").read_text())
    manifest[kind].append("x" * 300)
    (out / "recipe_manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, *args),
        capsys,
        f"{kind}: 'xxx",
        "(300 bytes)",
        "nothing was removed or written",
    )
    assert snapshot(out) == before


def test_an_output_dir_name_too_long_for_a_file_name_is_refused(recipe, tiny_lm, tmp_path, capsys):
    fails(
        recipe,
        lm_args(tiny_lm, tmp_path / ("y" * 300), *FINISHED),
        capsys,
        "is 300 bytes, longer than the",
        "choose a shorter --output-dir",
    )
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- what the recipe prints and reports
ESCAPES = "evil\x1b]0;PWNED\x07\x1b[31mRED"


def _edit_trainer_state(out: Path, edit) -> None:
    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _rewrite_checkpoint_manifest(ckpt)


def test_a_file_name_with_terminal_escapes_is_printed_escaped(recipe, tiny_lm, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    (out / ESCAPES).write_text("mine")
    reset_accelerate()
    capsys.readouterr()
    recipe.main([str(a) for a in lm_args(tiny_lm, out, *FINISHED, "--overwrite")])
    printed = "".join(capsys.readouterr())
    assert "\x1b" not in printed and "\x07" not in printed
    assert "kept yours: evil\\x1b]0;PWNED\\x07\\x1b[31mRED" in printed
    assert (out / ESCAPES).read_text() == "mine"


def test_a_logged_step_with_terminal_escapes_is_never_printed_raw(recipe, tiny_lm, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    _edit_trainer_state(out, lambda s: s["log_history"][0].update(step=ESCAPES))
    reset_accelerate()
    capsys.readouterr()
    with contextlib.suppress(SystemExit):  # refused as a bad checkpoint or resumed: either way, escaped
        recipe.main([str(a) for a in lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest")])
    printed = "".join(capsys.readouterr())
    assert "\x1b" not in printed and "\x07" not in printed
    assert "\\x1b]0;PWNED" in printed


def test_a_logged_loss_that_is_nan_is_null_in_a_valid_report(recipe, tiny_lm, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    _edit_trainer_state(out, lambda s: s["log_history"][0].update(loss=float("nan")))
    reset_accelerate()
    try:
        recipe.main([str(a) for a in lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest")])
    except SystemExit:  # a checkpoint check may refuse the NaN itself: then report.json is the old one
        assert "nan" in capsys.readouterr().err.lower()
    report = json.loads((out / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    if report["history"][0]["loss"] is None:
        assert report["first_logged_loss"] is None
        assert report["non_finite_as_null"] == ["first_logged_loss", "history[0].loss"]


def test_finite_json_writes_non_finite_numbers_as_null_and_says_where():
    from finetune_support.report import finite_json

    text, where = finite_json({"a": [1.0, float("inf")], "b": {"c": float("nan")}, "d": "NaN"})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "a": [1.0, None],
        "b": {"c": None},
        "d": "NaN",
    }
    assert where == ["a[1]", "b.c"]


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_fifo_in_the_model_folder_is_named_before_anything_is_loaded(recipe, tiny_lm, tmp_path, capsys, name):
    model = tmp_path / "model"
    shutil.copytree(tiny_lm["model"], model)
    (model / name).unlink()
    os.mkfifo(model / name)
    out = tmp_path / "out"
    timer = _fifo_unblocker(model / name, after_s=60)
    try:
        fails(
            recipe,
            [*lm_args(tiny_lm, out, *FINISHED), "--model", str(model)],
            capsys,
            f"{name} is a FIFO (named pipe), not a regular file",
            "nothing was loaded or written",
        )
    finally:
        timer.cancel()
    assert not out.exists()


# ----------------------------------------------------------------------------- entries checkpoint.json does not list
def _checkpoint(root: Path) -> Path:
    """A checkpoint folder as the recipe's saves lay it out (small files, a manifest listing each at its size)."""
    ckpt = root / "checkpoints" / "step-0000004"
    ckpt.mkdir(parents=True)
    names = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "run_config.yaml"]
    for name in names:
        (ckpt / name).write_bytes(name.encode() * 3)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4}))
    files = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    (ckpt / "checkpoint.json").write_text(json.dumps({"step": 4, "files": files}))
    return ckpt


def _unlist(ckpt: Path, name: str) -> None:
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    del manifest["files"][name]
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name, kind",
    [
        ("model.safetensors", "fifo"),  # was: resume blocked forever in safetensors' open (SIGTERM did not end it)
        ("random_states_0.pkl", "fifo"),  # was: blocked in torch.load
        ("model.safetensors", "outside"),  # was: the weights loaded from the file outside the checkpoint
        ("optimizer.bin", "/dev/zero"),  # was: torch's "weights_only=False" advice, naming no file
        ("sharded/extra.distcp", "file"),  # at any depth
    ],
)
def test_an_entry_checkpoint_json_does_not_list_makes_the_checkpoint_incomplete(tmp_path, name, kind):
    from finetune_support.checkpoint_dirs import inspect_checkpoint

    ckpt = _checkpoint(tmp_path)
    assert inspect_checkpoint(ckpt).problem is None
    if kind == "file":
        (ckpt / name).parent.mkdir()
        (ckpt / name).write_bytes(b"x")
        what = "a regular file"
    else:
        _unlist(ckpt, name)
        (ckpt / name).unlink()
    if kind == "fifo":
        os.mkfifo(ckpt / name)
        what = "a FIFO (named pipe)"
    elif kind != "file":
        target = Path("/dev/zero") if kind == "/dev/zero" else tmp_path / "outside.safetensors"
        target.touch()
        (ckpt / name).symlink_to(target)
        what = f"a symlink (to {target})"
    problem = inspect_checkpoint(ckpt).problem
    assert problem is not None and problem.startswith(f"{name} is {what} that its checkpoint.json does not list")
    assert "remove it, or resume from a checkpoint this recipe wrote" in problem


@pytest.mark.parametrize("change", ["empty", "no-trainer-state", "long-name"])
def test_a_checkpoint_json_listing_too_little_or_a_name_too_long_is_incomplete(tmp_path, change):
    from finetune_support.checkpoint_dirs import inspect_checkpoint

    ckpt = _checkpoint(tmp_path)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    if change == "empty":
        for name in manifest["files"]:
            (ckpt / name).unlink()  # nothing left to list: {} would check nothing
        manifest["files"] = {}
        expected = ["does not list trainer_state.json", "the model's weights"]
    elif change == "no-trainer-state":
        (ckpt / "trainer_state.json").unlink()
        del manifest["files"]["trainer_state.json"]
        expected = ["does not list trainer_state.json, which every checkpoint of this recipe holds"]
    else:
        manifest["files"]["x" * 300 + ".bin"] = 1  # was: OSError File name too long
        expected = ["lists a name too long for a file", "304 bytes"]
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    problem = inspect_checkpoint(ckpt).problem
    assert problem is not None
    for fragment in expected:
        assert fragment in problem


def test_a_folder_at_a_checkpoints_manifest_name_is_removed_with_it_never_through_a_link(tmp_path):
    """Was: IsADirectoryError from remove_checkpoint (the save at the next step lost, --overwrite died)."""
    from finetune_support.checkpoint_dirs import inspect_checkpoint, remove_checkpoint

    ckpt = _checkpoint(tmp_path)
    (ckpt / "checkpoint.json").unlink()
    (ckpt / "checkpoint.json").mkdir()
    outside = tmp_path / "kept.txt"
    outside.write_text("kept")
    (ckpt / "checkpoint.json" / "link").symlink_to(outside)
    assert "is a directory" in (inspect_checkpoint(ckpt).problem or "")
    remove_checkpoint(ckpt)
    assert not ckpt.exists() and outside.read_text() == "kept"


# ----------------------------------------------------------------------------- every field a received state holds
@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("batches_in_epoch", 10**18, "batches_in_epoch=1000000000000000000, past the"),
        ("epoch", 4, "epoch=4 after step=4, where an epoch is"),
        ("log_history", "x", "log_history='x' is not a list"),
        ("log_history", [1, 2], "log_history[0]='1' is not a logged row"),
        ("log_history", [{"step": 1, "loss": "\x1b[31m"}], "log_history[0]['loss']"),
        ("resolved.batch_size", "abc", "resolved.batch_size='abc' is not a positive integer"),
        ("resolved.batch_size", -3, "resolved.batch_size='-3' is not a positive integer"),
        ("resolved.batch_size", 3, "resolved batch_size=3, grad_accum=1; this run resolves batch_size=8"),
    ],
)
def test_a_forged_field_of_the_received_state_is_refused_before_training(
    recipe, tiny_lm, finished, tmp_path, capsys, field, value, expected
):
    """Each of these trained on with data skipped, or failed mid-run or in save() with a raw error."""
    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step-0000004"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["epoch"] == 0 and state["step"] == 4  # the fixture's run: 4 steps inside its first epoch
    if field.startswith("resolved."):
        state["resolved"][field.split(".")[1]] = value
    else:
        state[field] = value
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _rewrite_checkpoint_manifest(ckpt)
    before = snapshot(out)
    fails(recipe, lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest"), capsys, "trainer_state.json", expected)
    assert snapshot(out) == before


def test_a_manifest_whose_run_record_is_not_a_record_is_refused(recipe, tiny_lm, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    manifest = json.loads((out / "recipe_manifest.json").read_text())
    manifest["run"] = "x"
    (out / "recipe_manifest.json").write_text(json.dumps(manifest))
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest"),
        capsys,
        "recipe_manifest.json is unreadable",
        "its 'run' is 'x'",
    )
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- what optimizer.bin and scheduler.bin say
def _forge(ckpt: Path, name: str, edit) -> None:
    import torch

    state = torch.load(ckpt / name, weights_only=True)
    edit(state)
    torch.save(state, ckpt / name)
    _rewrite_checkpoint_manifest(ckpt)


def _nan_second_moment(state) -> None:
    moment = next(iter(state["state"].values()))["exp_avg_sq"]
    moment.view(-1)[0] = float("nan")


@pytest.mark.parametrize(
    "name, edit, expected",
    [
        (
            "optimizer.bin",
            lambda s: s["param_groups"][0].update(weight_decay=300.0),
            "param_groups[0].weight_decay: 300.0 there",
        ),
        ("scheduler.bin", lambda s: s.update(base_lrs=[-0.5, -0.5]), "scheduler base_lrs: [-0.5, -0.5] there"),
        ("optimizer.bin", _nan_second_moment, "optimizer state holds nan values"),
    ],
    ids=["weight-decay", "base-lrs", "nan-moment"],
)
def test_a_forged_optimizer_or_schedule_is_refused_before_training(
    recipe, tiny_lm, finished, tmp_path, capsys, name, edit, expected
):
    """Each of these trained on: a weight decay of 300, a negative learning rate, or a NaN first step
    whose advice (resume this checkpoint with a lower lr) repeated it."""
    out = _copy(finished, tmp_path)
    _forge(out / "checkpoints" / "step-0000004", name, edit)
    before = snapshot(out)
    fails(recipe, lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest"), capsys, expected)
    assert snapshot(out) == before


@pytest.mark.parametrize(
    "name, edit, expected",
    [
        ("scheduler.bin", lambda s: s.update(last_epoch=1, _step_count=2), "scheduler last_epoch: 1 there, at step 4"),
        ("optimizer.bin", lambda s: s["param_groups"][0].update(lr=float("nan")), "param_groups[0].lr: nan there"),
    ],
    ids=["schedule-position", "nan-lr"],
)
def test_a_schedule_out_of_step_with_its_checkpoint_is_refused(
    recipe, tiny_lm, finished, tmp_path, capsys, name, edit, expected
):
    """A forged schedule position ran step 6 at 4x its learning rate; a NaN lr made the first step NaN."""
    out = _copy(finished, tmp_path)
    _forge(out / "checkpoints" / "step-0000004", name, edit)
    before = snapshot(out)
    fails(recipe, lm_args(tiny_lm, out, *FINISHED, "--resume-from", "latest"), capsys, expected)
    assert snapshot(out) == before
