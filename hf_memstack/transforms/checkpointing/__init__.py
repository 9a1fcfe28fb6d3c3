"""Activation checkpointing (``ckpt``, ``ckpt:N``, ``ckpt:selective``, ``ckpt:selective:alternate``,
``ckpt:offload``): recompute each block's activations in the backward instead of keeping them.

apply.py   check_checkpointing / apply_checkpointing: through the model's own Transformers API, or by
           wrapping each block's forward; the selective policy; the guard against a bypassed wrapper
verify.py  verify's checkpointing row: what runs still checkpoints what was applied (recompute FLOPs)

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here or reads the policy field this folder implements is listed, and each
``name`` below is in the file named):

- ``hf_memstack/policy/tokens.py``: the ``Token("ckpt"`` rows of the token table
- ``hf_memstack/policy/config.py``: ``CheckpointingConfig``, the policy's fields
- ``hf_memstack/prepare.py``: ``check_checkpointing`` and ``apply_checkpointing`` in prepare_model's order
- ``hf_memstack/record.py``: ``CheckpointingResult`` on the record
- ``hf_memstack/measure/verify.py``: ``verify_checkpointing``, verify's row
- ``hf_memstack/measure/observe.py``: ``SelectiveCheckpointingWarning``, kept quiet during a measured step
- ``hf_memstack/integrations/trainer_checks.py``: ``CheckpointingGuard`` under the Trainer
- ``hf_memstack/planning/plan/rungs.py``: the ``Step("selective"``, ``Step("every_4th"``, ``Step("every_3rd"``,
  ``Step("every_2nd"``, ``Step("selective_alternate"``, ``Step("full"`` and ``Step("offload"`` rungs
- ``hf_memstack/_model_checks.py``: reads ``policy.checkpointing``, ``policy.checkpointing.every_n``
- ``hf_memstack/distributed/accelerate.py``: reads ``policy.checkpointing``
- ``hf_memstack/planning/estimate/fsdp_shards.py``: reads ``policy.checkpointing.mode``
- ``hf_memstack/planning/estimate/sequence_shards.py``: reads ``policy.checkpointing`` (the blocks that keep the repeated k/v)
- ``hf_memstack/planning/estimate/trace.py``: reads ``policy.checkpointing``
- ``hf_memstack/planning/plan/next_rung.py``: reads ``policy.checkpointing``
- ``hf_memstack/planning/plan/screen.py``: reads ``p.checkpointing.mode``, ``p.checkpointing.every_n``
- ``hf_memstack/planning/plan/walk.py``: reads ``p.checkpointing.mode``, ``p.checkpointing.selective_matmuls``
- ``hf_memstack/transforms/blocks.py``: reads ``policy.checkpointing``
- ``hf_memstack/transforms/quant/targets.py``: reads ``policy.checkpointing``
- ``hf_memstack/transforms/tiled_mlp.py``: reads ``policy.checkpointing``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .apply import (
        SAVED_OPS,
        CheckpointingGuard,
        CheckpointingMethod,
        CheckpointingResult,
        SelectiveCheckpointingWarning,
        apply_checkpointing,
        check_checkpointing,
        install_checkpointing_guard,
        selective_context_fn,
        uses_transformers_checkpointing,
    )
    from .verify import checkpointing_policy_problems, verify_checkpointing

# public name -> the module of this folder that defines it
_EXPORTS = {
    "CheckpointingGuard": ".apply",
    "CheckpointingMethod": ".apply",
    "CheckpointingResult": ".apply",
    "SAVED_OPS": ".apply",
    "SelectiveCheckpointingWarning": ".apply",
    "apply_checkpointing": ".apply",
    "check_checkpointing": ".apply",
    "install_checkpointing_guard": ".apply",
    "selective_context_fn": ".apply",
    "uses_transformers_checkpointing": ".apply",
    "checkpointing_policy_problems": ".verify",
    "verify_checkpointing": ".verify",
}

__all__ = [
    "CheckpointingGuard",
    "CheckpointingMethod",
    "CheckpointingResult",
    "SAVED_OPS",
    "SelectiveCheckpointingWarning",
    "apply_checkpointing",
    "check_checkpointing",
    "checkpointing_policy_problems",
    "install_checkpointing_guard",
    "selective_context_fn",
    "uses_transformers_checkpointing",
    "verify_checkpointing",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
