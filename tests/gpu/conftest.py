"""tests/gpu/: the tests that need a CUDA GPU (bench/gpu_check.sh runs them on a lent GPU machine).
Every test in this folder is marked ``gpu`` - ``pytest -m gpu`` selects it, ``-m "not gpu"`` leaves
it out - and is skipped, with the reason, on a machine without CUDA (CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker, and before tests/conftest.py skips the marked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bench/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if HERE in Path(item.path).resolve().parents:  # this hook sees every collected test, not only this folder's
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
