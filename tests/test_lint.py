"""The linter and the formatter are part of the test command: `ruff check` with the rules in pyproject.toml, and
`ruff format --check` (120 columns), so that a change that is not formatted fails here as it would in review."""

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
