"""Saved weights get the umask's mode, like every other saved file (safetensors 0.8 writes 0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)

    def set_umask(mask: int) -> None:
        os.umask(mask)

    yield set_umask
    os.umask(old)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_save_pretrained_weights_follow_the_umask(load_model, tmp_path, umask, mask, expected):
    from hf_memstack.files import current_umask, weights_follow_umask

    umask(mask)
    assert current_umask() == mask
    mine = tmp_path / "notes.safetensors"  # a file of yours in the directory, chmodded on purpose
    mine.write_bytes(b"x")
    mine.chmod(0o600)
    with weights_follow_umask(tmp_path):
        load_model("llama").save_pretrained(tmp_path)
    assert _mode(tmp_path / "model.safetensors") == _mode(tmp_path / "config.json") == expected
    assert _mode(mine) == 0o600


def _save_full(rank: int, world: int, out: str, config: dict) -> dict[str, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_memstack import save_pretrained_full

    os.umask(0o022)
    torch.manual_seed(0)
    save_pretrained_full(LlamaForCausalLM(LlamaConfig(**config)), out)
    return {p.name: _mode(p) for p in Path(out).iterdir()}


@pytest.mark.distributed
def test_save_pretrained_full_weights_follow_the_umask(tmp_path):
    from dist_utils import run_ranks
    from tiny import configs

    (modes,) = run_ranks(_save_full, str(tmp_path / "full"), configs()["llama"].to_dict(), world=1)
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes
