"""The memory-aware batch-size finder and its parts.

finder.py      find_batch_size: predicted from a few measured steps, verified by a real one, agreed, cached
preflight.py   the checks before any step (arguments, budget, model, one sample), the too-small errors
result.py      BatchSizeResult (with Probe and Fit), built from the search
probe.py       one measured step (the live bytes after each operator), and what counts as out of memory
fit.py         each operator's bytes as a line in the batch size
search.py      which sizes to run next, from the lines and the probes so far
snapshot.py    the training state put back after the probes
cache.py       results on disk, keyed by what changes the answer
ranks.py       every rank agrees on the arguments, the errors and the answer
executable.py  find_executable_batch_size: Accelerate's decorator, with the finder's first guess
"""

from __future__ import annotations

from .executable import find_executable_batch_size
from .finder import find_batch_size
from .result import BatchSizeResult, Fit, Probe

__all__ = ["BatchSizeResult", "Fit", "Probe", "find_batch_size", "find_executable_batch_size"]
