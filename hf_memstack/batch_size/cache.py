"""The batch-size finder's disk cache: one small JSON file per job, keyed on everything that
changes a step's memory.

The key hashes the model's parameters as they are (name, shape, dtype, trainable - so a bf16 copy
or a LoRA model is another job than the fp32 original), its config, the policy, the optimizer and
its settings, the loss function, the batch's dtypes and shapes, the mode, the budget, the world
size, the device and the library versions. ``max_batch_size`` is not in the key: an entry says
whether it was capped, and the search honours each call's cap.

Files are written to a unique temporary file (``mkstemp``) and renamed over the entry, so two
finders writing at once never read a partial file or each other's temporary file; the folder is
private (0700). A file that cannot be read, parsed or validated is discarded with a warning, and
a folder that cannot be written costs a warning, never the search's result. ``cache_dir=`` can be
any folder, so an entry is read only if it is a regular file, at most 64 KiB, without blocking
(a FIFO, a symlink - to ``/dev/zero`` or anywhere -, a directory are named in a warning, never read,
removed or written through). The same holds for the ``batch_size`` folder the finder makes inside
``cache_dir``: a symlink or file planted in its place is named in a warning and the job runs
uncached (nothing outside is read, written, removed or chmod-ed).

An entry is checked against itself and the budget before its size runs again: it records the
steps its search ran (sizes, peaks, outcomes), and its size must be the largest of them that
fitted, with that step's peak, under this budget. A file edited by hand (``batch_size=60000``) or
damaged in a way JSON does not notice is discarded before ``make_batch`` is asked for its size -
a batch that large could exhaust the host's memory before any step measures it. A file forged
consistently in every field must still claim a peak of at least its size times what one sample
surely costs (its batch's tensors and last hidden state, measured on the batch of one), which
bounds the size the check step may run by the budget over that; the folder is private to its user
for the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .._device import device_of
from .._version import __version__
from ..files import FileContentError, describe_kind, loads_json, read_regular
from .ranks import agree, world_size

__all__ = ["CacheEntry", "CachedStep", "agree_entry", "cache_key", "read_entry", "write_entry"]

DEFAULT_CACHE_DIR = Path("~/.cache/hf_memstack")


# More steps than any search runs (its bound, the warm-up and a stale cache step): a longer list is not ours.
MAX_RECORDED_STEPS = 32
# The most bytes an entry is read for: one with MAX_RECORDED_STEPS steps and 13-digit sizes has
# about 2.6 KB, so anything larger is not an entry (a link to /dev/zero would otherwise be read
# until memory ran out).
MAX_ENTRY_BYTES = 64 * 2**10


@dataclass(frozen=True, kw_only=True, slots=True)
class CachedStep:
    """One step the search ran, as the entry records it."""

    batch_size: int
    peak_bytes: int | None
    """This rank's peak; None when it ran out of memory part-way."""
    fits: bool
    """It ran to the end under the budget on every rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheEntry:
    """What a cold search found, as stored."""

    batch_size: int
    """The largest size that fitted."""
    peak_bytes: int
    """Its measured peak (this rank's)."""
    bytes_per_sample: int
    """The slope of the line holding the peak there: a size one larger needs about this much more."""
    capped: bool
    """The search stopped at ``max_batch_size``: the true maximum may be larger."""
    steps: tuple[CachedStep, ...]
    """The steps the search ran (not its warm-up): ``batch_size`` must be the largest that fitted."""


def cache_path(cache_dir: str | Path | None, key: str) -> Path:
    return Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "batch_size" / f"{key}.json"


def cache_key(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    policy: dict[str, object] | None,
    batch: list[list[str | int]],
    mode: str,
    budget: int,
    loss_fn: object,
) -> str:
    """A hash of everything that changes the step's memory (see the module docstring)."""
    import transformers

    device = device_of(model)
    config = getattr(model, "config", None)
    signature = {
        "parameters": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "config": config.to_json_string(use_diff=False)
        if config is not None and hasattr(config, "to_json_string")
        else type(model).__qualname__,
        "policy": policy,
        # Every setting but the learning rate (swept often, never changes the state's size).
        "optimizer": None
        if optimizer is None
        else [type(optimizer).__qualname__, _plain({k: v for k, v in optimizer.defaults.items() if k != "lr"})],
        "loss_fn": None if loss_fn is None else getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__),
        "batch": batch,
        "mode": mode,
        "budget": budget,
        "world_size": world_size(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "versions": [torch.__version__, transformers.__version__, __version__],
    }
    return hashlib.sha256(json.dumps(signature, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read_entry(path: Path, *, budget: int, per_sample_floor: int = 0) -> CacheEntry | None:
    """The entry at ``path``; None when there is none. A file that is unreadable, invalid, not
    consistent with the steps it records or over ``budget`` is removed (with a warning naming it
    and why) and counts as none: nothing runs at its size. Something at ``path`` that is not a
    regular file (a symlink, a FIFO, a directory, a device) was not written by the finder: it is
    never read or removed, only named in a warning, and counts as none."""
    problem = _folder_problem(path.parent)
    if problem is not None:
        _warn(f"{problem}; searching again")
        return None
    try:
        found = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        _warn(f"cannot read the batch-size cache entry {path} ({e}); searching again")
        return None
    if not stat.S_ISREG(found.st_mode):
        _warn(f"{_not_ours(path, found.st_mode)}; searching again")
        return None
    entry, problem = _read_and_check(path, budget, per_sample_floor)
    if problem is not None:
        _warn(f"discarding {problem}")
        _unlink_if_same(path, found)
    return entry


def _read_and_check(path: Path, budget: int, per_sample_floor: int) -> tuple[CacheEntry | None, str | None]:
    """The entry at ``path`` (a regular file when looked at), or None and why it is discarded."""
    try:
        # Bounded and non-blocking: a file swapped for a FIFO or a link to /dev/zero since the
        # lstat above is refused by read_regular rather than read.
        data = loads_json(read_regular(path, max_bytes=MAX_ENTRY_BYTES), where="its text")
    except FileContentError as e:
        return None, f"the invalid batch-size cache entry {path} ({e}); searching again"
    except OSError as e:
        return None, f"the unreadable batch-size cache entry {path} ({e}); searching again"
    try:
        entry = _validate(data)
    except (ValueError, TypeError) as e:
        return None, f"the invalid batch-size cache entry {path} ({e}); searching again"
    problem = _inconsistency(entry, budget) or _too_cheap(entry, per_sample_floor)
    if problem is not None:
        return None, f"the batch-size cache entry {path}: {problem} - edited or damaged; measuring again"
    return entry, None


def _not_ours(path: Path, mode: int) -> str:
    return (
        f"the batch-size cache entry {path} is {describe_kind(mode)}, not a file hf_memstack wrote "
        "(the finder writes regular files only): not read, and left as it is - remove it yourself if it "
        "is not yours; until then this job is not cached"
    )


def _folder_problem(folder: Path) -> str | None:
    """Why the ``batch_size`` folder the finder makes inside ``cache_dir`` cannot be used, or None
    (a missing one is created). ``cache_dir`` is the user's choice and may be a link; this folder
    is the finder's own, so a symlink or a file in its place was planted: reading, writing,
    removing or chmod-ing through it would touch files elsewhere."""
    try:
        mode = folder.lstat().st_mode
    except OSError:
        return None  # missing (created later), or unreachable: the write warns with the error
    if stat.S_ISDIR(mode):
        return None
    what = describe_kind(mode)
    if stat.S_ISLNK(mode):
        try:
            what += f" to {os.readlink(folder)}"
        except OSError:
            pass
    return (
        f"the batch-size cache folder {folder} is {what}, not a folder hf_memstack made (the finder "
        "makes a private directory): nothing is read, written, removed or chmod-ed through it - remove "
        "it yourself if it is not yours, or pass another cache_dir; until then this job is not cached"
    )


def _unlink_if_same(path: Path, found: os.stat_result) -> None:
    """Remove the entry found at ``path``, only if it is still that regular file (never a link or
    FIFO put in its place since)."""
    try:
        now = path.lstat()
        if stat.S_ISREG(now.st_mode) and (now.st_dev, now.st_ino) == (found.st_dev, found.st_ino):
            path.unlink()
    except OSError:
        pass  # gone already, or the folder is read-only: the next search writes over it or warns


def _warn(message: str) -> None:
    # stacklevel: read_entry/write_entry -> the finder -> find_batch_size's caller.
    warnings.warn(f"hf_memstack: {message}", stacklevel=4)


def _validate(data: object) -> CacheEntry:
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, found {type(data).__name__}")
    problems = []
    for name in ("batch_size", "peak_bytes", "bytes_per_sample"):
        value = data.get(name)
        if not _count(value, least=0 if name == "bytes_per_sample" else 1):
            problems.append(f"{name}={value!r}")
    if not isinstance(data.get("capped"), bool):
        problems.append(f"capped={data.get('capped')!r}")
    steps = data.get("steps")
    if not isinstance(steps, list) or not 1 <= len(steps) <= MAX_RECORDED_STEPS or not all(map(_step_ok, steps)):
        shown = repr(steps) if len(repr(steps)) <= 80 else repr(steps)[:77] + "..."
        problems.append(
            f"steps={shown} (a list of 1 to {MAX_RECORDED_STEPS} {{batch_size, peak_bytes, fits}}; an entry "
            "written before hf_memstack recorded them has none)"
        )
    if problems:
        raise ValueError("missing or out-of-range " + ", ".join(problems))
    return CacheEntry(
        batch_size=data["batch_size"],
        peak_bytes=data["peak_bytes"],
        bytes_per_sample=data["bytes_per_sample"],
        capped=data["capped"],
        # A list here: any other ``steps`` was a problem, raised above.
        steps=tuple(
            CachedStep(batch_size=d["batch_size"], peak_bytes=d["peak_bytes"], fits=d["fits"])
            for d in cast("list[Any]", steps)
        ),
    )


def _count(value: object, *, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _step_ok(step: object) -> bool:
    return (
        isinstance(step, dict)
        and set(step) == {"batch_size", "peak_bytes", "fits"}
        and _count(step["batch_size"], least=1)
        and (step["peak_bytes"] is None or _count(step["peak_bytes"], least=1))
        and isinstance(step["fits"], bool)
        and (not step["fits"] or step["peak_bytes"] is not None)
    )


def _inconsistency(entry: CacheEntry, budget: int) -> str | None:
    """Why ``entry`` cannot be what a search under ``budget`` found, or None. A search's answer is
    the largest size that fitted, every size that did not fit is larger, and what fitted peaked
    under the budget (the budget is part of the key, so it is the one the entry was found under)."""
    if entry.peak_bytes > budget:
        return f"its peak_bytes={entry.peak_bytes} is above the budget of {budget} bytes it was found under"
    fitted = [s for s in entry.steps if s.fits]
    if not fitted:
        return "none of its recorded steps fitted"
    best = max(fitted, key=lambda s: s.batch_size)
    if (best.batch_size, best.peak_bytes) != (entry.batch_size, entry.peak_bytes):
        return (
            f"batch_size={entry.batch_size} with peak_bytes={entry.peak_bytes} is not what its recorded steps found "
            f"(the largest that fitted: {best.batch_size}, peak {best.peak_bytes} bytes)"
        )
    over = [s for s in fitted if (s.peak_bytes or 0) > budget]
    if over:
        return f"a recorded step at batch size {over[0].batch_size} fitted with a peak above the budget"
    below = [s.batch_size for s in entry.steps if not s.fits and s.batch_size <= entry.batch_size]
    if below:
        return f"batch size {below[0]} did not fit, yet the larger batch_size={entry.batch_size} did"
    return None


def _too_cheap(entry: CacheEntry, per_sample_floor: int) -> str | None:
    """Why ``entry``'s peak is below what its size surely costs (``per_sample_floor`` bytes a
    sample, measured on this job's batch of one), or None. A forged entry consistent in every field
    otherwise passes: running its size (60000 on a 20 MiB budget) would take gigabytes of host
    memory before a step measures it."""
    least = entry.batch_size * per_sample_floor
    if least <= entry.peak_bytes:
        return None
    return (
        f"batch_size={entry.batch_size} with peak_bytes={entry.peak_bytes}: this job's batch and hidden states "
        f"alone need at least {per_sample_floor} bytes a sample ({least} at that size)"
    )


def write_entry(path: Path, entry: CacheEntry) -> None:
    """Write atomically (unique temporary file, then rename); on failure warn and go on. The rename
    replaces a directory entry and never writes through a link; something at ``path`` that is not a
    regular file (a symlink, a FIFO) is not the finder's and is left as it is, with a warning."""
    tmp = None
    problem = _folder_problem(path.parent)
    if problem is not None:
        _warn(f"{problem}; the result is returned but not cached")
        return
    try:
        _private_dir(path.parent)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            _warn(f"{_not_ours(path, mode)}; the result is returned but not cached")
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(entry), f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        _warn(
            f"could not write the batch-size cache at {path.parent} ({e}); the result is "
            "returned but not cached (pass cache=False or another cache_dir)"
        )
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def agree_entry(entry: CacheEntry | None) -> CacheEntry | None:
    """The entry every rank can use (one collective): valid on every rank, at the smallest size
    any rank cached, capped if any rank's was; else None on every rank."""
    valid = entry is not None
    size = entry.batch_size if entry is not None else 0
    uncapped = entry is not None and not entry.capped
    ok, smallest = agree("cache entry", int(valid) * (2 if uncapped else 1), size)
    if not ok or entry is None:
        return None
    return CacheEntry(
        batch_size=smallest,
        peak_bytes=entry.peak_bytes,
        bytes_per_sample=entry.bytes_per_sample,
        capped=ok == 1 or smallest != entry.batch_size,
        steps=entry.steps,
    )


def _private_dir(folder: Path) -> None:
    """Create ``folder`` (and missing parents) readable by this user only. The folder itself is
    opened without following a link and made private through that descriptor, so a symlink or
    file put in its place raises (OSError) instead of having its target's mode changed."""
    missing = []
    p = folder.parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass  # an existing folder (or something planted: the open below refuses it)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.getuid():
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _plain(obj: object) -> object:
    """Optimizer settings as JSON (tensors, e.g. a tensor learning rate, by value)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if torch.is_tensor(obj):
        return obj.tolist() if obj.numel() <= 16 else str(obj.shape)
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else repr(obj)
