"""The loss head (``loss:chunked``, ``loss:chunked:compiled``): a causal LM's loss computed a chunk of
labelled tokens at a time, so the full ``[tokens, vocab]`` logits never exist.

apply.py        check_loss_head / apply_loss_head: which models it fits, and installing the forward
forward.py      ChunkedLossForward: the backbone, then the chunked loss over the hidden states
chunked.py      chunked_lm_loss: the chunked cross-entropy over the labelled rows
fused_ce.py     the fused path for a plain ``nn.Linear`` head (logits, softmax and gradient per chunk)
router_loss.py  a mixture-of-experts model's router loss, added as its own forward adds it
result.py       LossHeadResult: what apply_loss_head did, on the record
verify.py       verify's ``loss`` row: the chunked head computes the model's own loss

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here or reads the policy field this folder implements is listed, and each
``name`` below is in the file named):

- ``hf_memstack/policy/tokens.py``: the ``Token("loss:chunked"`` rows of the token table
- ``hf_memstack/policy/config.py``: ``LossConfig``, the policy's fields
- ``hf_memstack/prepare.py``: ``check_loss_head`` and ``apply_loss_head`` in prepare_model's order
- ``hf_memstack/record.py``: ``LossHeadResult`` on the record
- ``hf_memstack/measure/verify.py``: ``verify_loss_head``, verify's ``loss`` row
- ``hf_memstack/measure/batch_checks.py``: ``supports_chunked_loss``: a batch's labels checked before the step
- ``hf_memstack/planning/estimate/checks.py``: ``check_loss_head`` before tracing an estimate
- ``hf_memstack/planning/estimate/trace.py``: ``labelled_as_traced``: the label fraction on fake tensors
- ``hf_memstack/planning/plan/rungs.py``: the ``Step("chunked_loss"`` rung
- ``hf_memstack/__init__.py``: ``chunked_lm_loss`` and ``LossHeadResult`` in ``_MOVED``: the old top-level import warns, naming this folder
- ``hf_memstack/integrations/trainer.py``: reads ``record.loss.mode``
- ``hf_memstack/planning/estimate/estimator.py``: reads ``policy.loss.mode``
- ``hf_memstack/planning/plan/next_rung.py``: reads ``rung.loss.mode``, ``policy.loss``
- ``hf_memstack/planning/plan/walk.py``: reads ``a.loss.mode``, ``b.loss.mode``
- ``hf_memstack/planning/plan/head_speed.py``: reads ``chosen.loss.mode``: the chunked head added for speed
- ``hf_memstack/transforms/precision/apply.py``: reads ``record.loss.mode``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .apply import apply_loss_head, check_loss_head, supports_chunked_loss
    from .chunked import auto_chunk_tokens, chunked_lm_loss, head_rows
    from .forward import ChunkedLossForward
    from .result import HeadPath, LossHeadResult
    from .router_loss import RouterLoss
    from .verify import verify_loss_head

# public name -> the module of this folder that defines it
_EXPORTS = {
    "apply_loss_head": ".apply",
    "check_loss_head": ".apply",
    "supports_chunked_loss": ".apply",
    "auto_chunk_tokens": ".chunked",
    "chunked_lm_loss": ".chunked",
    "head_rows": ".chunked",
    "ChunkedLossForward": ".forward",
    "HeadPath": ".result",
    "LossHeadResult": ".result",
    "RouterLoss": ".router_loss",
    "verify_loss_head": ".verify",
}

__all__ = [
    "ChunkedLossForward",
    "HeadPath",
    "LossHeadResult",
    "RouterLoss",
    "apply_loss_head",
    "auto_chunk_tokens",
    "check_loss_head",
    "chunked_lm_loss",
    "head_rows",
    "supports_chunked_loss",
    "verify_loss_head",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
