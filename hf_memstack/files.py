"""Reading and writing the files a user may have received: bounded reads of regular files only,
one JSON reader, and saved weights that get the file mode every other saved file gets.

A received file can be anything its sender made it: a FIFO (a read blocks forever), a symlink to
``/dev/zero`` (a read never ends), a directory, or JSON nested 100,000 deep (``json`` raises
``RecursionError``, which no ``except ValueError`` catches). :func:`read_regular` and
:func:`read_json` turn each of these into a :class:`FileContentError` (a ``ValueError``) that
says what the file is, before anything else happens.

Weight file modes:

safetensors >= 0.8 writes each file through a temporary file (``tempfile::NamedTempFile``, always
mode 0600) renamed into place (safetensors#764; open upstream: safetensors#782), so
``save_pretrained``'s ``model.safetensors`` is readable by its owner only while ``config.json``
next to it follows the umask (0644 under the usual 022): a model directory shared by a team is
unreadable by the team. :func:`weights_follow_umask` gives the weight files a save wrote the
mode an ordinary ``open()`` would have: ``0o666 & ~umask``.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yaml.nodes import MappingNode, Node

__all__ = [
    "FileContentError",
    "current_umask",
    "describe_kind",
    "irregular_files",
    "load_yaml",
    "loads_json",
    "read_json",
    "read_regular",
    "weights_follow_umask",
]

# Every JSON file the package or the recipe reads (config.json, trainer_state.json, checkpoint.json,
# manifests, cache entries) is far below this; a larger one is not one of ours.
DEFAULT_MAX_BYTES = 64 * 2**20


class FileContentError(ValueError):
    """A file that is not what its name promises: not a regular file (a FIFO, a directory, a
    device), larger than any such file is, or JSON that cannot be read. The message names the
    path and what it is."""


def describe_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a directory", "a FIFO (named pipe)", ...)."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def irregular_files(folder: str | os.PathLike[str]) -> list[str]:
    """The entries of ``folder`` (a model or tokenizer folder) that are neither regular files nor
    folders, each as "NAME is a FIFO (named pipe)": Transformers would open them, and a FIFO blocks
    its reader forever (or is reported as a missing model.safetensors or a truncated tokenizer.json).
    A symlink counts as what it points to (``stat`` never blocks, even on a FIFO); a dangling one is
    skipped. Not a folder: []."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            found.append(f"{entry.name} is {describe_kind(mode)}")
    return found


def read_regular(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of ``path``, which must be a regular file (a symlink to one is fine) of at most
    ``max_bytes``. Opened non-blocking, so a FIFO is refused instead of waiting for a writer, and
    read at most ``max_bytes + 1`` bytes, so ``/dev/zero`` is refused instead of filling memory.

    Raises:
        FileNotFoundError, PermissionError, ...: as ``open`` does (an OSError).
        FileContentError: not a regular file, or larger than ``max_bytes``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileContentError(f"{os.fspath(path)} is {describe_kind(st.st_mode)}, not a regular file")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise FileContentError(f"{os.fspath(path)} is larger than {max_bytes:,} bytes, more than such a file holds")
    return b"".join(chunks)


def loads_json(text: str | bytes, *, where: str = "the JSON") -> Any:
    """``json.loads`` whose every failure is a ``ValueError``: nesting too deep for Python's parser
    (``RecursionError``) included.

    Raises:
        FileContentError: naming ``where`` and what is wrong.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise FileContentError(f"{where} is nested too deeply to read (thousands of [ or {{ levels)") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise FileContentError(f"{where} is not valid JSON ({e})") from None


def load_yaml(text: str, *, where: str = "the YAML", unique_keys: bool = True) -> Any:
    """``yaml.safe_load`` whose every failure is a :class:`FileContentError` naming ``where``.

    Aliases (``*name``) are refused: nine nested anchors of nine aliases each (a 417-byte file)
    expand to 9**9 strings, gigabytes of memory and minutes of work, and neither a policy nor a run
    config ever needs one. Nesting too deep for Python's stack (``RecursionError``) and, with
    ``unique_keys``, a key given twice in one mapping (the last would silently win) are refused too.

    Raises:
        FileContentError: naming ``where``, the line and column, and what is wrong.
    """
    import yaml

    try:
        return yaml.load(text, Loader=_safe_loader(unique_keys))  # noqa: S506 - a SafeLoader
    except RecursionError:  # YAML's composer recurses once per level: 100,000 '[' exhaust Python's stack
        raise FileContentError(f"{where} is nested too deeply to read (thousands of [ or {{ levels)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        hint = " (indent with spaces, not tabs)" if "\\t" in str(problem) or "'\\t'" in str(e) else ""
        raise FileContentError(f"{where} is not valid YAML{line}: {problem}{hint}") from None


def _safe_loader(unique_keys: bool) -> type:
    import yaml

    class SafeLoader(yaml.SafeLoader):
        """YAML's safe loader without aliases (and, with ``unique_keys``, without repeated keys)."""

        def compose_node(self, parent: Node | None, index: object) -> Node | None:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"an alias (*{event.anchor}) is not allowed here: aliases can expand a small file into "
                    "billions of values; write each value out",
                    event.start_mark,
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[object, object]:
            seen: set[object] = set()
            for key_node, _ in node.value if unique_keys else ():
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return SafeLoader


def read_json(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The JSON value in ``path``: a regular file of at most ``max_bytes`` (:func:`read_regular`),
    parsed by :func:`loads_json`.

    Raises:
        OSError: the file cannot be opened (missing, no permission).
        FileContentError: it is not a regular file, too large, not JSON or nested too deeply.
    """
    return loads_json(read_regular(path, max_bytes=max_bytes), where=os.fspath(path))


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
