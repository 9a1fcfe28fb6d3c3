"""Names below the output directory, and writes and removals there that never go through a symlink.

The output directory may be shared, or received from someone else: any name in it can be a
symlink planted to a file or folder elsewhere. ``open(name, "w")`` writes into the link's target,
``shutil.rmtree`` refuses a link only after a removal inside it has already deleted a file, and a
name with '..' reaches outside. So every file the recipe writes is created new
(``O_EXCL | O_NOFOLLOW``) after whatever was at its name is removed (a link is removed, never
followed), a folder is removed only once ``lstat`` says it is a real one, and a name read from a
file is checked before it is joined onto a path.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from .common import RecipeError


def relative_inside(name: object) -> PurePosixPath | None:
    """``name`` as a path below a folder: a relative string without '..', not empty; None otherwise."""
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    path = PurePosixPath(name)
    if path.is_absolute() or PureWindowsPath(name).drive or ".." in path.parts or path == PurePosixPath("."):
        return None
    return path


def name_max(folder: Path) -> int:
    """The longest file name, in bytes, the file system at ``folder`` (or its nearest existing parent) takes."""
    existing = next((p for p in [folder, *folder.parents] if os.path.isdir(p)), Path("/"))  # no ENAMETOOLONG
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def symlink_inside(root: Path, name: str) -> str | None:
    """The first of ``name``'s parts below ``root`` (its folders, then the file) that is a symlink,
    as a relative name; None when there is none. ``name`` must be relative_inside."""
    relative = PurePosixPath(name)
    for depth in range(1, len(relative.parts) + 1):
        part = PurePosixPath(*relative.parts[:depth])
        if (root / part).is_symlink():
            return str(part)
    return None


def lstat_or_none(path: Path) -> os.stat_result | None:
    """``os.lstat``, or None where nothing is (a missing name, or a parent that is not a folder)."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new(path: Path) -> int:
    """A descriptor of ``path`` created new for writing (mode 0o666 & ~umask, as ``open`` gives).
    A file already there (a write cut short) or a symlink is removed first: the link itself, never
    what it points to; ``O_EXCL | O_NOFOLLOW`` then never opens anything but the new file.

    Raises:
        RecipeError: a directory stands at ``path``.
    """
    st = lstat_or_none(path)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise RecipeError(
                f"{path} is a directory, where the recipe writes a file of its own; move it away and resume "
                "with --resume-from latest"
            )
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags, 0o666)


def write_new(path: Path, data: str | bytes) -> None:
    """Write ``path`` as a new file (create_new): a symlink at its name is replaced, never followed."""
    with os.fdopen(create_new(path), "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``path`` so that it is either the old or the new content, never a truncated one: into
    its ``.tmp`` sibling, created new (a symlink planted there is removed, never written through),
    then renamed over ``path`` (which replaces a symlink at ``path`` too, never its target)."""
    tmp = path.with_name(path.name + ".tmp")
    with os.fdopen(create_new(tmp), "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_entry(path: Path) -> None:
    """Remove ``path`` without following a symlink: a link or a file is unlinked (a link's target
    is kept), a real folder removed with what it holds (``shutil.rmtree`` unlinks the links inside)."""
    st = lstat_or_none(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)
