"""4-bit base weights (``quant:nf4``, ``quant:nf4:upcast``; QLoRA): the frozen linear layers of a model's
blocks quantized to NF4 with torchao (or loaded 4-bit by bitsandbytes).

apply.py    check_quant / apply_quant, QuantResult, and reading a 4-bit weight back
targets.py  which layers become 4-bit, and the refusals about them
forward.py  4-bit layers whose class overrides ``nn.Linear.forward`` (Falcon's)
verify.py   verify's quant row: which parameters are 4-bit after a step

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here or reads the policy field this folder implements is listed, and each
``name`` below is in the file named):

- ``hf_memstack/policy/tokens.py``: the ``Token("quant:nf4"`` rows of the token table
- ``hf_memstack/policy/config.py``: ``QuantConfig``, the policy's fields
- ``hf_memstack/prepare.py``: ``check_quant`` and ``apply_quant`` in prepare_model's order
- ``hf_memstack/_model_checks.py``: ``QuantPlan``
- ``hf_memstack/record.py``: ``QuantResult`` on the record
- ``hf_memstack/measure/verify.py``: ``verify_quant``, verify's row
- ``hf_memstack/merge.py``: ``four_bit_weight``: dequantize and merge
- ``hf_memstack/batch_size/preflight.py``: ``quantizable``: the finder's next rung
- ``hf_memstack/planning/estimate/weights_dtype.py``: ``four_bit_weight`` in the estimate's weight bytes
- ``hf_memstack/planning/plan/planner.py``: ``quantizable``: whether the nf4 rung applies
- ``hf_memstack/planning/plan/rungs.py``: the ``Step("nf4"`` rung
- ``hf_memstack/transforms/precision/master_reconcile.py``: ``is_4bit``: 4-bit weights keep their dtype
- ``hf_memstack/__init__.py``: ``QuantResult`` in ``_MOVED``: the old top-level import warns, naming this folder
- ``recipes/finetune_support/checkpoint.py``: ``is_4bit``: what a checkpoint saves
- ``recipes/finetune_support/stops.py``: ``is_4bit``
- ``hf_memstack/planning/plan/advice.py``: reads ``policy.quant.mode``
- ``hf_memstack/planning/plan/next_rung.py``: reads ``policy.quant.mode``, ``rung.quant.mode``
- ``hf_memstack/planning/plan/states_floor.py``: reads ``policy.quant.mode``
- ``hf_memstack/planning/plan/walk.py``: reads ``p.quant.mode``
- ``recipes/finetune.py``: reads ``policy.quant.mode``, ``job.policy.quant.mode``
- ``recipes/finetune_support/checks.py``: reads ``policy.quant.mode``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .apply import (
        Backend,
        QuantPlan,
        QuantResult,
        apply_quant,
        check_quant,
        four_bit_weight,
        is_4bit,
        quantizable,
        unpack_bnb_weight,
    )
    from .verify import verify_quant

# public name -> the module of this folder that defines it
_EXPORTS = {
    "Backend": ".apply",
    "QuantPlan": ".apply",
    "QuantResult": ".apply",
    "apply_quant": ".apply",
    "check_quant": ".apply",
    "four_bit_weight": ".apply",
    "is_4bit": ".apply",
    "quantizable": ".apply",
    "unpack_bnb_weight": ".apply",
    "verify_quant": ".verify",
}

__all__ = [
    "Backend",
    "QuantPlan",
    "QuantResult",
    "apply_quant",
    "check_quant",
    "four_bit_weight",
    "is_4bit",
    "quantizable",
    "unpack_bnb_weight",
    "verify_quant",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
