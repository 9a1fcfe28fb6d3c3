"""Lazy re-exports for a feature folder's ``__init__`` (PEP 562), as the top-level package does.

A feature folder re-exports the names of its modules, but importing one of its modules must not run
the others: ``precision/master_reconcile.py`` imports ``optim/bf16_adamw.py`` while
``optim/optimizer.py`` imports ``precision/master_reconcile.py``, so eager ``__init__`` imports would
make import circles out of what are plain module-to-module edges. Each name loads its module on first
use instead; the ``__init__`` lists the same names under ``TYPE_CHECKING`` for type checkers, and
``tests/unit/test_layout.py`` keeps the two lists equal.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


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
