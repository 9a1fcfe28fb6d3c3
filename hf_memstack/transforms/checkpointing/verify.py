"""checkpointing_verify: verify's checkpointing checks - what runs still checkpoints what was applied.

Checkpointing fails silently: Transformers' flags flipped after prepare_model, a model in eval
mode, a selective save list that matched no op. These read the record and what verify's hooks saw.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from ...policy import CheckpointingConfig
from ..blocks import Blocks
from .apply import CheckpointingResult

__all__ = ["checkpointing_policy_problems", "verify_checkpointing"]


class _StepFlops(Protocol):
    """The step's FLOPs as verify's observer counts them (:class:`hf_memstack.measure.observe._Flops`)."""

    backward: int
    recompute: int
    checkpointed_forward: int


def checkpointing_policy_problems(
    blocks: Blocks | None, result: CheckpointingResult, config: CheckpointingConfig
) -> list[str]:
    """verify's ``policy`` part for checkpointing: Transformers' per-block flags still say what was applied."""
    if blocks is None or result.method != "transformers":
        return []
    problems = []
    flags = [i for i, b in enumerate(blocks.modules) if getattr(b, "gradient_checkpointing", False)]
    if flags != list(result.checkpointed):
        problems.append(
            f"Transformers checkpointing is on for blocks {flags}, but the policy checkpointed "
            f"{list(result.checkpointed)} (gradient_checkpointing_enable/disable was called after prepare_model)"
        )
    reentrant = {r for i, b in enumerate(blocks.modules) if i in flags and (r := _reentrant(b)) is not None}
    if reentrant and reentrant != {config.use_reentrant}:
        problems.append(
            f"blocks checkpoint with use_reentrant={sorted(reentrant)} but the policy says "
            f"use_reentrant={config.use_reentrant}"
        )
    return problems


def _reentrant(block: nn.Module) -> bool | None:
    func = getattr(block, "_gradient_checkpointing_func", None)
    keywords = getattr(func, "keywords", None)
    return keywords.get("use_reentrant") if isinstance(keywords, dict) else None


def verify_checkpointing(
    result: CheckpointingResult,
    model: nn.Module,
    *,
    recomputed: list[int],
    saved_bytes: int,
    flops: _StepFlops,
    selective_saved_nothing: bool,
    backward_error: str | None,
) -> tuple[bool, str]:
    """verify's ``checkpointing`` check: the blocks meant to be checkpointed (and no others) re-ran
    their forward in the backward; ``flops`` holds the step's FLOPs (``backward``, ``recompute``,
    ``checkpointed_forward``)."""
    expected = list(result.checkpointed)
    got = recomputed
    if backward_error is not None:
        return not expected, f"not observed: {backward_error}"
    if not expected:
        return not got, "off, and no block recomputed" if not got else f"off, yet blocks {got} recomputed in backward"
    ok = got == expected
    detail = (
        f"blocks {got} recomputed in backward (expected {expected}); {saved_bytes / 2**20:.2f} MiB "
        f"saved for backward outside checkpoints; {_recompute_summary(flops)}"
    )
    if selective_saved_nothing:
        ok = False
        detail += (
            ": selective checkpointing recomputed all of the blocks' matmuls, as full checkpointing does - no op in "
            "its save list (hf_memstack.transforms.checkpointing.apply.SAVED_OPS) ran; use checkpointing mode 'full'"
        )
    if not got and not all(m.training for m in model.modules()):
        # A PEFT wrapper made around a model from from_pretrained is in training mode, its model not.
        detail += (
            ": the model (or a module inside it, e.g. the model a PEFT wrapper holds) is in eval mode, and "
            "checkpointing only runs in training; call model.train()"
        )
    elif not ok:
        detail += ": checkpointing is not doing what the policy says"
    return ok, detail


def _recompute_summary(flops: _StepFlops) -> str:
    grads = max(1, flops.backward - flops.recompute)
    return (
        f"backward recomputed {flops.recompute / 1e9:.3g} GFLOP, {flops.recompute / grads:+.1%} over the gradients' "
        f"{grads / 1e9:.3g} GFLOP (the checkpointed blocks' forward: {flops.checkpointed_forward / 1e9:.3g} GFLOP)"
    )
