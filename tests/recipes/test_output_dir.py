"""The output directory: the recipe removes only what it wrote (its manifest), keeps your files,
never follows a symlink, and refuses what would mix two runs. Was: --overwrite deleted everything
(and a symlinked folder inside stopped it half-way), and its refusal invited --overwrite for a
directory of someone else's files."""

import json
import os
import shutil

import pytest
from recipe_utils import fails, lm_args, read_report, run, snapshot


def test_overwrite_removes_only_the_recipes_files(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2"))
    written = json.loads((out / "recipe_manifest.json").read_text())
    assert "run_config.yaml" in written["files"] and "model/model.safetensors" in written["files"]
    (out / "notes.txt").write_text("mine")
    (out / "analysis").mkdir()
    (out / "analysis" / "plot.py").write_text("mine too")
    (out / "model" / "MY_README.md").write_text("about this model")
    (out / "checkpoints" / "which-one-is-best.txt").write_text("step 4")
    old_config = (out / "run_config.yaml").read_text()

    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--lr", "1e-4"),
        capsys,
        "already holds a run of this recipe",
        "--resume-from latest",
        "--overwrite",
        "yours are kept",
    )
    assert (out / "run_config.yaml").read_text() == old_config

    report = run(recipe, lm_args(tiny_lm, out, "--max-steps", "2", "--lr", "1e-4", "--overwrite"))
    assert report["steps"] == 2
    assert (out / "notes.txt").read_text() == "mine" and (out / "analysis" / "plot.py").read_text() == "mine too"
    assert (out / "model" / "MY_README.md").read_text() == "about this model"  # carried into the new model folder
    assert (out / "checkpoints" / "which-one-is-best.txt").read_text() == "step 4"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "which-one-is-best.txt"
    ]  # the old run's checkpoints went
    assert "lr: 0.0001" in (out / "run_config.yaml").read_text()


def test_overwrite_never_follows_a_symlink(recipe, tiny_lm, tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "2"))
    elsewhere.mkdir()
    (elsewhere / "precious.bin").write_bytes(b"\x00" * 100)
    (out / "data_link").symlink_to(elsewhere, target_is_directory=True)
    # A name the recipe wrote, replaced by a link to your file: the link is replaced, never the file.
    (tmp_path / "my_report.json").write_text("{}")
    os.remove(out / "report.json")
    (out / "report.json").symlink_to(tmp_path / "my_report.json")
    before = snapshot(elsewhere)

    run(recipe, lm_args(tiny_lm, out, "--max-steps", "2", "--overwrite"))
    assert (out / "data_link").is_symlink() and snapshot(elsewhere) == before
    assert (tmp_path / "my_report.json").read_text() == "{}"
    assert read_report(out)["steps"] == 2


def test_a_directory_of_other_files_is_refused_even_with_overwrite(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "run_config.yaml").write_text("not from this recipe")
    before = snapshot(out)
    err = fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2"),
        capsys,
        "holds files this recipe did not write (run_config.yaml, thesis.tex)",
        "choose an empty or new --output-dir",
    )
    assert "pass --overwrite" not in err
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--overwrite"),
        capsys,
        "--overwrite only removes files the recipe wrote itself",
    )
    assert snapshot(out) == before


def test_output_dir_that_is_a_file_or_has_a_broken_manifest(recipe, tiny_lm, tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    fails(recipe, lm_args(tiny_lm, target, "--max-steps", "2"), capsys, "is a file, not a directory")
    out = tmp_path / "out"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "2"))
    (out / "recipe_manifest.json").write_text("{broken")
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--overwrite"),
        capsys,
        "recipe_manifest.json is unreadable",
        "choose another --output-dir",
    )
    assert snapshot(out) == before


def test_resume_into_a_directory_holding_another_run(recipe, tiny_lm, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    run(recipe, lm_args(tiny_lm, a, "--max-steps", "4", "--save-every", "2", "--stop-after", "2"))
    run(recipe, lm_args(tiny_lm, b, "--max-steps", "2"))
    before = snapshot(b)
    ckpt = a / "checkpoints" / "step-0000002"
    fails(
        recipe,
        lm_args(tiny_lm, b, "--max-steps", "4", "--save-every", "2", "--resume-from", ckpt),
        capsys,
        "belongs to another run",
        "resume into an empty --output-dir",
        "--overwrite",
    )
    assert snapshot(b) == before
    report = run(
        recipe, lm_args(tiny_lm, b, "--max-steps", "4", "--save-every", "2", "--resume-from", ckpt, "--overwrite")
    )
    assert report["steps"] == 4 and [h["step"] for h in report["history"]] == [2, 4]


@pytest.mark.parametrize("name", ["model", "model.tmp", "checkpoints"])
def test_a_folder_the_recipe_writes_that_is_a_symlink_is_refused_before_training(
    recipe, tiny_lm, tmp_path, capsys, name
):
    """New-user trial: with out/model a symlink to another folder, --overwrite trained, evaluated,
    then crashed renaming model.tmp -> model (NotADirectoryError), model.tmp left behind."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    run(recipe, lm_args(tiny_lm, out, "--max-steps", "1"))
    if (out / name).exists():
        shutil.move(str(out / name), str(elsewhere))
    else:
        elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("mine")
    (out / name).symlink_to(elsewhere, target_is_directory=True)
    before, linked = snapshot(out), snapshot(elsewhere)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "1", "--overwrite"),
        capsys,
        f"{name} is a symlink (to {elsewhere})",
        "nothing was loaded or written",
        "Remove the link",
    )
    assert snapshot(out) == before and snapshot(elsewhere) == linked
