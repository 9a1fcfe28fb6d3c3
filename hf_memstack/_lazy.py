"""Lazy re-exports for a feature folder's ``__init__`` (PEP 562), as the top-level package does.

A feature folder re-exports the names of its modules, but importing one of its modules must not run
the others: ``precision/master_reconcile.py`` imports ``optim/bf16_adamw.py`` while
``optim/optimizer.py`` imports ``precision/master_reconcile.py``, so eager ``__init__`` imports would
make import circles out of what are plain module-to-module edges. Each name loads its module on first
use instead; the ``__init__`` lists the same names under ``TYPE_CHECKING`` for type checkers, and
``tests/unit/test_layout.py`` keeps the two lists equal.

Module paths that moved in the layout step (issue 42) stay importable: ``transforms/chunked_loss.py``
became ``transforms/loss_head/chunked.py``, ``planning/planner.py`` became ``planning/plan/planner.py``,
and so on. Code that imports an old path gets the new module itself (the same objects, so ``isinstance``
and monkeypatching keep working) and one ``DeprecationWarning`` naming the new path, attributed to the
line that imported it. Old paths where a package now stands (``hf_memstack.transforms.quant``, ...) need no
alias: the package re-exports the old module's names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import FrameType, ModuleType


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, where ``exports`` maps each name to its module
    (relative to the package, e.g. ``".apply"``)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


# old module -> its home since the layout step
MOVED = {
    "hf_memstack.cli_estimate": "hf_memstack.cli.estimate",
    "hf_memstack.cli_output": "hf_memstack.cli.output",
    "hf_memstack.planning.build_cache": "hf_memstack.planning.estimate.build_cache",
    "hf_memstack.planning.config_file": "hf_memstack.planning.model.config_file",
    "hf_memstack.planning.depth": "hf_memstack.planning.estimate.depth",
    "hf_memstack.planning.estimate_accounting": "hf_memstack.planning.estimate.accounting",
    "hf_memstack.planning.estimate_checks": "hf_memstack.planning.estimate.checks",
    "hf_memstack.planning.estimate_trace": "hf_memstack.planning.estimate.trace",
    "hf_memstack.planning.eval_logits": "hf_memstack.planning.estimate.eval_logits",
    "hf_memstack.planning.fake_experts": "hf_memstack.planning.model.fake_experts",
    "hf_memstack.planning.fake_model": "hf_memstack.planning.model.fake",
    "hf_memstack.planning.fsdp_shards": "hf_memstack.planning.estimate.fsdp_shards",
    "hf_memstack.planning.memory_estimate": "hf_memstack.planning.estimate.result",
    "hf_memstack.planning.model_config": "hf_memstack.planning.model.config",
    "hf_memstack.planning.next_rung": "hf_memstack.planning.plan.next_rung",
    "hf_memstack.planning.plan_advice": "hf_memstack.planning.plan.advice",
    "hf_memstack.planning.plan_estimates": "hf_memstack.planning.plan.estimates",
    "hf_memstack.planning.plan_screen": "hf_memstack.planning.plan.screen",
    "hf_memstack.planning.plan_walk": "hf_memstack.planning.plan.walk",
    "hf_memstack.planning.planner": "hf_memstack.planning.plan.planner",
    "hf_memstack.planning.rungs": "hf_memstack.planning.plan.rungs",
    "hf_memstack.planning.states_floor": "hf_memstack.planning.plan.states_floor",
    "hf_memstack.planning.synthetic_batch": "hf_memstack.planning.model.synthetic_batch",
    "hf_memstack.planning.trainable": "hf_memstack.planning.estimate.trainable",
    "hf_memstack.planning.vision_families": "hf_memstack.planning.model.vision_families",
    "hf_memstack.planning.vision_inputs": "hf_memstack.planning.model.vision_inputs",
    "hf_memstack.planning.weights_dtype": "hf_memstack.planning.estimate.weights_dtype",
    "hf_memstack.transforms.bf16_adamw": "hf_memstack.transforms.optim.bf16_adamw",
    "hf_memstack.transforms.checkpointing_verify": "hf_memstack.transforms.checkpointing.verify",
    "hf_memstack.transforms.chunked_loss": "hf_memstack.transforms.loss_head.chunked",
    "hf_memstack.transforms.fused_cross_entropy": "hf_memstack.transforms.loss_head.fused_ce",
    "hf_memstack.transforms.loss_forward": "hf_memstack.transforms.loss_head.forward",
    "hf_memstack.transforms.loss_head_verify": "hf_memstack.transforms.loss_head.verify",
    "hf_memstack.transforms.loss_result": "hf_memstack.transforms.loss_head.result",
    "hf_memstack.transforms.master_reconcile": "hf_memstack.transforms.precision.master_reconcile",
    "hf_memstack.transforms.master_weights": "hf_memstack.transforms.precision.master_weights",
    "hf_memstack.transforms.optim_8bit": "hf_memstack.transforms.optim.eight_bit",
    "hf_memstack.transforms.optim_groups": "hf_memstack.transforms.optim.groups",
    "hf_memstack.transforms.optim_in_backward": "hf_memstack.transforms.optim.in_backward",
    "hf_memstack.transforms.optim_verify": "hf_memstack.transforms.optim.verify",
    "hf_memstack.transforms.quant_forward": "hf_memstack.transforms.quant.forward",
    "hf_memstack.transforms.quant_targets": "hf_memstack.transforms.quant.targets",
    "hf_memstack.transforms.quant_verify": "hf_memstack.transforms.quant.verify",
    "hf_memstack.transforms.router_loss": "hf_memstack.transforms.loss_head.router_loss",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for the names in :data:`MOVED`: every other import goes on as before."""

    def __init__(self) -> None:
        self._home_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        home = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {home}: import it from there (the old path will be removed)",
            DeprecationWarning,
            stacklevel=_importing_line(),
        )
        module = importlib.import_module(home)
        self._home_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: ``create_module`` returned the imported home module. The import system has just
        set that module's ``__spec__`` to the old path's: give it back its own, or its relative imports
        would resolve against the old path (and warn ``__package__ != __spec__.parent``)."""
        module.__spec__ = self._home_specs[module.__name__]


# Standard-library modules that import a dotted name for their caller: mock.patch("pkg.mod.name")
# resolves it through pkgutil.resolve_name. The warning belongs to the caller's line.
_RESOLVERS = ("pkgutil.py", "mock.py")


def _importing_line() -> int:
    """The ``stacklevel`` of the first frame outside the import machinery (``importlib``, frozen or not),
    the resolvers above and this module: the user's ``import`` line, the line that called
    ``importlib.import_module``, or the ``mock.patch`` line.

    ``warnings.warn`` itself skips the frozen ``importlib._bootstrap`` frames when it counts, so those are
    not counted here either."""
    level = 1
    frame: FrameType | None = sys._getframe(2)  # the caller of create_module
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:  # skipped by warnings.warn's own count
            frame = frame.f_back
            continue
        level += 1
        if not (name == __file__ or name == importlib.__file__ or name.endswith(_RESOLVERS)):
            return level
        frame = frame.f_back
    return 2


def install_moved_modules() -> None:
    """Put the finder on ``sys.meta_path`` once (``import hf_memstack`` calls this)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
