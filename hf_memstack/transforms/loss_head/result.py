"""What :func:`~hf_memstack.transforms.loss_head.apply.apply_loss_head` did: the record ``prepare_model`` keeps
and ``describe`` prints, apart from the code that computes the loss (``record.py`` imports only this)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["HeadPath", "LossHeadResult"]

HeadPath = Literal["fused", "checkpointed"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossHeadResult:
    """What :func:`apply_loss_head` did."""

    mode: Literal["default", "chunked"]
    """``chunked``: the model's forward computes the training loss chunk by chunk; ``default``: untouched."""
    path: HeadPath | None = None
    """``fused`` (a plain linear head: gradients computed in the forward, nothing recomputed) or
    ``checkpointed`` (any other head: each chunk recomputed in the backward)."""
    chunk_tokens: int = 0
    """Tokens per chunk."""
    softcap: float | None = None
    """Final-logit soft-capping reproduced from the config (Gemma-style), or None."""
    logit_multiplier: float = 1.0
    """Factor on the logits reproduced from the model (Cohere's ``logit_scale``, 1/Granite's ``logits_scaling``)."""
    router_aux_loss: bool = False
    """A mixture-of-experts model whose forward adds its routers' load-balancing loss (with
    ``output_router_logits``): the chunked loss adds it too, with the model's own function."""
    compiled: bool = False
    """Each chunk's softmax, loss and logit gradient run compiled (``loss:chunked:compiled``)."""

    def describe(self) -> str:
        if self.mode == "default":
            return "the model's own"
        extras = (
            (f", softcap {self.softcap:g}" if self.softcap else "")
            + (f", logits x{self.logit_multiplier:g}" if self.logit_multiplier != 1.0 else "")
            + (", + the router load-balancing loss when output_router_logits" if self.router_aux_loss else "")
        )
        return f"chunked, {self.chunk_tokens} tokens per chunk, {self.path} path{', compiled chunks' if self.compiled else ''}{extras}"
