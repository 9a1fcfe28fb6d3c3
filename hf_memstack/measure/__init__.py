"""Observing a real step: the step itself, the byte accounting, the memory meter, the simulated device limit and
``verify`` (did the policy take effect).

The step and the byte accounting are re-exported here, each loaded on first use
(``from hf_memstack.measure import train_step``); ``measure_step``, ``verify`` and ``simulated_memory_limit``
are the package's own (``from hf_memstack import measure_step``). ``verify`` is not re-exported here: the
module ``measure/verify.py`` has that name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .accounting import ModelStateBytes, model_state_bytes
    from .step import forward_loss, train_step

# public name -> the module that defines it
_EXPORTS = {
    "ModelStateBytes": ".accounting",
    "model_state_bytes": ".accounting",
    "forward_loss": ".step",
    "train_step": ".step",
}

__all__ = ["ModelStateBytes", "forward_loss", "model_state_bytes", "train_step"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
