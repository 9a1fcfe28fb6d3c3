"""Saved weights get the file mode every other saved file gets.

safetensors >= 0.8 writes each file through a temporary file (``tempfile::NamedTempFile``, always
mode 0600) renamed into place (safetensors#764; open upstream: safetensors#782), so
``save_pretrained``'s ``model.safetensors`` is readable by its owner only while ``config.json``
next to it follows the umask (0644 under the usual 022): a model directory shared by a team is
unreadable by the team. :func:`weights_follow_umask` gives the weight files a save wrote the
mode an ordinary ``open()`` would have: ``0o666 & ~umask``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["current_umask", "weights_follow_umask"]

_WEIGHTS = ("*.safetensors",)


def current_umask() -> int:
    """This process's umask. Read from /proc on Linux: setting it to read it back (``os.umask``)
    would change it for every thread for a moment."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _weight_files(directory: Path) -> dict[Path, tuple[int, int]]:
    if not directory.is_dir():
        return {}
    found = {}
    for pattern in _WEIGHTS:
        for path in directory.rglob(pattern):
            if path.is_file() and not path.is_symlink():
                st = path.stat()
                found[path] = (st.st_ino, st.st_mtime_ns)
    return found


@contextlib.contextmanager
def weights_follow_umask(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Around a save into ``directory``: the weight files it wrote (new, or replaced: another inode
    or mtime) get mode ``0o666 & ~umask``, like the other files of the save. Files that were
    there before and were not rewritten keep their mode (yours, chmodded on purpose)."""
    root = Path(directory)
    before = _weight_files(root)
    yield
    mode = 0o666 & ~current_umask()
    for path, stamp in _weight_files(root).items():
        if before.get(path) != stamp:
            os.chmod(path, mode)
