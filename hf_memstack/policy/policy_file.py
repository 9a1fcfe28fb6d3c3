"""A policy's YAML file read into plain data: a regular file (never a FIFO, which would block, nor
a directory or a link to ``/dev/zero``) of at most 1 MiB, UTF-8, YAML's safe loader with every key
once per mapping. Each failure is one :class:`~hf_memstack.errors.PolicyError` naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import PolicyError
from ..files import FileContentError, read_regular

__all__ = ["MAX_POLICY_FILE_BYTES", "read_policy_file"]

# A policy file holds a few dozen lines (every field of every sub-config: about 1 KiB).
MAX_POLICY_FILE_BYTES = 2**20


def read_policy_file(path: Path) -> Any:
    """The YAML value in ``path`` (None for an empty file).

    Raises:
        FileNotFoundError: nothing is at ``path``.
        PolicyError: it is not a regular file, too large, not UTF-8, not YAML, or nested too deeply.
    """
    import yaml

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
        return yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader
    except RecursionError:  # YAML's composer recurses once per level: 100,000 '[' exhaust Python's stack
        raise PolicyError(
            [
                f"policy file {str(path)!r} is nested too deeply to read (thousands of [ or {{ levels); write a mapping of policy fields"
            ]
        ) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        hint = " (indent with spaces, not tabs)" if "\\t" in str(problem) or "'\\t'" in str(e) else ""
        raise PolicyError([f"policy file {str(path)!r} is not valid YAML{line}: {problem}{hint}"]) from None


def _unique_key_loader() -> type:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """YAML's safe loader, refusing a key given twice in one mapping (the last would win silently)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader
