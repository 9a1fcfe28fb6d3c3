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

    from hf_memstack.distributed import save_pretrained_full

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


# --- read_regular / read_json: what a received file can be ---------------------------------------------


def test_read_json_reads_a_regular_file_and_a_symlink_to_one(tmp_path):
    from hf_memstack.files import read_json

    (tmp_path / "a.json").write_text('{"x": [1, 2]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")
    assert read_json(tmp_path / "a.json") == {"x": [1, 2]}
    assert read_json(tmp_path / "link.json") == {"x": [1, 2]}


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    from hf_memstack.files import FileContentError, read_json

    fifo = tmp_path / "entry.json"
    os.mkfifo(fifo)
    # Opened blocking, this read would wait for a writer forever; the test would hang, not fail.
    with pytest.raises(FileContentError, match=r"is a FIFO \(named pipe\), not a regular file"):
        read_json(fifo)


def test_a_directory_and_a_device_are_named_for_what_they_are(tmp_path):
    from hf_memstack.files import FileContentError, read_regular

    with pytest.raises(FileContentError, match="is a directory, not a regular file"):
        read_regular(tmp_path)
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    with pytest.raises(FileContentError, match="is a character device"):
        read_regular(tmp_path / "zero.json")


def test_a_file_over_the_bound_is_refused_without_reading_it_all(tmp_path):
    from hf_memstack.files import FileContentError, read_regular

    big = tmp_path / "big.json"
    big.write_bytes(b" " * 5000)
    assert len(read_regular(big, max_bytes=5000)) == 5000
    with pytest.raises(FileContentError, match="larger than 4,999 bytes"):
        read_regular(big, max_bytes=4999)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000])
def test_deeply_nested_json_is_a_value_error_not_a_recursion_error(tmp_path, text):
    from hf_memstack.files import FileContentError, read_json

    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(FileContentError, match="nested too deeply") as info:
        read_json(path)
    assert isinstance(info.value, ValueError)


def test_a_missing_file_is_still_an_os_error(tmp_path):
    from hf_memstack.files import read_json

    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "none.json")


def _alias_bomb(levels: int = 9) -> str:
    """A YAML 'billion laughs': each anchor a list of nine aliases of the one before (417 bytes at 9
    levels, 9**9 strings once expanded)."""
    rows = ["&a0 [" + ", ".join(['"lol"'] * 9) + "]"]
    rows += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "precision: [" + ", ".join(rows) + "]\n"


# Run in a child with its address space capped after the imports: were aliases expanded again, the
# child dies of MemoryError (or the timeout) instead of taking this machine's memory.
_BOMB_CHILD = r"""
import resource, sys
from pathlib import Path
from hf_memstack.errors import PolicyError
from hf_memstack.policy import MemoryPolicy
from recipes.finetune_support.common import RecipeError
from recipes.finetune_support.config import _read_config_file
resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))
for read, error in ((MemoryPolicy.from_yaml, PolicyError), (_read_config_file, RecipeError)):
    try:
        read(sys.argv[1])
    except error as e:
        print("REFUSED", str(e).replace("\n", " "))
    else:
        print("READ")
"""


def test_a_yaml_alias_bomb_is_refused_by_the_policy_and_config_readers(tmp_path):
    import subprocess
    import sys

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", _BOMB_CHILD, str(bomb)], capture_output=True, text=True, timeout=120, env=env, cwd=repo
    )
    refusals = [line for line in done.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(refusals) == 2, done.stdout + done.stderr[-2000:]
    for line in refusals:
        assert str(bomb) in line and "alias (*a0)" in line and "line 1" in line


def test_load_yaml_refuses_aliases_and_repeated_keys_and_reads_the_rest():
    from hf_memstack.files import FileContentError, load_yaml

    assert load_yaml("a: [1, 2]\nb: {c: x}\n", where="f.yaml") == {"a": [1, 2], "b": {"c": "x"}}
    with pytest.raises(FileContentError, match=r"f\.yaml is not valid YAML at line 2.*alias \(\*x\)"):
        load_yaml("a: &x 1\nb: *x\n", where="f.yaml")
    with pytest.raises(FileContentError, match=r"f\.yaml .*duplicate key 'a'"):
        load_yaml("a: 1\na: 2\n", where="f.yaml")
    with pytest.raises(FileContentError, match=r"f\.yaml is nested too deeply"):
        load_yaml("[" * 100_000, where="f.yaml")
