"""The planner and the ladder's memory rungs: ``plan_policy`` walks the rungs, cheapest first, and
returns the first policy whose estimate fits the budget, with every rung it considered.

planner.py       plan_policy: the arguments, the walk, the answer
walk.py          the walk down the ladder: each rung estimated, or bounded by a stronger one
screen.py        reading a ``ckpt:N`` rung between two traced ones without tracing it
estimates.py     each policy and batch size traced once; a rung's largest batch
states_floor.py  a lower bound of the model states' bytes, to skip rungs that cannot fit
rungs.py         the memory rungs (and the speeds measured for them)
head_speed.py    the chunked loss rung's speed at a label fraction (the head over the labelled positions),
                 and adding it to a plan that fits without it when it is faster
sequence_rungs.py  when sequence parallelism (sp:N) is offered, and its degrees
next_rung.py     the next rung the batch-size finder names when a policy does not fit
result.py        Plan and PlanRow: the answer, its table and its dict
advice.py        notes on the chosen policy; what would fit when nothing does

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here is listed, and each ``name`` below is in the file named):

- ``hf_memstack/__init__.py``: ``plan_policy`` and ``Plan`` in the public API
- ``hf_memstack/planning/__init__.py``: ``plan_policy``
- ``hf_memstack/cli/main.py``: ``plan_policy`` behind ``_plan`` (the `hf-memstack plan` command)
- ``hf_memstack/batch_size/preflight.py``: ``next_rung``: what the finder says when nothing fits
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .planner import plan_policy
    from .result import Plan, PlanRow
    from .rungs import Rung, memory_rungs

# public name -> the module of this folder that defines it
_EXPORTS = {
    "plan_policy": ".planner",
    "Plan": ".result",
    "PlanRow": ".result",
    "Rung": ".rungs",
    "memory_rungs": ".rungs",
}

__all__ = [
    "Plan",
    "PlanRow",
    "Rung",
    "memory_rungs",
    "plan_policy",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
