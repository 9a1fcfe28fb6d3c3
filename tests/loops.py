"""Hand-written training loops measured by PyTorch's own MemTracker (not hf_memstack's subclass of it):
the reference the meter and the estimator are reconciled with, on a steady-state step."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def memtracker_peak(model: nn.Module, batch: dict[str, torch.Tensor], *, keep_outputs: bool, steps: int = 3) -> int:
    """The peak bytes MemTracker reads on the last of ``steps`` steps of the loop a user writes:
    ``outputs = model(**batch); outputs.loss.backward()`` (``keep_outputs``: ``outputs`` lives on
    through the backward, the optimizer step and the next forward, until it is rebound), or
    ``loss = model(**batch).loss; loss.backward()`` (the outputs dropped, as Trainer does). The
    steps before it create AdamW's state; the previous step's outputs, made before the tracker
    existed, are given to it (``track_external``) so that it counts them while they are alive.
    ``batch`` is made before the tracked step, as a data loader makes it: neither MemTracker nor the
    meter nor the estimator counts it then (made inside the step, MemTracker would also count its
    ``input_ids`` and ``labels``: 2 x batch x seq x 8 bytes, the one difference found)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loop: dict[str, Any] = {"outputs": None}

    def step() -> None:
        if keep_outputs:
            loop["outputs"] = model(**batch)
            loop["outputs"].loss.backward()
        else:
            loss = model(**batch).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(steps - 1):
        step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    if loop["outputs"] is not None:
        tracker.track_external(*(t for t in loop["outputs"].values() if torch.is_tensor(t)))
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    return sum(int(v) for dev in peak.values() for k, v in dev.items() if str(k) == "Total")
