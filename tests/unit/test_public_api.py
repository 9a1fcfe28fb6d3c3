"""The top level of hf_memstack is three sorted tiers (core, results, helpers), each name resolves to the
object its module defines, and a name that moved to its feature's submodule still imports from the top
level - the same object - warning once with the import line to use instead.

Read from the package's own tables (``_CORE``, ``_RESULTS``, ``_HELPERS``, ``_MOVED``) and from its source
(the TYPE_CHECKING blocks type checkers read), so a name added to one list and not the others fails here."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_memstack

ROOT = Path(__file__).resolve().parents[2]
INIT = ROOT / "hf_memstack" / "__init__.py"
TIERS = {"core": hf_memstack._CORE, "results": hf_memstack._RESULTS, "helpers": hf_memstack._HELPERS}


def test_all_is_the_three_tiers_each_sorted() -> None:
    core, results, helpers = (sorted(t) for t in TIERS.values())
    assert hf_memstack.__all__ == [*core, *results, *sorted([*helpers, "__version__"])]
    assert len(set(hf_memstack.__all__)) == len(hf_memstack.__all__)
    # The calls the README and the issue name as the way in are core, the Trainer helpers among them.
    for name in (
        "prepare_model",
        "describe",
        "verify",
        "measure_step",
        "find_batch_size",
        "estimate_memory",
        "plan_policy",
        "MemoryPolicy",
        "LADDER",
        "PolicyError",
        "BudgetTooSmallError",
        "MemstackCallback",
        "training_arguments",
    ):
        assert name in hf_memstack._CORE, name


def test_each_tier_has_its_commented_type_checking_block() -> None:
    blocks = [
        node
        for node in ast.parse(INIT.read_text(encoding="utf-8")).body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    assert len(blocks) == len(TIERS)
    lines = INIT.read_text(encoding="utf-8").splitlines()
    for (tier, names), block in zip(TIERS.items(), blocks):
        assert tier in lines[block.lineno - 1], f"the TYPE_CHECKING block at line {block.lineno} should say ({tier})"
        typed = {a.name: "." * imp.level + (imp.module or "") for imp in block.body for a in imp.names}
        assert typed == names, f"{tier}: the TYPE_CHECKING imports and the table differ"


@pytest.mark.parametrize("name", sorted(hf_memstack._LAZY))
def test_each_public_name_is_its_modules_object(name: str) -> None:
    defining = importlib.import_module(hf_memstack._LAZY[name], "hf_memstack")
    assert getattr(hf_memstack, name) is getattr(defining, name)
    assert name in dir(hf_memstack)


def test_moved_names_are_gone_from_all_and_dir_but_not_from_the_tiers_modules() -> None:
    moved = set(hf_memstack._MOVED)
    assert not moved & set(hf_memstack.__all__)
    assert not moved & set(hf_memstack._LAZY)
    assert not moved & set(dir(hf_memstack))


@pytest.mark.parametrize("name", sorted(hf_memstack._MOVED))
def test_a_moved_name_warns_once_with_its_new_import_line(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_memstack, "_warned", set())  # this process may have read it already
    home = hf_memstack._MOVED[name]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = getattr(hf_memstack, name)
        again = getattr(hf_memstack, name)
    assert [w.category for w in seen] == [DeprecationWarning]  # once, not on the second read
    assert f"from {home} import {name}" in str(seen[0].message)
    assert seen[0].filename == __file__  # the user's line, not ours
    assert first is again is getattr(importlib.import_module(home), name)
    assert name in importlib.import_module(home).__all__  # the new home says it is public
    assert name not in dir(hf_memstack)


def test_from_import_of_a_moved_name_points_at_the_importing_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_memstack, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from hf_memstack import chunked_lm_loss  # noqa: F401 - the import is what is checked
    assert len(seen) == 1 and seen[0].filename == __file__
    assert "from hf_memstack.transforms.loss_head import chunked_lm_loss" in str(seen[0].message)


def test_the_new_homes_import_quietly_and_the_trainer_helpers_load_transformers_on_access() -> None:
    code = (
        "import sys\nimport hf_memstack, hf_memstack.distributed, hf_memstack.measure, hf_memstack.policy\n"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'loaded too early'\n"
        "dir(hf_memstack)\nassert 'transformers' not in sys.modules\n"
        "hf_memstack.MemstackCallback\nassert 'transformers' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
