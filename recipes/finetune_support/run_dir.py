"""The output directory: what the recipe wrote there (its manifest), atomic writes, and the plan
for the run's output (new, resumed, or overwritten); its checkpoints are checkpoint_dirs.py's."""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hf_memstack.files import describe_kind, read_json

from .checkpoint_dirs import (
    Checkpoint,
    inspect_checkpoint,
    list_checkpoints,
    read_trainer_state,
    remove_checkpoint,
    step_entries,
)
from .common import RecipeError, printable
from .flags import MAY_CHANGE_ON_RESUME, FinetuneConfig
from .run_lock import LOCK, acquire, is_main_process, is_recipe_lock
from .safe_paths import fsync_dir, lstat_or_none, name_max, relative_inside, write_atomic

__all__ = ["MANIFEST", "OutputPlan", "RunDir", "fsync_dir", "plan_output", "read_manifest", "write_atomic"]

MANIFEST = "recipe_manifest.json"  # what this recipe wrote in the output directory (for --overwrite)


def read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of what the recipe wrote in ``out`` (None: there is none).

    Raises:
        RecipeError: it is unreadable, or lists a name the recipe never writes - one outside the
            directory ('..', an absolute path) or not a relative path at all: --overwrite would remove it.
    """
    path = out / MANIFEST
    st = lstat_or_none(path)
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        # It decides what --overwrite removes: one read through a link is not this directory's.
        raise RecipeError(
            f"output_dir={str(out)!r}: {MANIFEST} is a symlink (to {os.readlink(path)}), and the recipe writes its "
            "manifest itself, never as a link; nothing was loaded or written. Remove the link (its target is kept) "
            "or choose another --output-dir"
        )
    try:
        manifest = read_json(path, max_bytes=2**26)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
            raise ValueError("no 'files' list")
        if not isinstance(manifest.get("run", {}), dict):
            raise ValueError(f"its 'run' is {str(manifest['run'])[:40]!r}, not the run's record")
    except (OSError, ValueError) as e:
        raise RecipeError(
            f"output_dir={str(out)!r}: its {MANIFEST} is unreadable ({str(e)[:300]}); the recipe cannot tell its files "
            "from yours: choose another --output-dir"
        ) from None
    _refuse_long_names(out, manifest)
    outside = [
        f"{kind}: {name!r}"
        for kind in ("files", "dirs", "trees")
        for name in manifest_entries(manifest, kind)
        if relative_inside(name) is None
    ]
    if outside:
        raise RecipeError(
            f"output_dir={str(out)!r}: its {MANIFEST} lists names outside the directory (or no path at all), which "
            f"the recipe never writes ({', '.join(outside[:5])}): it was edited, so nothing was removed or written. Remove those "
            "entries (or the manifest, to keep every file) or choose another --output-dir"
        )
    return manifest


def _refuse_long_names(out: Path, manifest: dict[str, Any]) -> None:
    """A listed name with a part longer than the file system takes was never written by the recipe;
    --overwrite would stop on 'File name too long' halfway through removing the run's files."""
    limit = name_max(out)
    long = [
        f"{kind}: {printable(name[:60])!r}... ({max(len(p.encode('utf-8', 'surrogateescape')) for p in name.split('/'))} bytes)"
        for kind in ("files", "dirs", "trees")
        for name in manifest_entries(manifest, kind)
        if isinstance(name, str) and any(len(p.encode("utf-8", "surrogateescape")) > limit for p in name.split("/"))
    ]
    if long:
        raise RecipeError(
            f"output_dir={str(out)!r}: its {MANIFEST} lists names longer than the {limit} bytes a file name may have "
            f"here, which the recipe never writes ({', '.join(long[:3])}): it was edited, so nothing was removed or "
            "written. Remove those entries (or the manifest, to keep every file) or choose another --output-dir"
        )


def manifest_entries(manifest: dict[str, Any], kind: str) -> list[Any]:
    names = manifest.get(kind, [])
    return names if isinstance(names, list) else [names]


def _owned_path(root: Path, name: str) -> Path | None:
    """``root / name`` when every folder between ``root`` and it is a real folder, not a symlink
    (through one, a removal would reach outside the output directory); None otherwise."""
    relative = relative_inside(name)
    if relative is None:
        return None
    folder = root
    for part in relative.parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            return None
    return root / relative


@dataclass
class RunDir:
    """The output directory and the manifest of what this recipe wrote there. Every name is
    claimed in the manifest before it is written, so --overwrite can remove exactly those."""

    path: Path
    manifest: dict[str, Any] = field(
        default_factory=lambda: {"recipe": "hf_memstack/recipes/finetune.py", "files": [], "dirs": [], "trees": []}
    )

    def claim(self, name: str, kind: Literal["files", "dirs", "trees"] = "files", *, atomic: bool = True) -> Path:
        """Record ``name`` (relative; a file, a directory removed only if empty, or a tree the
        recipe owns entirely) before writing it; a file written atomically gets its ``.tmp`` sibling too."""
        names = [name] + ([name + ".tmp"] if kind == "files" and atomic else [])
        if any(n not in self.manifest[kind] for n in names):
            self.manifest[kind] += [n for n in names if n not in self.manifest[kind]]
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path / MANIFEST, json.dumps(self.manifest, indent=1))
        return self.path / name

    def write(self, name: str, text: str) -> None:
        write_atomic(self.claim(name), text)

    def remove_recipe_files(self) -> list[str]:
        """Remove what the manifest lists and nothing else: files you added are kept, a symlink is
        never followed (a listed name that is now a symlink, or lies under one, was put there by
        you: kept), and no name reaches outside the directory (read_manifest refuses those; they
        are skipped here too). Returns what was kept."""
        for path in self._owned("trees"):
            if path.is_symlink() or not path.exists():
                continue
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if "checkpoints" in manifest_entries(self.manifest, "dirs"):
            for child in step_entries(self.path):
                if not child.is_symlink():
                    remove_checkpoint(child)
        for path in self._owned("files"):
            # The lock stays: this run holds it, and another may be waiting on this very file.
            if path.is_file() and not path.is_symlink() and path != self.path / LOCK:
                path.unlink()
        for path in sorted(self._owned("dirs"), key=lambda p: -len(p.parts)):
            if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
        (self.path / MANIFEST).unlink(missing_ok=True)
        return sorted(p.name for p in self.path.iterdir() if p.name != LOCK) if self.path.exists() else []

    def _owned(self, kind: str) -> list[Path]:
        """The manifest's names of one kind that lie inside the directory, through real folders only."""
        paths = (_owned_path(self.path, name) for name in manifest_entries(self.manifest, kind))
        return [p for p in paths if p is not None]


@dataclass
class OutputPlan:
    """What setup found in the output directory and will do there once everything is validated."""

    run_dir: RunDir
    resume: Checkpoint | None = None  # the checkpoint to load
    reference: dict[str, Any] | None = None  # the run record to compare with (checkpoint's, or the directory's)
    overwrite: bool = False  # remove the recipe's files first
    discard: list[Checkpoint] = field(default_factory=list)  # later checkpoints of an abandoned branch
    notes: list[str] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)  # what the directory held when it was read (its lock aside)


# The folders the recipe writes in the output directory (save_model, save_checkpoint, the trackers).
_WRITTEN_FOLDERS = ("model", "model.tmp", "model.old", "checkpoints", "hf_memstack-finetune")


def _refuse_linked_folders(out: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse, before anything is loaded or trained, a folder the recipe will write or remove that
    is a symlink: its files would land in the linked folder, a removal would delete files there (a
    stale checkpoints/step-N.tmp, a rotated step-N), or the final rename of model.tmp fails after
    the whole run. A file that is a symlink is fine: it is replaced, never followed (safe_paths)."""
    listed = [n for kind in ("dirs", "trees") for n in manifest_entries(manifest or {}, kind) if isinstance(n, str)]
    linked = [
        (name, path)
        for name in dict.fromkeys([*_WRITTEN_FOLDERS, *listed])
        if (path := _owned_path(out, name)) is not None and path.is_symlink()
    ]
    linked += [(f"checkpoints/{p.name}", p) for p in sorted(step_entries(out)) if p.is_symlink()]
    for name in ("model", "checkpoints", "hf_memstack-finetune"):
        st = lstat_or_none(out / name)
        if st is not None and not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            kind = "a file" if stat.S_ISREG(st.st_mode) else describe_kind(st.st_mode)
            raise RecipeError(
                f"output_dir={str(out)!r}: {name} is {kind} of yours, where the recipe writes its "
                f"{name}/ folder; nothing was loaded or written. Move it away or choose another --output-dir"
            )
    if linked:
        name, path = linked[0]
        raise RecipeError(
            f"output_dir={str(out)!r}: {name} is a symlink (to {os.readlink(path)}), and the recipe writes "
            f"{'and removes ' if name.startswith('checkpoints/') else ''}{name} itself, never through a link; "
            "nothing was loaded or written. Remove the link (the folder it points to is kept) or choose another "
            "--output-dir"
        )


# The files the recipe writes in the output directory (atomic ones through their .tmp sibling).
_WRITTEN_FILES = tuple(n for name in (MANIFEST, "run_config.yaml", "report.json") for n in (name, name + ".tmp")) + (
    "memory.png",
)


def _refuse_taken_file_names(out: Path) -> None:
    """Refuse, before anything is loaded, trained or removed, a name the recipe writes as a file
    where a directory (or a FIFO, a device...) stands: the write would fail after the whole run
    (report.json), or after --overwrite removed the previous run (recipe_manifest.json.tmp). A
    symlink is fine: it is replaced, never followed (safe_paths)."""
    for name in _WRITTEN_FILES:
        st = lstat_or_none(out / name)
        if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise RecipeError(
                f"output_dir={str(out)!r}: {name} is {describe_kind(st.st_mode)}, where the recipe writes a file of "
                "its own; nothing was loaded, removed or written. Move it away (or remove it) or choose another "
                "--output-dir"
            )


def _entries(out: Path, out_dir: str) -> list[str]:
    """What the output directory holds (nothing yet: []), once it is one that can be written.
    A lock file as the recipe leaves one is the recipe's, whoever left it (a run killed before its
    first write leaves only that), and not listed; any other file of that name is yours."""
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir={out_dir!r} is a file, not a directory; choose another --output-dir")
    ancestor = next(p for p in [out, *out.parents] if p.exists())
    if not ancestor.is_dir():
        raise RecipeError(
            f"output_dir={out_dir!r}: {ancestor} is a file, so no directory can be made there; choose another --output-dir"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RecipeError(f"output_dir={out_dir!r}: {ancestor} is not writable; choose a directory you can write to")
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name != LOCK or not is_recipe_lock(p))


def plan_output(cfg: FinetuneConfig) -> OutputPlan:
    """Read (never write) the output directory and the checkpoint to resume from; refuse anything
    that would mix two runs, lose a file or resume something broken. A run of this recipe found
    there is locked first (run_lock.py: its lock file is the one thing created, where missing).

    Raises:
        RecipeError: the directory, the checkpoint and the way out.
    """
    out_dir = cfg.output.output_dir
    out = Path(out_dir)
    entries = _entries(out, out_dir)
    manifest = read_manifest(out) if entries else None
    plan = OutputPlan(run_dir=RunDir(out, manifest) if manifest else RunDir(out), entries=entries)
    foreign = (
        f"output_dir={out_dir!r} holds files this recipe did not write ({', '.join(entries[:5])}"
        f"{', ...' if len(entries) > 5 else ''}); choose an empty or new --output-dir (nothing was changed)"
    )
    if entries and manifest is None:
        if cfg.output.overwrite:
            raise RecipeError(
                foreign.replace(
                    "; choose",
                    "; --overwrite only removes files the recipe wrote itself (listed in "
                    f"{MANIFEST}), so it leaves them alone: choose",
                )
            )
        raise RecipeError(foreign)
    if manifest is not None and is_main_process():
        acquire(out)  # a run of this recipe: read (and later written) by one run at a time (run_lock.py)
    _refuse_linked_folders(out, manifest)
    _refuse_taken_file_names(out)
    checkpoints = list_checkpoints(out)
    complete = [c for c in checkpoints if c.problem is None]

    if cfg.checkpoint.resume_from == "latest":
        if not complete:
            broken = [c for c in checkpoints]
            if broken:
                raise RecipeError(
                    f"resume_from='latest': {broken[-1].path} is incomplete ({broken[-1].problem}) and no complete "
                    "checkpoint is left; delete it to start again, or resume from a copy"
                )
            plan.notes.append(f"resume_from=latest: no checkpoint in {out} yet: starting from step 0")
            plan.reference = manifest.get("run") if manifest else None
            return plan
        plan.resume = _latest(checkpoints, complete)
    elif cfg.checkpoint.resume_from is not None:
        _resume_from(cfg, plan, checkpoints, entries, out)
    elif entries:
        if not cfg.output.overwrite:
            raise RecipeError(
                f"output_dir={out_dir!r} already holds a run of this recipe; continue it with --resume-from latest, "
                "replace it with --overwrite (removes only the files the recipe wrote; yours are kept), "
                "or choose another --output-dir"
            )
        plan.overwrite = True
    if plan.resume is not None:
        plan.reference = read_trainer_state(plan.resume.path)["run"]
    return plan


def _latest(checkpoints: list[Checkpoint], complete: list[Checkpoint]) -> Checkpoint:
    """--resume-from latest: the newest complete checkpoint, unless a newer one is broken."""
    newest = complete[-1]
    later_broken = [c for c in checkpoints if c.problem and c.step > newest.step]
    if later_broken:
        c = later_broken[-1]
        raise RecipeError(
            f"resume_from='latest': {c.path} is newer than the last complete checkpoint but incomplete "
            f"({c.problem}); it was not written by this recipe's saves (they rename only finished folders): "
            f"delete it to resume from {newest.path.name}"
        )
    return newest


def _resume_from(
    cfg: FinetuneConfig, plan: OutputPlan, checkpoints: list[Checkpoint], entries: list[str], out: Path
) -> None:
    """--resume-from CHECKPOINT: it must be complete; another run's needs --overwrite of this one; an
    earlier one of this run abandons the later ones only with --discard-later-checkpoints."""
    path = Path(cfg.checkpoint.resume_from)
    if not path.is_dir():
        raise RecipeError(
            f"resume_from={cfg.checkpoint.resume_from!r}: no such directory; pass a checkpoints/step-N folder or "
            "'latest'"
        )
    ckpt = inspect_checkpoint(path)
    if ckpt.problem:
        raise RecipeError(
            f"resume_from={cfg.checkpoint.resume_from!r}: not a complete checkpoint: {ckpt.problem}; "
            "pass a complete checkpoints/step-N folder (or 'latest')"
        )
    plan.resume = ckpt
    inside = path.parent == out / "checkpoints"
    if entries and not inside:
        if not cfg.output.overwrite:
            raise RecipeError(
                f"resume_from={cfg.checkpoint.resume_from!r} belongs to another run, and "
                f"output_dir={cfg.output.output_dir!r} "
                "already holds a run; resume into an empty --output-dir, or add --overwrite to replace that run "
                "(only the files the recipe wrote are removed)"
            )
        plan.overwrite = True
    if inside:
        if cfg.output.overwrite:
            raise RecipeError(f"overwrite=True would delete the checkpoint you resume from ({path}); drop --overwrite")
        later = [c for c in checkpoints if c.step > ckpt.step]
        if later and not cfg.checkpoint.discard_later_checkpoints:
            raise RecipeError(
                f"resume_from={cfg.checkpoint.resume_from!r}: later checkpoints exist "
                f"({', '.join(c.path.name for c in later)}); "
                "resuming from an earlier one abandons them. Continue from the newest with --resume-from latest, "
                "branch into a new --output-dir (both runs are kept), or add --discard-later-checkpoints to delete them"
            )
        plan.discard = later


def compare_runs(reference: dict[str, Any], now: dict[str, object], *, where: str, allow: bool) -> list[str]:
    """Differences that change the run, by field; refused unless --allow-config-change.

    Raises:
        RecipeError: naming each differing field with both values.
    """
    diffs = [
        f"{k}: {reference.get(k)!r} there, {now.get(k)!r} now"
        for k in sorted(set(reference) | set(now))
        if reference.get(k) != now.get(k)
    ]
    if diffs and not allow:
        raise RecipeError(
            f"resume: {where} was made with different settings that change the run:\n  - "
            + "\n  - ".join(diffs)
            + "\nResume with the same settings (its run_config.yaml is next to it: --config that file), or pass "
            "--allow-config-change to continue with the new ones"
        )
    return diffs


def run_record(cfg: FinetuneConfig, *, world_size: int, policy: str, data: str) -> dict[str, object]:
    """What defines a run: the settings that change training, the number of processes, the
    resolved policy and the data's digest."""
    record = {k: v for k, v in cfg.flat().items() if k not in MAY_CHANGE_ON_RESUME}
    record.update(world_size=world_size, resolved_policy=policy, data_sha256=data)
    return record
