"""Why a run stops before its end, said in one message: a loss or weights that are not finite, a
full disk, SIGINT or SIGTERM. Each names where the run stopped, the newest complete checkpoint and
the command that resumes from it (the run's own command with ``--resume-from latest``)."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shlex
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .checkpoint_dirs import list_checkpoints
from .common import RecipeError, printable

if TYPE_CHECKING:  # for annotations only: job.py imports this module
    from types import FrameType

    from .flags import FinetuneConfig
    from .job import Job, RunState

# Flags that end a run differently from the one resumed: dropped from the resume command.
_SWITCHES = ("overwrite", "discard_later_checkpoints")
_BOOLS = {"true", "false", "yes", "no", "t", "f", "y", "n", "1", "0"}
SIGNAL_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def resume_command(
    argv: list[str], cfg: FinetuneConfig, *, script: str, world: int, changes: dict[str, str | None] | None = None
) -> str:
    """The run's own command line with ``--resume-from latest`` and ``changes`` (flat names: a value,
    or None for a switch, e.g. ``{"allow_config_change": None, "lr": "1e-05"}``): its --resume-from,
    --overwrite, --discard-later-checkpoints and the flags ``changes`` sets dropped. Under a launcher
    (``world`` > 1): the script and its arguments, for that launcher."""
    changes = changes or {}
    valued = {"resume_from", *(k for k, v in changes.items() if v is not None)}
    switches = {*_SWITCHES, *(k for k, v in changes.items() if v is None)}
    kept: list[str] = []
    dropped: set[str] = set()
    i = 0
    while i < len(argv):
        token, key = argv[i], _key(argv[i])
        i += 1
        if key not in valued and key not in switches:
            kept.append(token)
            continue
        dropped.add(key)
        if "=" not in token and i < len(argv) and (key in valued or argv[i].lower() in _BOOLS):
            i += 1  # its value (a switch's is optional)
    # A switch set in a --config file and not on the command line: said off explicitly.
    off = [k for k in _SWITCHES if k not in dropped and cfg.value(k)]
    added = [
        *(("--" + k.replace("_", "-"), v) for k, v in changes.items()),
        *((f"--{k.replace('_', '-')}", "false") for k in off),
    ]
    args = [*kept, "--resume-from", "latest", *(a for flag, v in added for a in (flag, v) if a is not None)]
    if world > 1:
        return f"your launcher with {world} processes again, with: {printable(shlex.join([script, *args]))}"
    return printable(shlex.join(["python", script, *args]))


def _key(token: str) -> str | None:
    """``--resume-from=x`` -> ``resume_from``; a value (not a flag) -> None."""
    if not token.startswith("--"):
        return None
    return token[2:].partition("=")[0].replace("-", "_")


def where_to_resume(out: Path, command: str) -> str:
    """The newest complete checkpoint under ``out`` and the command that resumes from it."""
    complete = [c for c in list_checkpoints(out) if c.problem is None]
    if not complete:
        return f"No checkpoint was saved yet: the run starts again from step 0 with: {command}"
    newest = complete[-1]
    return (
        f"The newest checkpoint is {printable(str(newest.path))} (step {newest.step}); resume from it with: {command}"
    )


# ----------------------------------------------------------------------------- non-finite values
def nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """The first floating tensor holding NaN or inf (its name, and 'nan' or 'inf'); None: all
    finite. Meta tensors (not loaded on this rank) are skipped; a sharded one is checked on its
    local shard. Exact: a sum that is not finite (``_screen``) is confirmed element by element."""
    for name, tensor in named:
        t = _checkable(tensor)
        if t is None or bool(_screen([t])) or bool(torch.isfinite(t).all()):
            continue
        return name, "nan" if bool(torch.isnan(t).any()) else "inf"
    return None


def _checkable(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor (a sharded one's local shard) to check, None for one not to: not floating, on
    the meta device (not loaded on this rank), empty, or 4-bit (frozen codes, checked as the
    weights they were quantized from)."""
    from hf_memstack.transforms.quant.apply import is_4bit

    t = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return None if is_4bit(t) or t.is_meta or not t.is_floating_point() or not t.numel() else t


def _screen(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every tensor's sum (in fp32) is finite, as one 0-d bool tensor, nothing waited for:
    a NaN or inf anywhere makes its tensor's sum NaN or inf, in one pass without the temporary
    ``isfinite`` allocates (16x faster on CPU: 0.10 s against 1.5 s for 134M fp32 weights). A sum
    past fp32's range from finite weights (~1e30 each) also fails it: ``nonfinite`` then decides."""
    sums = [t.sum(dtype=torch.float32) for t in tensors]
    return torch.isfinite(torch.stack(sums)).all() if sums else torch.ones((), dtype=torch.bool)


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``_screen`` over the floating tensors to check, as a 0-d float tensor (1.0: every sum is
    finite): no wait for the device until it is read. 0.0 is confirmed with ``nonfinite``."""
    return _screen([t for t in map(_checkable, tensors) if t is not None]).float()


def tensor_bytes(tensors: Iterable[object]) -> int:
    """The bytes of these tensors (whole, where sharded); anything not a tensor counts 0."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def nonfinite_in_files(files: Iterable[Path]) -> tuple[Path, str, str] | None:
    """The first tensor of these safetensors files holding NaN or inf (file, tensor name, 'nan' or
    'inf'), read one tensor at a time; None: none does (or the files are not safetensors)."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), "pt") as f:
                found = nonfinite((k, f.get_tensor(k)) for k in f.keys())
        except (OSError, SafetensorError):
            continue
        if found is not None:
            return path, *found
    return None


def check_finite(job: Job, losses: list[torch.Tensor]) -> None:
    """Before anything is saved from the weights: the losses since the last log line and the
    trainable weights are finite, on every rank (one small all-reduce, once per save). Between
    saves the log lines check the loss they read anyway; a NaN or inf never reaches a checkpoint
    or the final model.

    Raises:
        RecipeError: on every rank, naming the step, the value and how to go on.
    """
    acc = job.accelerator
    trainable = [(n, p) for n, p in acc.unwrap_model(job.model).named_parameters() if p.requires_grad]
    loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=acc.device)
    local = torch.stack([loss.to(acc.device), all_finite(p for _, p in trainable).to(acc.device)])
    total = acc.reduce(local, reduction="sum")  # NaN anywhere stays NaN in the sum
    if not math.isfinite(mean_loss := float(total[0]) / acc.num_processes):
        raise diverged(job, f"the loss is {mean_loss}")
    if int(total[1]) == acc.num_processes:
        return
    # A weight's sum is not finite on some rank: the exact test decides, on every rank together.
    found = nonfinite(trainable)
    if float(acc.reduce(torch.tensor(float(found is not None), device=acc.device), reduction="sum")):
        named = f" ({found[0]!r} holds {found[1]})" if found else " (on another rank's shard)"
        raise diverged(job, f"the trainable weights are no longer finite{named}")


def diverged(job: Job, what: str) -> RecipeError:
    """Training diverged: where, and how to go on from the newest checkpoint (saved before it)."""
    changes: dict[str, str | None] = {"allow_config_change": None, "lr": f"{job.cfg.train.lr / 10:g}"}
    if not job.cfg.train.grad_clip:
        changes["grad_clip"] = "1.0"
    return RecipeError(
        f"step {job.state.step}: {what}: training diverged, so the run stopped before saving anything from these "
        "weights. "
        + where_to_resume(job.run_dir.path, job.resume_command(changes))
        + f" (a tenth of --lr={job.cfg.train.lr:g}{', with gradient clipping' if 'grad_clip' in changes else ''}). "
        "Resuming unchanged would diverge again at the same step; also check the training rows (one with broken "
        "text or labels can cause it)"
    )


def _float_tensors(value: object, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating-point tensor in a state dict, at any depth (the optimizer rungs nest theirs
    differently: one optimizer per parameter under optim:in_backward), with its path."""
    if torch.is_tensor(value):
        if value.is_floating_point():
            yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _float_tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _float_tensors(item, f"{name}[{i}]")


def nonfinite_checkpoint(job: Job, path: Path) -> RecipeError | None:
    """A checkpoint whose weights hold NaN or inf (saved from a run that had diverged, or damaged)
    would train on to a NaN model: refused, naming the tensor and its file."""
    found = nonfinite(job.accelerator.unwrap_model(job.model).state_dict().items())
    if found is None:
        # The optimizer's moments too: a NaN second moment makes the first resumed step NaN, and the
        # advice to resume this checkpoint with a lower lr would repeat it.
        if (found := nonfinite(_float_tensors(job.optimizer.state_dict(), "optimizer"))) is None:
            return None
        name, kind = found
        return RecipeError(
            f"resume_from={str(path)!r}: the checkpoint's optimizer state holds {kind} values ({name}, in "
            "optimizer.bin): it was saved from a run that had diverged, or damaged, and its first step would be NaN. "
            "Resume from an earlier checkpoint (--resume-from checkpoints/step-N), or start again"
        )
    name, kind = found
    in_file = nonfinite_in_files(sorted(path.glob("*.safetensors")))
    held = f"tensor {in_file[1]!r} of {in_file[0]}" if in_file else f"the model's tensor {name!r}"
    return RecipeError(
        f"resume_from={str(path)!r}: the checkpoint's weights hold {kind} values ({held}): it was saved from a "
        "run that had diverged, or damaged, and training from it gives a NaN loss. Resume from an earlier "
        "checkpoint (--resume-from checkpoints/step-N), or start again"
    )


# ----------------------------------------------------------------------------- a full disk
def no_space_left(e: BaseException, folder: Path, needed: int) -> bool:
    """Whether a save failed for want of space: an ENOSPC/EDQUOT OSError anywhere in the exception's
    chain; or (safetensors and torch.save report it as their own errors, without errno) fewer
    bytes free on ``folder``'s disk than the save needs."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(folder).free < needed
    except OSError:
        return False


def disk_full(job: Job, e: BaseException, tmp: Path, *, what: str, needed: int) -> RecipeError | None:
    """A save into ``tmp`` that failed for want of space (``no_space_left``), as one message naming
    the disk (its mount point), the bytes needed and free, and the command that resumes; None: it
    failed otherwise. The main process first removes the partial ``tmp``, giving its space back
    (the earlier checkpoints and model are untouched)."""
    folder = tmp.parent
    if not no_space_left(e, folder, needed):
        return None
    if job.accelerator.is_main_process and tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    mount = folder.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    free = shutil.disk_usage(folder).free
    return RecipeError(
        f"no space left on the disk holding {printable(str(folder))} (mounted at {printable(str(mount))}) while "
        f"writing {what}: it takes about {_size(needed)}, {_size(free)} are free. The earlier checkpoints are "
        f"intact and the partial save was removed. Free at least {_size(max(needed - free, 0))} there (or lower "
        f"--keep-last). " + where_to_resume(job.run_dir.path, job.resume_command())
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB ({n:,} bytes)"


# ----------------------------------------------------------------------------- SIGINT, SIGTERM
@contextlib.contextmanager
def say_where_on_interrupt(describe: Callable[[int], str]) -> Iterator[None]:
    """Within: SIGINT and SIGTERM print ``describe(signal)`` as one line on stderr (rank 0 only),
    then end the process by that signal, as it would have ended without this (exit status 130 and
    143 in a shell). Nothing is unwound: a checkpoint being saved is left as a kill leaves it
    (never counted, swept by the next save), so resuming is exactly as after a SIGKILL.
    Outside the main thread (signals cannot be handled there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        before = previous[signum]
        if os.getpid() != owner and callable(before):  # a forked DataLoader worker: as without this
            before(signum, frame)  # (SIGINT: KeyboardInterrupt, which the worker expects)
            return
        signal.signal(signum, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        if os.getpid() == owner and os.environ.get("RANK", "0") == "0":
            with contextlib.suppress(Exception):  # the process ends by the signal whatever happens here
                # os.write, not print: the signal may land inside a write to sys.stderr (the progress bar).
                os.write(2, f"\nfinetune.py: {describe(signum)}\n".encode())
        os.kill(os.getpid(), signum)

    previous = {s: signal.signal(s, handler) for s in SIGNAL_NAMES}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def interrupted(signum: int, argv: list[str], run: RunState, *, script: str) -> str:
    """The line SIGINT or SIGTERM prints: where the run stopped, the newest checkpoint, the resume command."""
    name, cfg, job = SIGNAL_NAMES[signal.Signals(signum)], run.get("cfg"), run.get("job")
    if cfg is None:
        return f"stopped by {name} before the flags were read; nothing was written"
    if job is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        command = resume_command(argv, cfg, script=script, world=world)
        return (
            f"stopped by {name} during setup, before training. {where_to_resume(Path(cfg.output.output_dir), command)}"
        )
    return f"stopped by {name} after step {job.state.step} of {job.total_steps}. " + where_to_resume(
        job.run_dir.path, job.resume_command()
    )
