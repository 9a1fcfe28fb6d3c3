"""The checkpoints of a run: the step-N folders under checkpoints/, which of them count (a manifest,
written last, listing files all present at their sizes), their removal (manifest first) and the
run's state they hold. Read before anything is loaded, so a broken one is refused up front."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .common import RecipeError
from .faults import test_hook

CHECKPOINT_MANIFEST = "checkpoint.json"  # written last: a checkpoint without it does not count
STEP_DIR = re.compile(r"step-(\d+)")
STEP_TMP = re.compile(r"step-(\d+)\.tmp")


@dataclass
class Checkpoint:
    step: int
    path: Path
    problem: str | None  # None: complete (its manifest lists files that are all there, at their sizes)


def inspect_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint counts once its manifest, written last, lists files that are all present at their sizes."""
    m = STEP_DIR.fullmatch(path.name)
    step = int(m.group(1)) if m else -1
    manifest = path / CHECKPOINT_MANIFEST
    if not m:
        return Checkpoint(step, path, "its name is not step-N (a .tmp folder is a save that never finished)")
    if manifest.is_symlink():
        return Checkpoint(
            step,
            path,
            f"{CHECKPOINT_MANIFEST} is a symlink, not a file of this checkpoint: the recipe never "
            "saves one, so it was altered; resume from a checkpoint this recipe wrote",
        )
    if not manifest.is_file():
        return Checkpoint(step, path, f"no {CHECKPOINT_MANIFEST} (the save did not finish)")
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return Checkpoint(step, path, f"its {CHECKPOINT_MANIFEST} is unreadable")
    for name, size in files.items():
        f = path / name
        link = _symlink_inside(path, name)
        if link is not None:
            # The sizes could still match: a symlink would resume from a file outside the checkpoint.
            return Checkpoint(
                step,
                path,
                f"{link} is a symlink (to {os.readlink(path / link)}), not a file of this checkpoint: "
                "the recipe never saves one, so it was altered; resume from a checkpoint this recipe "
                "wrote, or replace the link by the file itself",
            )
        if not f.is_file():
            return Checkpoint(step, path, f"{name} is missing")
        if f.stat().st_size != size:
            return Checkpoint(
                step, path, f"{name} has {f.stat().st_size} bytes, the manifest says {size} (truncated or replaced)"
            )
    try:
        json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return Checkpoint(step, path, f"trainer_state.json is not readable JSON ({e})")
    return Checkpoint(step, path, None)


def _symlink_inside(root: Path, name: str) -> str | None:
    """The first of ``name``'s parts below ``root`` (its folders, then the file) that is a symlink,
    as a relative name; None when there is none."""
    relative = PurePosixPath(name)
    for depth in range(1, len(relative.parts) + 1):
        part = PurePosixPath(*relative.parts[:depth])
        if (root / part).is_symlink():
            return str(part)
    return None


def list_checkpoints(out: Path) -> list[Checkpoint]:
    """The step-N folders under out/checkpoints, ordered by step number (never by name); .tmp folders are never listed."""
    folder = out / "checkpoints"
    if not folder.is_dir():
        return []
    found = [inspect_checkpoint(p) for p in folder.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda c: c.step)


def remove_checkpoint(path: Path, *, hook: str = "") -> None:
    # The manifest goes first: from then on the folder no longer counts, however far the removal gets.
    (path / CHECKPOINT_MANIFEST).unlink(missing_ok=True)
    if hook:
        test_hook(hook)
    shutil.rmtree(path)


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("run"), dict):
            raise ValueError("no 'run' record")
        for key in ("step", "epoch", "batches_in_epoch"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(f"{key}={state.get(key)!r} is not a step count")
        return state
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise RecipeError(
            f"resume_from={str(path)!r}: trainer_state.json is not a readable checkpoint state ({type(e).__name__}: "
            f"{str(e)[:120]}; truncated by a crash?); resume from an earlier checkpoint or start again"
        ) from None
