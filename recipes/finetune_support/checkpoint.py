"""A resumable checkpoint: save (Accelerate's state, the run's state, the manifest last) and load it,
and commit the run's output."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from .checkpoint_dirs import (
    CHECKPOINT_MANIFEST,
    STEP_TMP,
    check_resumed_step,
    inspect_checkpoint,
    list_checkpoints,
    remove_checkpoint,
    step_entries,
)
from .common import RecipeError, agree
from .faults import test_hook
from .run_dir import MANIFEST, OutputPlan, RunDir, fsync_dir, manifest_entries, write_atomic
from .run_lock import LOCK, lock_for_writing
from .stops import disk_full, tensor_bytes

if TYPE_CHECKING:
    import torch

    from .job import Job


def checkpoint_without_4bit_weights(
    models: list[torch.nn.Module], weights: list[dict[str, torch.Tensor]], output_dir: str
) -> None:
    """Accelerate's save_state hook for a 4-bit base (quant:nf4): the frozen 4-bit weights stay out of
    the checkpoint (safetensors cannot hold torchao's NF4 tensors, and they never change): resuming
    quantizes --model's weights again, which gives the same codes, and loads the rest."""
    from hf_memstack.transforms.quant.apply import is_4bit

    for i, state in enumerate(weights):
        weights[i] = {k: v for k, v in state.items() if not is_4bit(v)}


def load_without_4bit_weights(models: list[torch.nn.Module], input_dir: str) -> None:
    """Accelerate's load_state hook for a 4-bit base: loads the model's saved (not 4-bit) weights
    itself and takes the model off Accelerate's list (its loader reads every tensor's storage
    pointer, which torchao's NF4 tensors do not have). The keys were checked before
    (_check_4bit_checkpoint)."""
    from safetensors.torch import load_file

    for i, model in enumerate(models):
        model.load_state_dict(
            load_file(str(Path(input_dir) / f"model{f'_{i}' if i else ''}.safetensors")), strict=False
        )
    models.clear()


def _check_4bit_checkpoint(job: Job, path: Path) -> None:
    """A 4-bit run's checkpoint must hold exactly the model's weights that are not 4-bit (load_state
    then loads it without the 4-bit ones it left out; anything else missing is refused)."""
    from safetensors import safe_open

    from hf_memstack.transforms.quant.apply import is_4bit

    model = job.accelerator.unwrap_model(job.model)
    expected = {k for k, v in model.state_dict().items() if not is_4bit(v)}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    if saved != expected:
        missing, extra = sorted(expected - saved)[:5], sorted(saved - expected)[:5]
        raise RecipeError(
            f"resume_from={str(path)!r}: its model.safetensors does not hold this run's trainable weights "
            f"(missing {missing}, unexpected {extra}); resume with the --policy, --lora-* flags and --model "
            "the checkpoint was written with"
        )


def save_checkpoint(job: Job) -> Path:
    """Write checkpoints/step-N atomically: everything goes into step-N.tmp (Accelerate's
    save_state: model, optimizer, schedule, RNG of every process; on the fully_shard route each
    rank's DCP shards of the model and optimizer), then trainer_state.json, then the manifest of
    every file with its size, last, then one rename. A kill at any point leaves the previous
    checkpoints intact and no folder that counts as complete without being so.

    Raises:
        RecipeError: on every rank, when the disk is full: naming it, the bytes needed and free, and
            the command that resumes from the newest checkpoint (the partial save removed).
    """
    from hf_memstack.files import weights_follow_umask

    acc, state = job.accelerator, job.state
    folder = job.run_dir.path / "checkpoints"
    final = folder / f"step-{state.step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if acc.is_main_process:
        job.run_dir.claim("checkpoints", "dirs")
        folder.mkdir(parents=True, exist_ok=True)
        # Saves that never finished, and removals that were cut short; a symlink among them (planted
        # since plan_output refused those) is unlinked, never followed (remove_checkpoint).
        for stale in step_entries(job.run_dir.path):
            if STEP_TMP.fullmatch(stale.name) or stale.is_symlink() or inspect_checkpoint(stale).problem:
                remove_checkpoint(stale)
    acc.wait_for_everyone()
    error = None
    # safetensors writes mode 0600; the main process gives the weights the umask's mode, like the other files.
    with weights_follow_umask(tmp) if acc.is_main_process else contextlib.nullcontext():
        try:
            acc.save_state(str(tmp))
            if job.route == "fully_shard":
                from hf_memstack.distributed.checkpoint import save_sharded_checkpoint

                save_sharded_checkpoint(job.model, job.optimizer, str(tmp / "sharded"))
        except Exception as e:  # noqa: BLE001 - a full disk is said once, on every rank; anything else is raised
            if (error := _disk_full(job, e, tmp)) is None:
                raise
        agree(acc, error)  # every rank's files written (or every rank stops with the full disk)
    test_hook(f"save-{state.step}:state-written", acc.process_index)
    if acc.is_main_process:
        try:
            _write_run_state(job, tmp)
        except Exception as e:  # noqa: BLE001 - as above
            if (error := _disk_full(job, e, tmp)) is None:
                raise
    agree(acc, error)
    if acc.is_main_process:
        remove_checkpoint(final)  # one left there (or a link: unlinked, never followed)
        os.replace(tmp, final)
        fsync_dir(folder)
        test_hook(f"save-{state.step}:renamed")
        _rotate(job, final, hook=f"save-{state.step}:rotating")
    acc.wait_for_everyone()
    return final


def _write_run_state(job: Job, tmp: Path) -> None:
    """The run's state and config into the checkpoint being saved, every file made durable, then
    the manifest of every file with its size, last."""
    state = job.state
    trainer_state = {
        **dataclasses.asdict(state),
        "run": job.record,
        "resolved": {
            "batch_size": job.batch_size,
            "grad_accum": job.grad_accum,
            "total_steps": job.total_steps,
            "precision": job.precision.name,
            "route": job.route,
        },
    }
    write_atomic(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1))
    write_atomic(tmp / "run_config.yaml", yaml.safe_dump(job.cfg.flat(), sort_keys=False))
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        with open(f, "rb") as handle:  # durable before the manifest says it is there
            os.fsync(handle.fileno())
        files[str(f.relative_to(tmp))] = f.stat().st_size
    test_hook(f"save-{state.step}:files-written")
    write_atomic(tmp / CHECKPOINT_MANIFEST, json.dumps({"step": state.step, "files": files}, indent=1))
    test_hook(f"save-{state.step}:manifest-written")


def _disk_full(job: Job, e: BaseException, tmp: Path) -> RecipeError | None:
    """The save failed for want of space (stops.disk_full; None: another failure): the bytes needed
    are the newest complete checkpoint's, else the model's and the optimizer's tensors."""
    complete = [c for c in list_checkpoints(job.run_dir.path) if c.problem is None]
    if complete:
        needed = sum(f.stat().st_size for f in complete[-1].path.rglob("*") if f.is_file())
    else:
        model = job.accelerator.unwrap_model(job.model)
        optimizer_state = [v for s in job.optimizer.state.values() for v in s.values()]
        needed = tensor_bytes(model.state_dict().values()) + tensor_bytes(optimizer_state)
    return disk_full(job, e, tmp, what=f"the checkpoint {tmp.name}", needed=needed)


def _rotate(job: Job, kept: Path, *, hook: str = "") -> None:
    """Keep the newest --keep-last complete checkpoints by step number; ``kept`` always stays."""
    complete = [c for c in list_checkpoints(job.run_dir.path) if c.problem is None and c.path != kept]
    for old in complete[: max(0, len(complete) - (job.cfg.checkpoint.keep_last - 1))]:
        remove_checkpoint(old.path, hook=hook)


def finish_rotation(job: Job, resumed: Path) -> None:
    """A kill between a save's rename and its rotation leaves one checkpoint more than --keep-last;
    a run resumed from its newest checkpoint finishes that rotation (the save at the last step has no
    later save to do it: CI saw step 8 left beside 10 and 12). Resumed from an older one, nothing is
    removed."""
    complete = [c for c in list_checkpoints(job.run_dir.path) if c.problem is None]
    if job.accelerator.is_main_process and complete and complete[-1].path.resolve() == resumed.resolve():
        _rotate(job, resumed)
    job.accelerator.wait_for_everyone()


def load_checkpoint(job: Job, path: Path) -> None:
    """Model, optimizer, schedule and RNG states (Accelerate's load_state, safetensors and
    weights-only loads); on the fully_shard route the DCP shards of the model and optimizer too.

    Nothing in the folder is unpickled as is: a checkpoint given to --resume-from may come from
    anyone. Accelerate's torch.loads are weights-only, but under FSDP its load_state reads DCP
    folders (a pickled .metadata, items loaded without weights_only), so every DCP folder is
    checked first (hf_memstack.distributed.checkpoint.check_checkpoint_folder), and the fully_shard route's own load
    reads them safely (load_sharded_checkpoint without trusted=True).

    Raises:
        RecipeError: a file that does not load, or holds more than plain data, naming the checkpoint.
    """
    from hf_memstack.distributed.checkpoint import (
        UntrustedCheckpointError,
        check_checkpoint_folder,
        load_sharded_checkpoint,
    )

    check_resumed_step(path, job.state.step, job.total_steps)  # every rank: each raises the same
    refused = None
    try:
        for metadata in sorted(path.rglob(".metadata")):
            check_checkpoint_folder(metadata.parent)
    except UntrustedCheckpointError as e:
        refused = RecipeError(
            f"resume_from={str(path)!r}: refused without loading it, because loading would run code or read "
            f"files from outside it: {e}. The recipe's own checkpoints never hold such files: this one was "
            "altered or made elsewhere; resume from a checkpoint this recipe wrote, or start again"
        )
    refused = refused or _unreadable_rng_state(path, job.accelerator.process_index)
    agree(job.accelerator, refused)  # before load_state's collectives: every rank stops with it
    four_bit = job.policy.quant.mode != "none"
    if four_bit:
        _check_4bit_checkpoint(job, path)
    try:
        job.accelerator.load_state(str(path))
        if job.route == "fully_shard":
            load_sharded_checkpoint(job.model, job.optimizer, str(path / "sharded"))
    except Exception as e:  # noqa: BLE001 - a foreign or damaged file the size check could not see: say which checkpoint
        raise _unloadable(path, e) from None


def _unreadable_rng_state(path: Path, process_index: int) -> RecipeError | None:
    """Accelerate's load_state skips an RNG state it cannot load with only a log line, and the run
    would go on with other random draws than the interrupted one: refuse it instead (loaded the
    way Accelerate loads it, weights-only)."""
    from accelerate.utils import load
    from accelerate.utils.constants import RNG_STATE_NAME

    rng = path / f"{RNG_STATE_NAME}_{process_index}.pkl"
    try:
        load(rng)
    except Exception as e:  # noqa: BLE001 - missing, damaged or not plain data: the resume would not be exact
        return RecipeError(
            f"resume_from={str(path)!r}: {rng.name} does not load ({type(e).__name__}: {str(e).strip()[:160]}), "
            "so the resumed run could not continue the interrupted one's random draws; resume from an "
            "earlier checkpoint or start again"
        )
    return None


def _unloadable(path: Path, e: BaseException) -> RecipeError:
    refused = _refused_pickle(path) if "Weights only load failed" in str(e) else None
    if refused is not None:
        name, reason = refused
        return RecipeError(
            f"resume_from={str(path)!r}: {name} holds objects that weights-only loading refuses ({reason}): it was "
            "not made by this recipe or was tampered with, and nothing in it was run. Resume from a checkpoint "
            "this recipe wrote, or start again"
        )
    return RecipeError(
        f"resume_from={str(path)!r}: the checkpoint does not load ({type(e).__name__}: {str(e)[:200]}); "
        "resume from an earlier one or start again"
    )


def _refused_pickle(path: Path) -> tuple[str, str] | None:
    """After a weights-only load failed somewhere in Accelerate's load_state: the checkpoint's file
    that weights-only loading refuses (loaded as Accelerate loads it, memory-mapped so the tensors
    are not read) and the global it names, without torch's advice to load it with
    weights_only=False (that would run the file's code)."""
    import pickle

    from accelerate.utils import load

    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in {".bin", ".pt", ".pth", ".pkl"}):
        try:
            load(f, map_location="cpu", mmap=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL:? ([\w.]+)", str(e))
            return str(f.relative_to(path)), f"it names the global {named.group(1)}" if named else "not plain data"
        except Exception:  # noqa: BLE001, S112 - not the file weights-only loading refused (damaged, or not a zip): look on
            continue
    return None


def commit_output(job: Job, plan: OutputPlan) -> None:
    """The first writes, once setup has validated everything: --overwrite's removal, the abandoned
    branch's checkpoints, the manifest and run_config.yaml."""
    acc, run_dir = job.accelerator, plan.run_dir
    error = None
    if acc.is_main_process:
        try:
            lock_for_writing(run_dir.path, planned_on=plan.entries)
        except RecipeError as e:
            error = e
    agree(acc, error)  # a refusal ends every rank with its message, before anything is written
    if acc.is_main_process:
        if plan.overwrite:
            kept = run_dir.remove_recipe_files()
            run_dir.manifest = RunDir(run_dir.path).manifest
            job.log(
                f"--overwrite: removed the previous run's files from {run_dir.path}"
                + (f"; kept yours: {', '.join(kept)}" if kept else "")
            )
        for c in reversed(plan.discard):
            remove_checkpoint(c.path)
            job.log(f"--discard-later-checkpoints: removed {c.path}")
        if plan.discard and (run_dir.path / "model").exists():
            _remove_model(run_dir)  # the abandoned branch's final model
        run_dir.manifest["run"] = job.record
        if LOCK not in run_dir.manifest["files"]:
            run_dir.manifest["files"].append(LOCK)  # the lock file is the recipe's (kept by --overwrite)
        run_dir.path.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir.path / MANIFEST, json.dumps(run_dir.manifest, indent=1))
        run_dir.write("run_config.yaml", yaml.safe_dump(job.cfg.flat(), sort_keys=False))
    acc.wait_for_everyone()
    test_hook("committed", acc.process_index)


def _remove_model(run_dir: RunDir) -> None:
    # Through real folders only, as --overwrite: a model/ you replaced by a symlink is not followed.
    for path in [
        p
        for n, p in zip(manifest_entries(run_dir.manifest, "files"), run_dir._owned("files"))
        if n.startswith("model/")
    ]:
        if not path.is_symlink():
            path.unlink(missing_ok=True)
    for name in ("report.json",):
        (run_dir.path / name).unlink(missing_ok=True)
    model = run_dir.path / "model"
    if model.is_dir() and not any(model.iterdir()):
        model.rmdir()
