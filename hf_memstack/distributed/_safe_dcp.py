"""Reading a torch.distributed.checkpoint (DCP) folder without running code from it.

DCP's ``FileSystemReader.read_metadata`` unpickles the folder's ``.metadata`` with plain
``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` loads every non-tensor item (an
optimizer's ``lr``, ``betas``...) with ``torch.load(weights_only=False)``: a forged folder runs
code through either. A manifest with the right sizes and hashes does not help - it proves the
folder is self-consistent, not where it came from. So, unless the caller trusts the folder:

* ``.metadata`` is read by :class:`_MetadataUnpickler`, which builds only DCP's metadata
  dataclasses, ``torch.Size``, dtypes, layouts, memory formats, paths and plain containers, and
  refuses any other global before it is imported or called. torch's own weights-only unpickler
  (``torch.serialization.add_safe_globals``) cannot be used: it reads pickle protocol 2 only, and
  DCP writes protocol 4 (``FRAME``, ``STACK_GLOBAL``, ``MEMOIZE``). Like it, ours builds (``BUILD``)
  and creates (``NEWOBJ``) only instances of the allowed types, so a pickle cannot set attributes
  on a class or a function either.
* every data file the metadata points to must be a plain name inside the folder;
* every non-tensor item is loaded with ``torch.load(weights_only=True)`` (tensors already are).

The same bytes accepted here build the same objects under plain ``pickle``/``torch.load``, so
:func:`vet_checkpoint` also makes a later load by another reader (Accelerate's) safe.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard, cast

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["UntrustedCheckpointError", "plain_file_name", "read_metadata", "vet_checkpoint", "weights_only_load"]

HOW_TO_TRUST = (
    "If you made this checkpoint yourself (or trust whoever did), load it with trusted=True "
    "(load_sharded_checkpoint(..., trusted=True))"
)


class UntrustedCheckpointError(ValueError):
    """A checkpoint folder holds something that loading it would unpickle or execute, beyond plain data."""


@lru_cache(maxsize=1)
def _allowed() -> dict[tuple[str, str], object]:
    """(module, name) -> object, for every global a DCP ``.metadata`` may name."""
    import pathlib
    from collections import OrderedDict

    import torch.distributed.checkpoint.metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    objects: list[Any] = [
        md.Metadata,
        md.MetadataIndex,
        md.StorageMeta,
        md.TensorProperties,
        md.TensorStorageMetadata,
        md.ChunkStorageMetadata,
        md.BytesStorageMetadata,
        md._MEM_FORMAT_ENCODING,
        _StorageInfo,
        torch.Size,
        torch.serialization._get_layout,
        OrderedDict,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    ]
    allowed = {(o.__module__, o.__qualname__): o for o in objects}
    allowed.update({("pathlib", o.__name__): o for o in objects if o.__module__.startswith("pathlib")})
    allowed.update({("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


@lru_cache(maxsize=1)
def _allowed_types() -> tuple[type, ...]:
    return tuple({o for o in _allowed().values() if isinstance(o, type)})


class _MetadataUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be overridden
    """Unpickles DCP metadata and nothing else (see the module docstring)."""

    # The pure-Python unpickler's value stack: an undocumented internal that typeshed leaves out.
    stack: list[object]

    def find_class(self, module: str, name: str) -> object:
        # A lookup, never an import or getattr: naming a module must not import it.
        obj = _allowed().get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(
                f"it names the global {module}.{name}, which is not one of the "
                "torch.distributed.checkpoint metadata types"
            )
        return obj

    def persistent_load(self, pid: object) -> NoReturn:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never does")

    def _require(self, obj: object, what: str) -> None:
        if not any(obj is allowed for allowed in _allowed().values()):
            raise pickle.UnpicklingError(f"it {what} {obj!r}, which is not one of the checkpoint metadata types")

    def load_reduce(self) -> None:
        self._require(self.stack[-2], "calls")
        super().load_reduce()  # type: ignore[misc]  # typeshed leaves out _Unpickler's opcode handlers

    def load_newobj(self) -> None:
        self._require(self.stack[-2], "creates")
        super().load_newobj()  # type: ignore[misc]  # typeshed leaves out _Unpickler's opcode handlers

    def load_newobj_ex(self) -> None:
        self._require(self.stack[-3], "creates")
        super().load_newobj_ex()  # type: ignore[misc]  # typeshed leaves out _Unpickler's opcode handlers

    def load_build(self) -> None:
        inst = self.stack[-2]
        if type(inst) not in _allowed_types():  # never a class, a function or a module
            raise pickle.UnpicklingError(
                f"it sets the state of {type(inst).__name__} {inst!r:.80}, which is not a checkpoint metadata object"
            )
        super().load_build()  # type: ignore[misc]  # typeshed leaves out _Unpickler's opcode handlers

    # _Unpickler's opcode table, four handlers replaced. The cast: typeshed types the table's handlers as
    # taking the C pickle.Unpickler, which no _Unpickler subclass is.
    dispatch = {
        **pickle._Unpickler.dispatch,
        **cast(
            "dict[int, Callable[..., None]]",
            {
                pickle.REDUCE[0]: load_reduce,
                pickle.NEWOBJ[0]: load_newobj,
                pickle.NEWOBJ_EX[0]: load_newobj_ex,
                pickle.BUILD[0]: load_build,
            },
        ),
    }


def read_metadata(directory: Path) -> Metadata:
    """The folder's DCP ``Metadata``, unpickled with :class:`_MetadataUnpickler`, its data files checked.

    Raises:
        UntrustedCheckpointError: the file holds anything else, or points outside the folder.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = directory / ".metadata"
    if not _own_file(directory, path.name):
        raise UntrustedCheckpointError(
            f"checkpoint {str(directory)!r}: its .metadata is missing or a symlink (a save "
            f"writes a file). {HOW_TO_TRUST}"
        )
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - whatever stopped it (a refused global, a damaged file), it is not loaded
        why = (
            str(e)
            if isinstance(e, pickle.UnpicklingError)
            else f"it is damaged or not DCP metadata ({type(e).__name__}: {e})"
        )
        raise UntrustedCheckpointError(
            f"checkpoint {str(directory)!r}: its .metadata was not loaded, because {why}; loading it with plain pickle "
            f"(as torch.distributed.checkpoint does) could run code from the file. {HOW_TO_TRUST}"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UntrustedCheckpointError(
            f"checkpoint {str(directory)!r}: its .metadata holds a {type(metadata).__name__}, "
            f"not torch.distributed.checkpoint Metadata. {HOW_TO_TRUST}"
        )
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise UntrustedCheckpointError(
                f"checkpoint {str(directory)!r}: its .metadata records where {getattr(index, 'fqn', index)!r} is stored as a "
                f"{type(info).__name__}, not the _StorageInfo DCP writes: it is damaged or forged. {HOW_TO_TRUST}"
            )
        name = info.relative_path
        if not _own_file(directory, name):
            raise UntrustedCheckpointError(
                f"checkpoint {str(directory)!r}: its .metadata points to the data file {name!r}, which is not a file "
                f"of the folder (a path outside it, a symlink, or missing). {HOW_TO_TRUST}"
            )
    return metadata


def plain_file_name(name: object) -> TypeGuard[str]:
    """A file directly in the folder: no path separator, no '..'."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def _own_file(directory: Path, name: object) -> bool:
    """A regular file directly in ``directory``, not a symlink to one elsewhere."""
    return plain_file_name(name) and (directory / name).is_file() and not (directory / name).is_symlink()


def weights_only_load(value: io.BytesIO) -> io.BytesIO:
    """``value`` (a DCP non-tensor item) checked with ``torch.load(weights_only=True)``, and the
    loaded object saved again: what a planner's plain ``torch.load`` then reads is only that object."""
    try:
        obj = torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every refusal says the same thing: not plain data
        # torch's message opens with a paragraph on weights_only and ends with a link; between them it
        # names what was refused (after "WeightsUnpickler error:", when it has that line).
        lines = [line.strip() for line in str(e).split("Check the documentation")[0].splitlines()[1:] if line.strip()]
        why = " ".join(lines).split("WeightsUnpickler error:")[-1].strip()[:300] or str(e)[:300]
        raise UntrustedCheckpointError(
            f"a non-tensor item of the checkpoint is not plain data ({type(e).__name__}: {why}); "
            f"loading it without weights_only could run code. {HOW_TO_TRUST}"
        ) from None
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


def vet_checkpoint(directory: str | Path) -> Metadata:
    """Check everything a DCP load of ``directory`` would unpickle: the metadata, and each
    non-tensor item's bytes (loaded weights-only). Returns the metadata.

    Raises:
        UntrustedCheckpointError: naming what is not plain data, and how to trust the folder.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = Path(directory)
    metadata = read_metadata(directory)
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", None)  # a forged index may have none: get(None) is None, a tensor item
        if not isinstance(metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):  # type: ignore[arg-type]
            continue
        if info.transform_descriptors:
            raise UntrustedCheckpointError(
                f"checkpoint {str(directory)!r}: the item {index.fqn!r} is stored through "
                f"transforms {info.transform_descriptors!r}, which cannot be checked. {HOW_TO_TRUST}"
            )
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            try:
                weights_only_load(io.BytesIO(f.read(info.length)))
            except UntrustedCheckpointError as e:
                raise UntrustedCheckpointError(f"checkpoint {str(directory)!r}: the item {index.fqn!r}: {e}") from None
    return metadata
