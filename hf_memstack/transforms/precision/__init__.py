"""Precision: mixed precision (``bf16``, ``fp16``: autocast around the model's forward) and the dtype the
trained weights are kept in (``weights:bf16``, pure bf16; fp32 master weights otherwise).

apply.py             resolve_precision for a device, the hardware checks, apply_precision and its guard
                     (AutocastBypassGuard, restore_autocast), verify_precision (verify's row), and
                     ACCELERATE_NAMES (the Accelerator's mixed_precision values)
master_weights.py    check_master_weights / apply_master_weights: the trainable parameters' dtype
master_reconcile.py  master weights that follow what trains, whichever comes first: prepare or PEFT

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here or reads the policy field this folder implements is listed, and each
``name`` below is in the file named):

- ``hf_memstack/policy/tokens.py``: the ``Token("weights:bf16"`` row and the precision words
- ``hf_memstack/prepare.py``: ``resolve_precision``, ``apply_precision`` and ``apply_master_weights`` in prepare_model's order
- ``hf_memstack/record.py``: ``ResolvedPrecision`` and ``MasterWeightsResult`` on the record
- ``hf_memstack/measure/verify.py``: ``verify_precision``, verify's row
- ``hf_memstack/integrations/trainer.py``: ``AutocastBypassGuard`` and ``reconcile_master_weights`` under the Trainer
- ``hf_memstack/distributed/accelerate.py``: ``resolve_precision`` for Accelerate's FSDP plugin
- ``hf_memstack/transforms/fsdp.py``: ``ResolvedPrecision``: FSDP2's mixed-precision policy
- ``hf_memstack/transforms/optim/optimizer.py``: ``reconcile_master_weights`` before the optimizer is built
- ``hf_memstack/planning/estimate/weights_dtype.py``: ``planned_dtypes`` in the estimate's weight bytes
- ``hf_memstack/planning/plan/planner.py``: ``resolve_precision`` for the planned device
- ``hf_memstack/planning/plan/rungs.py``: the ``Step("pure_bf16"`` rung
- ``recipes/finetune.py``: ``resolve_precision``
- ``recipes/finetune_support/accelerator.py``: ``ACCELERATE_NAMES``: the Accelerator's mixed_precision
- ``recipes/finetune_support/job.py``: ``ResolvedPrecision``: the Job's precision (an annotation)
- ``recipes/finetune_support/model.py``: ``ResolvedPrecision``: choose_route's precision (an annotation)
- ``hf_memstack/integrations/trainer_args.py``: reads ``policy.master_weights``
- ``hf_memstack/integrations/trainer_checks.py``: reads ``policy.master_weights``
- ``hf_memstack/planning/estimate/accounting.py``: reads ``policy.master_weights``
- ``hf_memstack/planning/plan/advice.py``: reads ``policy.master_weights``
- ``hf_memstack/planning/plan/states_floor.py``: reads ``policy.master_weights``
- ``recipes/trainer.py``: reads ``policy.master_weights``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .apply import (
        ACCELERATE_NAMES,
        AutocastBypassGuard,
        ResolvedPrecision,
        apply_precision,
        check_accelerator_precision,
        cpu_has_native_bf16,
        precision_policy_problems,
        resolve_precision,
        restore_autocast,
        trl_replaces_chunked_loss,
        verify_precision,
    )
    from .master_reconcile import MasterWeightsLedger, reconcile_master_weights
    from .master_weights import MasterWeightsPlan, MasterWeightsResult, apply_master_weights, check_master_weights

# public name -> the module of this folder that defines it
_EXPORTS = {
    "ACCELERATE_NAMES": ".apply",
    "AutocastBypassGuard": ".apply",
    "ResolvedPrecision": ".apply",
    "apply_precision": ".apply",
    "check_accelerator_precision": ".apply",
    "cpu_has_native_bf16": ".apply",
    "precision_policy_problems": ".apply",
    "resolve_precision": ".apply",
    "restore_autocast": ".apply",
    "trl_replaces_chunked_loss": ".apply",
    "verify_precision": ".apply",
    "MasterWeightsPlan": ".master_weights",
    "MasterWeightsResult": ".master_weights",
    "apply_master_weights": ".master_weights",
    "check_master_weights": ".master_weights",
    "MasterWeightsLedger": ".master_reconcile",
    "reconcile_master_weights": ".master_reconcile",
}

__all__ = [
    "ACCELERATE_NAMES",
    "AutocastBypassGuard",
    "MasterWeightsLedger",
    "MasterWeightsPlan",
    "MasterWeightsResult",
    "ResolvedPrecision",
    "apply_master_weights",
    "apply_precision",
    "check_accelerator_precision",
    "check_master_weights",
    "cpu_has_native_bf16",
    "precision_policy_problems",
    "reconcile_master_weights",
    "resolve_precision",
    "restore_autocast",
    "trl_replaces_chunked_loss",
    "verify_precision",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
