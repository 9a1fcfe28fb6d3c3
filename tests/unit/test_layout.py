"""The package's layout stays as its folders say: each multi-file feature is one folder whose
``__init__`` lists its modules and its touch points outside the folder, and re-exports its names lazily.

Read from the source (AST), not from what the package says of itself: a new module outside a folder
that imports from it, a touch point that no longer holds the name it names, a module the docstring
forgets, or a lazy name that points nowhere, each fails here.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from hf_memstack._lazy import MOVED

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_memstack"
FEATURE_FOLDERS = [
    "transforms/checkpointing",
    "transforms/loss_head",
    "transforms/optim",
    "transforms/precision",
    "transforms/quant",
    "transforms/sequence_parallel",
    "planning/estimate",
    "planning/model",
    "planning/plan",
]
LAZY_PACKAGES = ["planning", "distributed", "measure", *FEATURE_FOLDERS]
# The MemoryPolicy field each transform folder implements: a module outside the folder that reads it
# (``policy.quant.mode``, ``rung.optimizer.state``) is a touch point even when it imports nothing from it.
FEATURE_FIELDS = {
    "transforms/checkpointing": "checkpointing",
    "transforms/loss_head": "loss",
    "transforms/optim": "optimizer",
    "transforms/precision": "master_weights",
    "transforms/quant": "quant",
    "transforms/sequence_parallel": "sequence_parallel",
}
_SUBFIELDS = "mode|state|step|compiled|chunk_tokens|upcast|targets|block_size|selective_matmuls|every_n|use_reentrant|block_classes|size"
_TOUCH = re.compile(r"^- ``(?P<path>[^`]+)``: (?P<what>.+)$", re.M)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names, relative imports resolved."""
    here = _module_name(path)
    package = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _docstring(folder: str) -> str:
    doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8")))
    assert doc, f"hf_memstack/{folder}/__init__.py has no docstring"
    return doc


def _touch_points(folder: str) -> dict[str, str]:
    doc = _docstring(folder)
    assert "Touch points outside this folder" in doc, f"hf_memstack/{folder}/__init__.py lists no touch points"
    return {m["path"]: m["what"] for m in _TOUCH.finditer(doc)}


@pytest.mark.parametrize("folder", FEATURE_FOLDERS)
def test_every_module_that_imports_the_folder_is_a_listed_touch_point(folder: str) -> None:
    prefix = "hf_memstack." + folder.replace("/", ".")
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]
    importers = {
        str(path.relative_to(ROOT))
        for path in sources
        if not path.is_relative_to(PACKAGE / folder)
        and any(m == prefix or m.startswith(prefix + ".") for m in _imported_modules(path))
    }
    assert importers, f"nothing imports hf_memstack/{folder}: is it still a feature?"
    missing = importers - set(_touch_points(folder))
    assert not missing, f"hf_memstack/{folder}/__init__.py: add these touch points to its docstring: {sorted(missing)}"


@pytest.mark.parametrize("folder", sorted(FEATURE_FIELDS))
def test_every_module_that_reads_the_folders_policy_field_is_a_listed_touch_point(folder: str) -> None:
    field = FEATURE_FIELDS[folder]
    # policy.quant / rung.quant.mode, but not a torch optimizer's .state.values() or .step(), nor the
    # module path hf_memstack.transforms.quant.targets
    reads = re.compile(rf"\bpolicy\.{field}\b|(?<!transforms)\.{field}\.(?:{_SUBFIELDS})\b(?![.\[(])")
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]
    readers = {
        str(path.relative_to(ROOT))
        for path in sources
        if not path.is_relative_to(PACKAGE / folder)
        and not path.is_relative_to(PACKAGE / "policy")  # the policy itself: its config, tokens and checks
        and reads.search(path.read_text(encoding="utf-8"))
    }
    assert readers, f"nothing reads policy.{field}: is FEATURE_FIELDS right?"
    missing = readers - set(_touch_points(folder))
    assert not missing, (
        f"hf_memstack/{folder}/__init__.py: these read policy.{field}; add them to its touch points: {sorted(missing)}"
    )


@pytest.mark.parametrize("folder", FEATURE_FOLDERS)
def test_each_touch_point_holds_the_names_it_names(folder: str) -> None:
    for path, what in _touch_points(folder).items():
        file = ROOT / path
        assert file.is_file(), f"hf_memstack/{folder}: touch point {path} does not exist"
        names = re.findall(r"``([^`]+)``", what)
        assert names, f"hf_memstack/{folder}: touch point {path} names nothing to check (``name``)"
        text = file.read_text(encoding="utf-8")
        for name in names:
            assert name in text, f"hf_memstack/{folder}: {path} no longer holds {name!r}"


@pytest.mark.parametrize("folder", ["transforms", "planning", "cli", *FEATURE_FOLDERS])
def test_the_docstring_lists_exactly_the_folders_modules(folder: str) -> None:
    doc = _docstring(folder)
    listed = set(re.findall(r"^(\w+(?:\.py|/))\s", doc, re.M))
    present = {p.name for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py"}
    present |= {p.name + "/" for p in (PACKAGE / folder).iterdir() if (p / "__init__.py").is_file()}
    assert listed == present, (
        f"hf_memstack/{folder}/__init__.py: listed but absent {sorted(listed - present)}, "
        f"present but not listed {sorted(present - listed)}"
    )


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_exports_match_the_type_checking_imports_and_resolve(package: str) -> None:
    init = PACKAGE / package / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"))
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed.update({alias.name: "." * imp.level + (imp.module or "") for alias in imp.names})
    module = importlib.import_module("hf_memstack." + package.replace("/", "."))
    exports = module._EXPORTS
    assert typed == exports, f"{init}: the TYPE_CHECKING imports and _EXPORTS differ"
    assert sorted(module.__all__) == sorted(exports) == list(module.__all__)
    for name, where in exports.items():
        defining = importlib.import_module(where, module.__name__)
        assert getattr(module, name) is getattr(defining, name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    for folder in [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, f"{folder.relative_to(ROOT)} holds {len(modules)} modules: split it by feature"


def test_the_recipes_support_package_never_imports_the_script() -> None:
    # recipes/finetune.py imports finetune_support; one import back (even for annotations) is the circle
    # finetune.py <-> checkpoint.py that Job in finetune_support/job.py broke.
    support = ROOT / "recipes" / "finetune_support"
    back = {
        str(path.relative_to(ROOT)): sorted(m for m in _imported_modules(path) if m.split(".")[0] == "finetune")
        for path in sorted(support.rglob("*.py"))
    }
    assert len(back) > 1, f"{support} holds no modules"
    assert not {path: names for path, names in back.items() if names}, "finetune_support imports the script"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_its_new_home_with_a_warning(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    home = importlib.import_module(MOVED[old])
    assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} is a module again: drop its alias"
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {MOVED[old]}")) as caught:
        module = importlib.import_module(old)
    assert module is home
    # the warning points at the importing line, not at importlib's or hf_memstack's frames
    assert {Path(w.filename).name for w in caught} <= {"test_layout.py", "__init__.py"}


def test_a_from_import_of_an_old_path_gives_the_same_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW

    monkeypatch.delitem(sys.modules, "hf_memstack.transforms.bf16_adamw", raising=False)
    with pytest.warns(DeprecationWarning, match="hf_memstack.transforms.optim.bf16_adamw") as caught:
        from hf_memstack.transforms.bf16_adamw import BF16AdamW as old  # the README's path before the move
    assert old is BF16AdamW
    assert caught[0].filename == __file__


def test_names_that_never_were_modules_still_fail_to_import() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hf_memstack.transforms.not_a_module")


def test_importing_an_old_path_leaves_the_new_modules_spec_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    home = importlib.import_module("hf_memstack.planning.estimate.trainable")
    monkeypatch.delitem(sys.modules, "hf_memstack.planning.trainable", raising=False)
    with pytest.warns(DeprecationWarning):
        importlib.import_module("hf_memstack.planning.trainable")
    # the import system sets __spec__ on what the finder returns: a wrong one makes the module's relative
    # imports resolve against the old path (ImportWarning: __package__ != __spec__.parent)
    assert home.__spec__ is not None and home.__spec__.name == "hf_memstack.planning.estimate.trainable"


def test_a_mock_patch_through_an_old_path_warns_at_the_patch_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from unittest import mock

    from hf_memstack.planning.plan import rungs

    monkeypatch.delitem(sys.modules, "hf_memstack.planning.rungs", raising=False)
    with pytest.warns(DeprecationWarning, match="hf_memstack.planning.plan.rungs") as caught:
        with mock.patch("hf_memstack.planning.rungs.memory_rungs") as patched:
            assert rungs.memory_rungs is patched  # the same module: the patch reaches the new path's callers
    assert caught[0].filename == __file__


def test_the_old_estimate_modules_names_import_from_the_package() -> None:
    # planning/estimate.py's __all__ before the layout step
    from hf_memstack.planning.estimate import (  # noqa: F401
        DEFAULT_LORA,
        build_model,
        check_seq_len,
        chunked_loss_problem,
        estimate_memory,
        infer_task,
        load_config,
        peft_config_from,
        task_note,
    )
