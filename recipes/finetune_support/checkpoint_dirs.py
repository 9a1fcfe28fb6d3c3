"""The checkpoints of a run: the step-N folders under checkpoints/, which of them count (a manifest,
written last, listing files all present at their sizes), their removal (manifest first) and the
run's state they hold. Read before anything is loaded, so a broken one is refused up front.

Everything here is read from a folder someone else may have written: a name in checkpoint.json is
checked (relative, no '..', not through a symlink) before it is joined onto the folder, JSON is
read bounded (hf_memstack.files.read_json: a FIFO, a device or JSON nested 100,000 deep is named
for what it is), and a step-N entry that is a symlink is never listed, resumed or removed through."""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from hf_memstack.files import describe_kind, read_json

from .common import RecipeError
from .faults import test_hook
from .safe_paths import lstat_or_none, relative_inside, remove_entry, symlink_inside

if TYPE_CHECKING:
    from .job import TrainerState  # for annotations only: job.py imports this module (through stops.py)

CHECKPOINT_MANIFEST = "checkpoint.json"  # written last: a checkpoint without it does not count
TRAINER_STATE = "trainer_state.json"
STEP_DIR = re.compile(r"step-(\d+)")
STEP_TMP = re.compile(r"step-(\d+)\.tmp")
_ALTERED = "the recipe never saves one, so it was altered; resume from a checkpoint this recipe wrote"
# What every save writes (Accelerate's save_state: the weights, the main process's RNG state; then
# the run's state): a checkpoint.json listing none of them, "files": {} included, lists nothing loadable.
_ALWAYS_SAVED = (TRAINER_STATE, "run_config.yaml", "random_states_0.pkl")
_WEIGHTS = re.compile(r"(pytorch_)?model.*|sharded/.+")
_NAME_MAX, _PATH_MAX = 255, 4095  # bytes, as Linux's filesystems allow
_MAX_ENTRIES = 100_000  # far above any checkpoint the recipe writes (a few files, or a DCP shard per rank)


class Resolved(TypedDict, total=False):
    """What a run resolved when it started, as trainer_state.json's ``resolved`` holds it: the keys
    read back (checked by read_trainer_state: positive integers where present). Absent in a
    checkpoint from before the run recorded them."""

    batch_size: int
    grad_accum: int


@dataclass
class Checkpoint:
    step: int
    path: Path
    problem: str | None  # None: complete (its manifest lists files that are all there, at their sizes)


def inspect_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint counts once its manifest, written last, lists what every save writes, each a regular
    file present at its size, and the folder holds nothing else (at any depth): whatever its loaders
    would open has been checked before anything is loaded, on every rank before any collective."""
    m = STEP_DIR.fullmatch(path.name)
    step = int(m.group(1)) if m else -1
    if not m:
        return Checkpoint(step, path, "its name is not step-N (a .tmp folder is a save that never finished)")
    manifest = path / CHECKPOINT_MANIFEST
    if manifest.is_symlink():
        return Checkpoint(step, path, f"{CHECKPOINT_MANIFEST} is a symlink, not a file of this checkpoint: {_ALTERED}")
    if lstat_or_none(manifest) is None:
        return Checkpoint(step, path, f"no {CHECKPOINT_MANIFEST} (the save did not finish)")
    try:
        content = read_json(manifest, max_bytes=2**24)
        files = content["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping of names to sizes")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Checkpoint(step, path, f"its {CHECKPOINT_MANIFEST} is unreadable ({str(e)[:200]})")
    if "step" in content and content["step"] != step:
        return Checkpoint(
            step,
            path,
            f"its {CHECKPOINT_MANIFEST} says step={content['step']!r}, but the folder is {path.name}: the recipe "
            "saves step N in step-N, so one of them was altered; resume from a checkpoint this recipe wrote",
        )
    try:
        problem = (
            _listed_files_problem(path, files)
            or _unlisted_entry_problem(path, files)
            or _missing_saved_file(files)
            or _trainer_state_problem(path)
        )
    except OSError as e:  # a name the filesystem refuses, a folder that cannot be read
        problem = f"it cannot be read ({type(e).__name__}: {str(e)[:200]}): {_ALTERED}"
    return Checkpoint(step, path, problem)


def _missing_saved_file(files: Mapping[str, object]) -> str | None:
    """A checkpoint.json must list what every save writes: without them, nothing it lists is checked."""
    missing = [name for name in _ALWAYS_SAVED if name not in files]
    if not any(isinstance(name, str) and _WEIGHTS.fullmatch(name) for name in files):
        missing.append("the model's weights (model.safetensors)")
    if missing:
        return (
            f"its {CHECKPOINT_MANIFEST} does not list {', '.join(missing)}, which every checkpoint of this recipe "
            f"holds: {_ALTERED}"
        )
    return None


def _name_problem(name: Any) -> str | None:
    """A listed name that is no file inside the checkpoint, or longer than a filesystem allows."""
    if relative_inside(name) is None:
        return f"its {CHECKPOINT_MANIFEST} lists {name!r}, not a file inside the checkpoint (a relative name without '..'): {_ALTERED}"
    try:
        encoded = os.fsencode(name)
    except UnicodeError:
        return f"its {CHECKPOINT_MANIFEST} lists {name[:80]!r}, not a valid file name: {_ALTERED}"
    if len(encoded) > _PATH_MAX or any(len(part) > _NAME_MAX for part in encoded.split(b"/")):
        return (
            f"its {CHECKPOINT_MANIFEST} lists a name too long for a file ({name[:60]!r}..., {len(encoded)} bytes; "
            f"at most {_NAME_MAX} bytes a name): {_ALTERED}"
        )
    return None


def _listed_files_problem(path: Path, files: Mapping[str, object]) -> str | None:
    """What is wrong with the files checkpoint.json lists (None: all there, at their sizes). Each
    name is checked before it is used: outside the folder, or through a symlink, nothing is looked at."""
    for name, size in files.items():
        if (bad := _name_problem(name)) is not None:
            return bad
        link = symlink_inside(path, name)
        if link is not None:
            # The sizes could still match: a symlink would resume from a file outside the checkpoint.
            return (
                f"{link} is a symlink (to {os.readlink(path / link)}), not a file of this checkpoint: "
                "the recipe never saves one, so it was altered; resume from a checkpoint this recipe "
                "wrote, or replace the link by the file itself"
            )
        st = lstat_or_none(path / name)
        if st is None:
            return f"{name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{name} is {describe_kind(st.st_mode)}, not a regular file: {_ALTERED}"
        if isinstance(size, bool) or not isinstance(size, int) or st.st_size != size:
            return f"{name} has {st.st_size} bytes, the manifest says {size!r} (truncated or replaced)"
    return None


def _unlisted_entry_problem(path: Path, files: Mapping[str, object]) -> str | None:
    """An entry of the folder (at any depth, never through a link) that checkpoint.json does not
    list: its loaders would open it unchecked, and a FIFO there blocks the open forever, a symlink
    loads weights from outside, a device reads without end. Folders only hold what they list."""
    folders, seen = [path], 0
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as it:
            for entry in it:
                seen += 1
                rel = Path(entry.path).relative_to(path).as_posix()
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif rel != CHECKPOINT_MANIFEST and rel not in files:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    kind = "a regular file" if stat.S_ISREG(mode) else describe_kind(mode)
                    if stat.S_ISLNK(mode):
                        kind += f" (to {os.readlink(entry.path)})"
                    return (
                        f"{rel} is {kind} that its {CHECKPOINT_MANIFEST} does not list: every file the recipe saves is "
                        "listed there, so it was added or the list altered; remove it, or resume from a checkpoint "
                        "this recipe wrote"
                    )
                if seen > _MAX_ENTRIES:
                    return f"it holds more than {_MAX_ENTRIES} entries: {_ALTERED}"
    return None


def _trainer_state_problem(path: Path) -> str | None:
    state = path / TRAINER_STATE
    st = lstat_or_none(state)
    if st is not None and stat.S_ISLNK(st.st_mode):
        return f"{TRAINER_STATE} is a symlink, not a file of this checkpoint: {_ALTERED}"
    try:
        read_json(state, max_bytes=2**26)
    except (OSError, ValueError) as e:
        return f"{TRAINER_STATE} is not readable JSON ({e})"
    return None


def step_entries(out: Path) -> list[Path]:
    """The entries of out/checkpoints named step-N or step-N.tmp, whatever they are (links included)."""
    folder = out / "checkpoints"
    if folder.is_symlink() or not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if STEP_DIR.fullmatch(p.name) or STEP_TMP.fullmatch(p.name)]


def list_checkpoints(out: Path) -> list[Checkpoint]:
    """The step-N folders under out/checkpoints, ordered by step number (never by name); .tmp folders
    are never listed, nor a step-N that is a symlink (plan_output refuses those up front)."""
    found = [
        inspect_checkpoint(p)
        for p in step_entries(out)
        if STEP_DIR.fullmatch(p.name) and (st := lstat_or_none(p)) is not None and stat.S_ISDIR(st.st_mode)
    ]
    return sorted(found, key=lambda c: c.step)


def remove_checkpoint(path: Path, *, hook: str = "") -> None:
    """Remove a checkpoint folder, its manifest first: from then on the folder no longer counts,
    however far the removal gets. A symlink (or a file) at its name is unlinked, never followed."""
    st = lstat_or_none(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        # Whatever stands at the manifest's name (a folder put there: removed with what it holds, never through a link).
        remove_entry(path / CHECKPOINT_MANIFEST)
        if hook:
            test_hook(hook)
    remove_entry(path)


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The run's state a checkpoint holds: its step agrees with the step-N folder it is in, and
    its epoch is no later than its step (every epoch ends with an optimizer step)."""
    try:
        state = read_json(path / TRAINER_STATE, max_bytes=2**26)
        if not isinstance(state, dict) or not isinstance(state.get("run"), dict):
            raise ValueError("no 'run' record")
        for key in ("step", "epoch", "batches_in_epoch"):
            if not _count(state.get(key)):
                raise ValueError(f"{key}={state.get(key)!r} is not a step count")
        _check_history(state.get("log_history", []), state["step"])
        _check_resolved(state.get("resolved"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise RecipeError(
            f"resume_from={str(path)!r}: {TRAINER_STATE} is not a readable checkpoint state ({type(e).__name__}: "
            f"{str(e)[:120]}; truncated by a crash?); resume from an earlier checkpoint or start again"
        ) from None
    m = STEP_DIR.fullmatch(path.name)
    if m and state["step"] != int(m.group(1)):
        raise RecipeError(
            f"resume_from={str(path)!r}: {TRAINER_STATE} says step={state['step']}, but the folder is {path.name} "
            f"(step {int(m.group(1))}); the recipe saves step N in step-N, so one of them was altered: resume from a "
            "checkpoint this recipe wrote, or start again"
        )
    if state["epoch"] > state["step"]:
        raise RecipeError(
            f"resume_from={str(path)!r}: {TRAINER_STATE} says epoch={state['epoch']} after step={state['step']}; "
            "every epoch ends with a step, so it was altered: resume from a checkpoint this recipe wrote, or start again"
        )
    return state


def _count(value: object, *, positive: bool = False) -> bool:
    """A JSON integer (not a bool) that is >= 0 (> 0 with ``positive``)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= (1 if positive else 0)


def _check_history(history: object, step: int) -> None:
    """The logged rows a resumed run carries into its report: a list of rows, each of a step no later
    than the checkpoint's and numbers (a forged string or list fails mid-run or in save() otherwise)."""
    if not isinstance(history, list):
        raise ValueError(f"log_history={str(history)[:40]!r} is not a list of logged rows")
    for i, row in enumerate(history):
        if not isinstance(row, dict) or not _count(row.get("step")) or row["step"] > step:
            raise ValueError(f"log_history[{i}]={str(row)[:60]!r} is not a logged row of a step <= {step}")
        bad = [k for k, v in row.items() if not (isinstance(v, int | float) and not isinstance(v, bool))]
        if bad:
            raise ValueError(f"log_history[{i}][{bad[0]!r}]={str(row[bad[0]])[:40]!r} is not a number")


def _check_resolved(resolved: object) -> None:
    """What the run resolved when it started (the finder's batch size): positive integers."""
    if resolved is None:
        return
    if not isinstance(resolved, dict):
        raise ValueError(f"resolved={str(resolved)[:40]!r} is not a record")
    for key in ("batch_size", "grad_accum"):
        if key in resolved and not _count(resolved[key], positive=True):
            raise ValueError(f"resolved.{key}={str(resolved[key])[:40]!r} is not a positive integer")


def check_resumed_position(path: Path, state: TrainerState, *, batches_per_epoch: int, grad_accum: int) -> None:
    """Where in the data a checkpoint of this run's batch size resumes must be a place the run could
    have reached: a forged ``batches_in_epoch`` past the epoch would skip its rest, an ``epoch`` past
    what the steps allow would skip whole epochs. (Only for the batch size it was saved with: a
    resume that changes it, with --allow-config-change, starts from another layout of the data.)

    Raises:
        RecipeError: naming the field, its value, the bound and the fix.
    """
    steps_per_epoch = math.ceil(batches_per_epoch / grad_accum)
    problems = []
    if state.batches_in_epoch > batches_per_epoch:
        problems.append(f"batches_in_epoch={state.batches_in_epoch}, past the {batches_per_epoch} batches of an epoch")
    if state.epoch * steps_per_epoch > state.step:
        problems.append(
            f"epoch={state.epoch} after step={state.step}, where an epoch is {steps_per_epoch} step(s) of this run"
        )
    if problems:
        raise RecipeError(
            f"resume_from={str(path)!r}: {TRAINER_STATE} says {'; '.join(problems)}: it was altered, and the run would "
            "skip data. Resume from a checkpoint this recipe wrote, or start again"
        )


def check_resumed_step(path: Path, step: int, total_steps: int) -> None:
    """A checkpoint's step must lie within the run: past its last step nothing would train, and the
    checkpoint's weights would be saved as the final model.

    Raises:
        RecipeError: naming the field, both values and the fix.
    """
    if step > total_steps:
        raise RecipeError(
            f"resume_from={str(path)!r}: {TRAINER_STATE} says step={step}, past this run's last step, {total_steps} "
            "(from --max-steps, or --epochs over the data); nothing would be trained. Resume with the --max-steps or "
            "--epochs the checkpoint was written with, or from a checkpoint this recipe wrote"
        )
