"""One run at a time in an output directory: an exclusive ``flock`` on its ``recipe.lock``.

Two runs writing one directory sweep each other's temporary saves and rotate each other's
checkpoints away (one died on a raw FileNotFoundError). The main process (global rank 0, the only
one that writes there) holds the lock from the moment it reads a run of this recipe in the
directory until it exits; on a new or empty directory, from its first write, when it checks that
no other run has written there meanwhile. The kernel releases a ``flock`` when its process dies,
so a run that was killed (SIGKILL, OOM) never blocks the ``--resume-from latest`` that follows.

The lock file is opened without following a symlink and is never written through one; it stays in
the directory (removing it would let a third run lock a new file while a second still waits on
the old one), claimed in the manifest, and holds the pid of the run that last started writing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from hf_memstack.files import describe_kind

from .common import RecipeError

LOCK = "recipe.lock"
_RECORD_MAX = 256  # "pid N on HOST"
_BUSY = "nothing was loaded or written"


@dataclass
class RunLock:
    path: Path
    fd: int


_HELD: dict[str, RunLock] = {}  # this process's locks, by the directory's real path


def is_main_process() -> bool:
    """Before the Accelerator exists: the process that writes the output directory (global rank 0
    under torchrun and accelerate launch, which set RANK; the only process otherwise)."""
    return os.environ.get("RANK", "0") == "0"


def holds_lock(out: Path) -> bool:
    return os.path.realpath(out) in _HELD


def acquire(out: Path) -> RunLock:
    """This process's exclusive lock on ``out`` (an existing directory); taken once, kept until
    release_run_locks.

    Raises:
        RecipeError: another process holds it (naming its pid), or the lock file is a symlink or
            not a regular file.
    """
    key = os.path.realpath(out)
    if key in _HELD:
        return _HELD[key]
    path = out / LOCK
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RecipeError(
                f"output_dir={str(out)!r}: {LOCK} is a symlink (to {os.readlink(path)}), and the recipe keeps its "
                f"lock file itself, never through a link; {_BUSY}. Remove the link or choose another --output-dir"
            ) from None
        raise RecipeError(
            f"output_dir={str(out)!r}: {LOCK} cannot be opened ({e.strerror}); {_BUSY}. Make the directory "
            "writable or choose another --output-dir"
        ) from None
    try:
        _lock(out, path, fd)
    except BaseException:
        os.close(fd)
        raise
    _HELD[key] = RunLock(path, fd)
    return _HELD[key]


def is_recipe_lock(path: Path) -> bool:
    """Whether ``path`` is a lock file as the recipe leaves one: a regular file of one name (not a
    hard link to a file elsewhere), empty or holding the pid record."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > _RECORD_MAX:
            return False
        with open(path, "rb") as f:
            content = f.read(_RECORD_MAX)
    except OSError:
        return False
    return not content or content.startswith(b"pid ")


def _lock(out: Path, path: Path, fd: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        what = describe_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names"
        raise RecipeError(
            f"output_dir={str(out)!r}: {LOCK} is {what}, where the recipe keeps its lock file (a regular file of one "
            f"name, never a hard link); {_BUSY}. Remove it or choose another --output-dir"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise RecipeError(
            f"output_dir={str(out)!r} is in use by another run of this recipe ({_holder(fd, st)}), which holds "
            f"{path}; two runs in one directory would remove each other's checkpoints, so {_BUSY}. Wait for it to "
            "finish (a run that was killed releases the lock: --resume-from latest then continues it), or choose "
            "another --output-dir"
        ) from None


def _holder(fd: int, st: os.stat_result) -> str:
    """Who holds the lock: the pid /proc/locks gives for the file (Linux), else the one the run
    recorded in it when it started writing."""
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "FLOCK" in fields and device in fields:
                    pid = fields[fields.index(device) - 1]
                    if pid.isdigit() and pid != "0":
                        return f"pid {pid}"
    except OSError:
        pass
    recorded = os.pread(fd, _RECORD_MAX, 0).decode("utf-8", "replace").strip()
    return recorded if recorded.startswith("pid ") else "another process"


def lock_for_writing(out: Path, *, planned_on: list[str]) -> None:
    """Before the first write into ``out``: hold its lock, and, unless this process held it since
    the directory was read (planned_on: what it held then), check that no other run has written there
    since: two runs started at once on a new directory both found it empty.

    Raises:
        RecipeError: another run holds it, or wrote into it meanwhile; nothing was written.
    """
    fresh = not holds_lock(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = acquire(out)
    now = sorted(p.name for p in out.iterdir() if p.name != LOCK)
    if fresh and now != sorted(planned_on):
        raise RecipeError(
            f"output_dir={str(out)!r}: another run wrote into it since this one started (it now holds "
            f"{', '.join(now[:5])}{', ...' if len(now) > 5 else ''}); nothing was written. Continue that run with "
            "--resume-from latest, or choose another --output-dir"
        )
    if is_recipe_lock(lock.path):  # never over a file of yours that happens to bear the name
        record = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()[:_RECORD_MAX]
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, record, 0)


def release_run_locks() -> None:
    """Release every lock this process holds (at the end of main). LOCK_UN first: a forked child
    (a data loader worker) shares the descriptor, and closing ours alone would leave it locked."""
    while _HELD:
        _, lock = _HELD.popitem()
        try:
            fcntl.flock(lock.fd, fcntl.LOCK_UN)
        finally:
            os.close(lock.fd)
