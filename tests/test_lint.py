"""The linter, the formatter and the type checker are part of the test command: `ruff check` with the rules in
pyproject.toml, `ruff format --check` (120 columns), and `mypy` with pyproject.toml's [tool.mypy] (hf_memstack/, the
default non-strict checks), so that a change that is not formatted or not well typed fails here as it would in
review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    # ruff is in the dev extra, which the README's test command installs: a missing ruff is a broken install, and
    # failing says so (a skip would hide that nothing was checked).
    return subprocess.run([sys.executable, "-m", "ruff", *args], capture_output=True, text=True, cwd=ROOT)


@pytest.mark.parametrize(
    "args", [("check", "--no-cache", "."), ("format", "--check", "--no-cache", ".")], ids=["check", "format"]
)
def test_ruff_passes(args):
    done = _ruff(*args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_mypy_passes(tmp_path):
    # mypy is in the dev extra too: missing, it fails like ruff. A fresh cache directory measures what a fresh clone
    # pays (about a minute on 2 cores: it reads torch's and transformers' stubs), not a cache another run left.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy_cache")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
