"""A policy's YAML file read into plain data: a regular file (never a FIFO, which would block, nor
a directory or a link to ``/dev/zero``) of at most 1 MiB, UTF-8, YAML's safe loader (files.load_yaml:
no aliases, every key once per mapping). Each failure is one :class:`~hf_memstack.errors.PolicyError` naming the file."""

from __future__ import annotations

from pathlib import Path

from ..errors import PolicyError
from ..files import FileContentError, load_yaml, read_regular

__all__ = ["MAX_POLICY_FILE_BYTES", "read_policy_file"]

# A policy file holds a few dozen lines (every field of every sub-config: about 1 KiB).
MAX_POLICY_FILE_BYTES = 2**20


def read_policy_file(path: Path) -> object:
    """The YAML value in ``path`` (None for an empty file).

    Raises:
        FileNotFoundError: nothing is at ``path``.
        PolicyError: it is not a regular file, too large, not UTF-8, not YAML, or nested too deeply.
    """
    try:
        text = read_regular(path, max_bytes=MAX_POLICY_FILE_BYTES).decode("utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(
            f"policy file {str(path)!r} does not exist; pass an existing YAML file or a policy string"
        ) from None
    except FileContentError as e:
        raise PolicyError(
            [f"policy file {str(path)!r}: {e}; pass a YAML file of policy fields or a policy string"]
        ) from None
    except UnicodeDecodeError as e:
        raise PolicyError(
            [f"policy file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"]
        ) from None
    try:
        return load_yaml(text, where=f"policy file {str(path)!r}")
    except FileContentError as e:
        raise PolicyError([f"{e}; fix the file (a YAML mapping of policy fields)"]) from None
