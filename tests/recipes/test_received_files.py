"""Files the recipe reads back that someone else may have written: the output directory's
recipe_manifest.json (what --overwrite removes) and a checkpoint given to --resume-from.

--overwrite removes only names inside the output directory: a manifest entry with '..', an
absolute path, or a name under a symlinked folder never removes anything outside it (was: the
names were joined onto the directory unchecked, so each of these deleted the victim file). A
forged checkpoint runs no code and is refused naming the file (was: on the fully_shard route a
forged sharded/.metadata with a matching manifest was unpickled, and a damaged RNG state was
skipped with a log line, so the resume silently drew other random numbers)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from recipe_utils import (
    ACCELERATE_FSDP,
    fails,
    launch,
    lm_args,
    load_recipe,
    reset_accelerate,
    run,
    snapshot,
    torchrun,
)


class _RunsCommand:
    """Unpickling it runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def base(tiny_lm, tmp_path_factory):
    """A finished run with checkpoints at steps 2 and 4, copied by each test that changes it."""
    out = tmp_path_factory.mktemp("base") / "out"
    reset_accelerate()
    load_recipe().main([str(a) for a in lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2")])
    reset_accelerate()
    return out


def _copy(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "runs" / "out"
    shutil.copytree(base, out, symlinks=True)
    return out


def _plant(out: Path, **extra: list) -> None:
    """Add entries to the output directory's recipe_manifest.json, as an edited manifest would."""
    path = out / "recipe_manifest.json"
    manifest = json.loads(path.read_text())
    for kind, names in extra.items():
        manifest[kind] = manifest.get(kind, []) + names
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "kind, entry",
    [
        ("files", "../victim.txt"),
        ("files", "ABSOLUTE"),
        ("trees", "../victims"),
        ("dirs", "model/../../empty"),
        ("files", 7),
    ],
    ids=["dotdot-file", "absolute-file", "dotdot-tree", "dotdot-inside-dir", "not-a-name"],
)
def test_overwrite_never_removes_outside_the_output_directory(recipe, tiny_lm, base, tmp_path, capsys, kind, entry):
    out = _copy(base, tmp_path)
    victim, victims, empty = out.parent / "victim.txt", out.parent / "victims", out.parent / "empty"
    victim.write_text("not the recipe's")
    victims.mkdir()
    (victims / "keep.txt").write_text("mine")
    empty.mkdir()  # what a 'dirs' entry removes: an empty folder
    entry = str(victim) if entry == "ABSOLUTE" else entry
    _plant(out, **{kind: [entry]})
    before, around = snapshot(out), snapshot(out.parent)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--overwrite"),
        capsys,
        "recipe_manifest.json lists names outside the directory",
        repr(entry),
        "nothing was removed",
        "choose another --output-dir",
    )
    assert snapshot(out) == before and snapshot(out.parent) == around
    assert victim.read_text() == "not the recipe's" and (victims / "keep.txt").read_text() == "mine" and empty.is_dir()


def test_overwrite_never_removes_through_a_symlinked_folder(recipe, tiny_lm, base, tmp_path, capsys):
    out = _copy(base, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    (elsewhere / "victim.txt").write_text("not the recipe's")
    (elsewhere / "sub" / "keep.txt").write_text("mine")
    (out / "link").symlink_to(elsewhere, target_is_directory=True)
    # Names inside the directory, but under a folder that is a symlink to somewhere else.
    _plant(out, files=["link/victim.txt"], trees=["link/sub"], dirs=["link/sub"])
    before = snapshot(elsewhere)
    capsys.readouterr()
    report = run(recipe, lm_args(tiny_lm, out, "--max-steps", "2", "--overwrite"))
    assert report["steps"] == 2
    assert snapshot(elsewhere) == before and (out / "link").is_symlink()
    log = capsys.readouterr().out
    assert "--overwrite: removed the previous run's files" in log and "kept yours: link" in log


def _forge_optimizer_state(ckpt: Path, marker: Path) -> None:
    """Replace the checkpoint's optimizer.bin by a pickle that runs a command, and make its
    manifest (checkpoint.json) agree with the files again, as a forger would."""
    buffer = io.BytesIO()
    torch.save(_RunsCommand(marker), buffer)
    (ckpt / "optimizer.bin").write_bytes(buffer.getvalue())
    _rewrite_checkpoint_manifest(ckpt)


def _rewrite_checkpoint_manifest(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"] = {name: (ckpt / name).stat().st_size for name in manifest["files"]}
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def test_a_forged_optimizer_state_runs_no_code(recipe, tiny_lm, base, tmp_path, capsys):
    # Accelerate's load_state reads optimizer.bin weights-only under our pins; this keeps it so.
    out = _copy(base, tmp_path)
    marker = tmp_path / "MARKER"
    ckpt = out / "checkpoints" / "step-0000004"
    _forge_optimizer_state(ckpt, marker)
    before = snapshot(out)
    err = fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2", "--resume-from", str(ckpt)),
        capsys,
        f"resume_from={str(ckpt)!r}: optimizer.bin holds objects that weights-only loading refuses",
        "posix.system",
        "not made by this recipe or was tampered with",
    )
    # Torch's advice to load it with weights_only=False (which would run it) is not passed on.
    assert "weights_only` set to `False" not in err and "Re-running" not in err
    assert not marker.exists() and snapshot(out) == before


def test_a_forged_scheduler_state_is_named(recipe, tiny_lm, base, tmp_path, capsys):
    out = _copy(base, tmp_path)
    marker = tmp_path / "MARKER"
    ckpt = out / "checkpoints" / "step-0000004"
    buffer = io.BytesIO()
    torch.save(_RunsCommand(marker), buffer)
    (ckpt / "scheduler.bin").write_bytes(buffer.getvalue())
    _rewrite_checkpoint_manifest(ckpt)
    err = fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2", "--resume-from", "latest"),
        capsys,
        "scheduler.bin holds objects that weights-only loading refuses",
        "tampered with",
    )
    assert "Re-running" not in err and not marker.exists()


@pytest.mark.parametrize("linked", ["model.safetensors", "FOLDER"], ids=["file", "folder"])
def test_a_checkpoint_file_that_is_a_symlink_is_refused(recipe, tiny_lm, base, tmp_path, capsys, linked):
    """New-user trial: a listed file replaced by a symlink to a same-size file outside the
    checkpoint matched checkpoint.json, and the resume silently read the outside file."""
    out = _copy(base, tmp_path)
    ckpt = out / "checkpoints" / "step-0000004"
    if linked == "FOLDER":  # a listed folder, as the fully_shard route's sharded/ is
        (ckpt / "sharded").mkdir()
        (ckpt / "sharded" / "shard.bin").write_bytes(b"0" * 16)
        manifest = json.loads((ckpt / "checkpoint.json").read_text())
        manifest["files"]["sharded/shard.bin"] = 16
        (ckpt / "checkpoint.json").write_text(json.dumps(manifest))
    target = "sharded" if linked == "FOLDER" else linked
    assert any(n.split("/")[0] == target for n in json.loads((ckpt / "checkpoint.json").read_text())["files"])
    outside = tmp_path / "outside" / target
    outside.parent.mkdir()
    (shutil.copytree if (ckpt / target).is_dir() else shutil.copy2)(ckpt / target, outside)
    shutil.rmtree(ckpt / target) if (ckpt / target).is_dir() else (ckpt / target).unlink()
    (ckpt / target).symlink_to(outside)
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2", "--resume-from", "latest"),
        capsys,
        f"{target} is a symlink (to {outside})",
        "not a file of this checkpoint",
    )
    assert snapshot(out) == before


def test_a_damaged_rng_state_is_refused_not_skipped(recipe, tiny_lm, base, tmp_path, capsys):
    out = _copy(base, tmp_path)
    marker = tmp_path / "MARKER"
    ckpt = out / "checkpoints" / "step-0000004"
    (ckpt / "random_states_0.pkl").write_bytes(pickle.dumps(_RunsCommand(marker)))
    _rewrite_checkpoint_manifest(ckpt)
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2", "--resume-from", str(ckpt)),
        capsys,
        "random_states_0.pkl does not load",
        "random draws",
        "resume from an earlier checkpoint",
    )
    assert not marker.exists() and snapshot(out) == before


@pytest.mark.slow
@pytest.mark.distributed
def test_a_forged_sharded_checkpoint_runs_no_code(tiny_lm, tmp_path):
    """The fully_shard route (fsdp on CPU, two processes): sharded/.metadata replaced by a pickle
    that runs a command, with both manifests (hf_memstack_checkpoint.json, checkpoint.json) made
    to match, as a forger would."""
    from hf_memstack.distributed.checkpoint import _write_manifest

    out, marker = tmp_path / "out", tmp_path / "MARKER"
    common = ["--max-steps", "4", "--save-every", "2", "--policy", "fp32+fsdp", "--batch-size", "4"]
    torchrun(tiny_lm, out, *common, "--stop-after", "2")
    ckpt = out / "checkpoints" / "step-0000002"
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(marker)))
    _write_manifest(ckpt / "sharded")
    _rewrite_checkpoint_manifest(ckpt)
    before = snapshot(out)
    proc = torchrun(tiny_lm, out, *common, "--resume-from", "latest", check=False, timeout=300)
    assert proc.returncode != 0 and not marker.exists()
    assert "refused without loading it" in proc.stderr and "names the global posix.system" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert snapshot(out) == before


@pytest.mark.gpu
@pytest.mark.slow
def test_a_forged_accelerate_fsdp_checkpoint_runs_no_code(tiny_lm, tmp_path):
    """The accelerate route (Accelerate's FSDP2 plugin on a GPU): its load_state reads each DCP
    folder with plain pickle; the recipe checks them first."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out, marker = tmp_path / "out", tmp_path / "MARKER"
    common = ["--max-steps", "4", "--save-every", "2", "--policy", "bf16+ckpt+fsdp"]
    launch([*ACCELERATE_FSDP, *lm_args(tiny_lm, out, *common, "--stop-after", "2")])
    ckpt = out / "checkpoints" / "step-0000002"
    folders = sorted(m.parent for m in ckpt.rglob(".metadata"))
    assert folders, f"no DCP folder in {sorted(p.name for p in ckpt.iterdir())}"
    (folders[0] / ".metadata").write_bytes(pickle.dumps(_RunsCommand(marker)))
    _rewrite_checkpoint_manifest(ckpt)
    proc = launch(
        [*ACCELERATE_FSDP, *lm_args(tiny_lm, out, *common, "--resume-from", "latest")], check=False, timeout=300
    )
    assert proc.returncode != 0 and not marker.exists()
    assert "refused without loading it" in proc.stderr and "names the global posix.system" in proc.stderr, proc.stderr[
        -3000:
    ]
