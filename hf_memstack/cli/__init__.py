"""The ``hf-memstack`` command: ``estimate``, ``plan`` and ``find-batch-size`` from a shell.

main.py      the argument parser and the three commands (heavy imports inside each, so ``--help`` stays fast)
estimate.py  the estimate and plan commands' arguments: the model, the job, the policies, the dtype
output.py    tables, JSON and the breakdown plot
__main__.py  ``python -m hf_memstack.cli``
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
