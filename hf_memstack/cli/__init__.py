"""The ``hf-memstack`` command: ``estimate``, ``plan`` and ``find-batch-size`` from a shell.

main.py      the entry point: the three commands and their exit statuses (heavy imports inside each, so
             ``--help`` stays fast)
parser.py    the argument parser (its docstring is the --help text) and the option value checks
estimate.py  the estimate and plan commands' shared options (device, dtype, images, label fraction) and
             one estimate per policy, with its refusal or verdict (estimate_each, Refused, verdict)
output.py    tables, JSON and the breakdown plot
__main__.py  ``python -m hf_memstack.cli``
"""

from __future__ import annotations

from .main import main

__all__ = ["main"]
