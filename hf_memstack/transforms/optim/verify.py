"""optim_verify: what verify needs from the optimizer - an optimizer stepping in the backward, paused.

verify runs a real backward but must not update the weights; an optimizer that steps inside the
backward (``optim:in_backward``) would, so it is paused for the observed step.
"""

from __future__ import annotations

import contextlib

from torch import nn

from .in_backward import optimizer_in_backward_of

__all__ = ["optimizer_paused"]


def optimizer_paused(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """A context in which ``model``'s optimizer stepping in the backward (if any) does not step."""
    stepping = optimizer_in_backward_of(model)
    return stepping.paused() if stepping is not None else contextlib.nullcontext()
