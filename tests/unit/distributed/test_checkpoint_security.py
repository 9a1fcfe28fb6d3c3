"""A checkpoint folder someone else made runs no code and reads nothing outside itself when
loaded without trusted=True, even with a manifest that matches every file: its .metadata is read
by an unpickler that builds only DCP's metadata types, its non-tensor items weights-only. Was:
load_sharded_checkpoint checked the manifest (sizes, the metadata's SHA-256) and then unpickled
.metadata with plain pickle, so a forged folder with a correct manifest ran code.

The folders are written as save_sharded_checkpoint writes them (torch.distributed.checkpoint's
save, then the manifest), in one process without a process group (DCP allows it); the forger
writes a correct manifest with the same function."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

# DCP saves and loads in one process here (no process group), and says so each time.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")

MARKER = "hf_memstack_pwned"


class _RunsCommand:
    """Unpickling it runs a shell command (the classic pickle payload)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Execs:
    """Unpickling it runs Python code through builtins.exec."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').write('x')",)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    ).train()


def _step(model, opt):
    ids = torch.arange(3, 19).reshape(2, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _save(model, opt, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hf_memstack.distributed.checkpoint import _write_manifest

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))
    _write_manifest(directory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a model and optimizer after one step, and the weights it holds."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    folder = tmp_path_factory.mktemp("saved") / "real"
    _save(model, opt, folder)
    return folder, [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def trained(saved, tmp_path):
    """A fresh model and optimizer (other weights than the checkpoint's), the checkpoint copied to
    tmp_path/real, and the weights it holds."""
    folder, weights = saved
    shutil.copytree(folder, tmp_path / "real", symlinks=True)
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), weights


def _metadata(directory: Path):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # our own folder: the test trusts it


def _forge(tmp_path: Path, name: str, *, metadata: object | None = None, raw: bytes | None = None) -> Path:
    """A copy of the real folder with another .metadata, and a correct manifest for it."""
    from hf_memstack.distributed.checkpoint import _write_manifest

    forged = tmp_path / name
    shutil.copytree(tmp_path / "real", forged)
    (forged / ".metadata").write_bytes(raw if raw is not None else pickle.dumps(metadata))
    _write_manifest(forged)
    return forged


def _refused(model, opt, folder: Path, *fragments: str) -> str:
    """load_sharded_checkpoint refuses ``folder`` (a ValueError saying why and how to trust it) and loads nothing."""
    from hf_memstack.distributed.checkpoint import load_sharded_checkpoint

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        load_sharded_checkpoint(model, opt, str(folder))
    message = str(e.value)
    for fragment in (*fragments, "trusted=True"):
        assert fragment in message, message
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing was loaded
    return message


def test_a_real_checkpoint_loads_without_trusting_it(trained, tmp_path):
    from hf_memstack.distributed.checkpoint import load_sharded_checkpoint

    model, opt, saved = trained
    assert not all(torch.equal(a, p) for a, p in zip(saved, model.parameters()))
    load_sharded_checkpoint(model, opt, str(tmp_path / "real"))
    assert all(torch.equal(a, p) for a, p in zip(saved, model.parameters()))
    assert opt.param_groups[0]["lr"] == 1e-2  # a non-tensor item (the saved one), loaded weights-only
    assert len(opt.state) == len(saved) and all(int(s["step"]) == 1 for s in opt.state.values())


@pytest.mark.parametrize("payload", [_RunsCommand, _Execs], ids=["os.system", "builtins.exec"])
def test_a_forged_metadata_with_a_correct_manifest_runs_no_code(trained, tmp_path, payload):
    model, opt, _ = trained
    marker = tmp_path / MARKER
    forged = _forge(tmp_path, "forged", metadata=payload(marker))
    name = "posix.system" if payload is _RunsCommand else "builtins.exec"
    _refused(model, opt, forged, f"names the global {name}", "could run code")
    assert not marker.exists()


def test_a_forged_non_tensor_item_runs_no_code(trained, tmp_path):
    # Valid metadata whose optimizer learning rate points to a pickle that runs code:
    # torch.distributed.checkpoint's DefaultLoadPlanner loads such items with weights_only=False.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from hf_memstack.distributed.checkpoint import _write_manifest

    model, opt, _ = trained
    marker = tmp_path / MARKER
    buffer = io.BytesIO()
    torch.save(_RunsCommand(marker), buffer)  # as DCP stores a non-tensor item
    payload = buffer.getvalue()
    metadata = _metadata(tmp_path / "real")
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo(relative_path="lr.distcp", offset=0, length=len(payload))
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "real", forged)
    (forged / "lr.distcp").write_bytes(payload)
    (forged / ".metadata").write_bytes(pickle.dumps(metadata))
    _write_manifest(forged)
    _refused(model, opt, forged, "'optim.param_groups.0.lr'", "is not plain data", "GLOBAL posix.system")
    assert not marker.exists()


def test_data_files_outside_the_folder_are_not_read(trained, tmp_path):
    model, opt, _ = trained
    metadata = _metadata(tmp_path / "real")
    shutil.copy(tmp_path / "real" / "__0_0.distcp", tmp_path / "outside.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    forged = _forge(tmp_path, "forged", metadata=metadata)
    _refused(model, opt, forged, "'../outside.distcp'", "a path outside it")


def test_a_symlinked_metadata_is_refused(trained, tmp_path):
    # The manifest describes the file the link points to (its size and hash), as a forger's would.
    from hf_memstack.distributed.checkpoint import _write_manifest

    model, opt, _ = trained
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "real", forged)
    (forged / ".metadata").rename(tmp_path / "elsewhere.metadata")
    (forged / ".metadata").symlink_to(tmp_path / "elsewhere.metadata")
    _write_manifest(forged)
    _refused(model, opt, forged, ".metadata is a symlink")
    from hf_memstack.distributed.checkpoint import UntrustedCheckpointError, check_checkpoint_folder

    with pytest.raises(UntrustedCheckpointError, match="missing or a symlink"):
        check_checkpoint_folder(forged)


def test_a_pickle_cannot_set_attributes_on_a_class(trained, tmp_path):
    # Only allowed globals, but BUILD on the class itself: plain pickle would setattr(Metadata, "hijacked", 1).
    from torch.distributed.checkpoint.metadata import Metadata

    model, opt, _ = trained
    raw = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x08\x00\x00\x00hijackedK\x01s\x86b."
    forged = _forge(tmp_path, "forged", raw=raw)
    _refused(model, opt, forged, "sets the state of type")
    assert not hasattr(Metadata, "hijacked")


def test_check_checkpoint_folder_passes_a_real_folder_and_refuses_a_forged_one(trained, tmp_path):
    from hf_memstack.distributed.checkpoint import UntrustedCheckpointError, check_checkpoint_folder

    check_checkpoint_folder(tmp_path / "real")
    marker = tmp_path / MARKER
    with pytest.raises(UntrustedCheckpointError, match="names the global posix.system"):
        check_checkpoint_folder(_forge(tmp_path, "forged", metadata=_RunsCommand(marker)))
    assert not marker.exists()


def test_trusted_still_loads_a_folder_without_a_manifest(trained, tmp_path):
    from hf_memstack.distributed.checkpoint import load_sharded_checkpoint

    model, opt, saved = trained
    (tmp_path / "real" / "hf_memstack_checkpoint.json").unlink()
    with pytest.raises(ValueError, match="no hf_memstack_checkpoint.json.*trusted=True"):
        load_sharded_checkpoint(model, opt, str(tmp_path / "real"))
    load_sharded_checkpoint(model, opt, str(tmp_path / "real"), trusted=True)
    assert all(torch.equal(a, p) for a, p in zip(saved, model.parameters()))


@pytest.mark.parametrize("kind", ["nested 100,000 deep", "FIFO", "directory"])
def test_a_manifest_that_cannot_be_read_is_a_clear_refusal(trained, tmp_path, kind):
    """Was: RecursionError out of json.loads (no handler catches it), or "has no manifest" for a FIFO
    or a directory standing in its place. Now one ValueError naming the file and what it is; a FIFO
    is never waited on."""
    model, opt, _ = trained
    manifest = tmp_path / "real" / "hf_memstack_checkpoint.json"
    manifest.unlink()
    if kind == "FIFO":
        os.mkfifo(manifest)
    elif kind == "directory":
        manifest.mkdir()
    else:
        manifest.write_text("[" * 100_000)
    what = {"FIFO": "is a FIFO (named pipe)", "directory": "is a directory"}.get(kind, "nested too deeply")
    _refused(model, opt, tmp_path / "real", "hf_memstack_checkpoint.json is unreadable", what)
