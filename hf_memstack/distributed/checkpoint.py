"""Sharded checkpoints under FSDP (torch.distributed.checkpoint): each rank writes its shards and
rank 0 a manifest last; loading checks the manifest and reads the folder without unpickling
anything as is (see ``_safe_dcp``), because DCP's own reader runs code from a forged folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from ..files import read_json
from ._ranks import on_every_rank
from ._safe_dcp import UntrustedCheckpointError, plain_file_name, vet_checkpoint, weights_only_load

if TYPE_CHECKING:
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
    from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "MANIFEST",
    "UntrustedCheckpointError",
    "check_checkpoint_folder",
    "load_sharded_checkpoint",
    "save_sharded_checkpoint",
]

MANIFEST = "hf_memstack_checkpoint.json"


def save_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str) -> None:
    """Each rank writes its own shards of the model and optimizer (torch.distributed.checkpoint);
    then rank 0 writes a manifest (every file's size, the metadata file's SHA-256), last, so that a
    directory without it is incomplete or was not written here. Call it on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    dist.barrier()  # every rank's files are written before rank 0 describes them
    # A manifest rank 0 cannot write (a full disk) ends every rank with its error, not a wait.
    on_every_rank(
        "save_sharded_checkpoint: the manifest",
        lambda: _write_manifest(Path(checkpoint_dir)) if dist.get_rank() == 0 else None,
    )


def load_sharded_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str, *, trusted: bool = False
) -> None:
    """Load what :func:`save_sharded_checkpoint` wrote into an already sharded model and optimizer.
    Call it on every rank.

    Security: torch.distributed.checkpoint unpickles the checkpoint's ``.metadata`` and loads its
    non-tensor items with ``torch.load(weights_only=False)``, and unpickling can run code; a
    manifest whose sizes and hash match proves only that the folder is self-consistent, not where
    it came from. So without ``trusted=True`` nothing from the folder is unpickled as is: the
    manifest must be there and match, ``.metadata`` is read by an unpickler that builds only DCP's
    metadata types, the data files it names must be inside the folder, and every item is loaded
    weights-only. ``trusted=True`` loads the folder as DCP does, also one written some other way:
    only for checkpoints you made yourself.

    Raises:
        ValueError: no manifest (an incomplete or foreign checkpoint), files that differ from it, or
            (``UntrustedCheckpointError``) metadata or items that are not plain data - the message
            says how to trust a folder you made. Raised on every rank when any rank finds it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(checkpoint_dir)
    # Every rank reads the folder before DCP's collectives: one that fails stops them all.
    reader, planner = on_every_rank(
        "load_sharded_checkpoint: checking the folder", lambda: (None, None) if trusted else _vetted_reader(directory)
    )
    model_state, optim_state = get_state_dict(model, optimizer)
    state: STATE_DICT_TYPE = {"model": model_state, "optim": optim_state}  # DCP loads into it in place
    dcp.load(state, checkpoint_id=checkpoint_dir, storage_reader=reader, planner=planner)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def check_checkpoint_folder(checkpoint_dir: str | Path) -> None:
    """Check, without unpickling anything as is, that a torch.distributed.checkpoint folder holds
    only plain data: its ``.metadata`` only DCP's metadata types, its data files inside the folder,
    its non-tensor items loadable with ``torch.load(weights_only=True)``. A folder that passes can
    then be loaded by another reader (e.g. Accelerate's ``load_state`` under FSDP) without running
    code from it.

    Raises:
        UntrustedCheckpointError: (a ``ValueError``) what is not plain data, and how to trust the folder.
    """

    vet_checkpoint(checkpoint_dir)


def _vetted_reader(directory: Path) -> tuple[FileSystemReader, DefaultLoadPlanner]:
    """A DCP reader that hands out the metadata already read safely, and a planner that loads
    non-tensor items weights-only (DefaultLoadPlanner's own ``load_bytes`` does not)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    _check_manifest(directory)
    metadata = vet_checkpoint(directory)  # refuses here, clearly, what the planner below would refuse inside DCP

    class VettedReader(FileSystemReader):
        def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
            # Never the file again (nor DCP's fallback, a rank-local __N.metadata): the object read safely.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            cast(StorageMeta, metadata.storage_meta).load_id = self.load_id  # set just above when missing
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            super().load_bytes(read_item, weights_only_load(value))

    return VettedReader(str(directory)), WeightsOnlyPlanner()


def _write_manifest(directory: Path) -> None:
    import json

    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {
        "format": "hf_memstack sharded checkpoint 1",
        "files": files,
        "metadata_sha256": _sha256(directory / ".metadata") if (directory / ".metadata").is_file() else None,
    }
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def _check_manifest(directory: Path) -> None:
    path = directory / MANIFEST
    fix = (
        "a directory written by hf_memstack.distributed.save_sharded_checkpoint has it; a checkpoint written some other way "
        "loads with trusted=True - only for a checkpoint you made (torch.distributed.checkpoint unpickles its files)"
    )
    if not os.path.lexists(path):  # anything else there (a FIFO, a directory) is named by read_json below
        raise ValueError(
            f"checkpoint {str(directory)!r} has no {MANIFEST} (incomplete, or not written by hf_memstack); {fix}"
        )
    try:
        manifest = read_json(path)  # bounded, non-blocking; nesting too deep is a ValueError, not RecursionError
        files = dict(manifest["files"])
        odd = [name for name, size in files.items() if not plain_file_name(name) or not isinstance(size, int)]
        if odd:
            raise ValueError(f"it lists {odd[:3]}, which are not (file name in the folder, size) entries")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(directory)!r}: {MANIFEST} is unreadable ({e}); {fix}") from None
    problems = [f"{name} is a symlink (a save writes files)" for name in files if (directory / name).is_symlink()]
    problems += [
        f"{name} is missing"
        if not (directory / name).is_file()
        else f"{name} has {(directory / name).stat().st_size} bytes, the manifest says {size}"
        for name, size in files.items()
        if not (directory / name).is_file() or (directory / name).stat().st_size != size
    ]
    if not problems and manifest.get("metadata_sha256") != _sha256(directory / ".metadata"):
        problems.append(".metadata differs from the one the manifest describes")
    if problems:
        raise ValueError(f"checkpoint {str(directory)!r} does not match its manifest ({'; '.join(problems)}); {fix}")


def _sha256(path: Path) -> str | None:
    import hashlib

    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()
