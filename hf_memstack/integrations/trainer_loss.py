"""The first-step pass under trainers that compute the loss themselves (TRL's DPO, KTO and reward
trainers): what the callback runs ``verify`` and the memory meter on, or why it runs nothing.

A DPO, KTO or reward batch holds no ``labels``: the model returns no loss of its own, the trainer's
``compute_loss`` builds it (log-probabilities of chosen and rejected completions against a
reference, or rewards of chosen against rejected). The pass runs that ``compute_loss`` on the
batch after the trainer's own ``_prepare_inputs``, as ``Trainer.training_step`` does, through
:class:`TrainerLoss`, a wrapper the checks see through. A trainer whose ``_prepare_inputs`` is
its own (GRPO and the other online trainers generate completions there, and keep them for the
next steps) cannot be run an extra time without changing the run: the pass is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import Trainer

from ..record import MemstackRecord, record_of

__all__ = ["TrainerLoss", "loss_target", "tell_reference_model"]

logger = logging.getLogger("hf_memstack")


class TrainerLoss(nn.Module):
    """``trainer.compute_loss(model, inputs)`` as a module: ``TrainerLoss(trainer, model)(**inputs)``
    returns ``{"loss": ...}``, the loss the training step will compute on ``inputs``. It holds the
    model as ``.module``, like DDP, so ``verify`` and the meter find the prepared model (and its
    record) through it; the trainer's logged metrics are left as they were. ``computes_loss_itself``
    tells verify's loss-head check that the model's own loss head is not what trains (it skips it)."""

    computes_loss_itself: ClassVar[bool] = True

    def __init__(self, trainer: Trainer, model: nn.Module) -> None:
        super().__init__()
        self.module = model
        self.trainer = trainer

    def forward(self, **inputs: Any) -> dict[str, torch.Tensor | tuple[torch.Tensor, Any]]:
        trainer = self.trainer
        offload = getattr(trainer, "maybe_activation_offload_context", None)  # TRL's training_step enters it
        with (
            _kept_bookkeeping(trainer),
            trainer.compute_loss_context_manager(),
            offload if isinstance(offload, contextlib.AbstractContextManager) else contextlib.nullcontext(),
        ):
            # A copy: some trainers add keys to the batch they are given (RewardTrainer's use_cache).
            return {"loss": trainer.compute_loss(self.module, dict(inputs))}


def loss_target(trainer: Trainer | None, model: nn.Module, batch: object) -> tuple[nn.Module, object] | str:
    """What the first-step pass runs: ``(module, batch)`` - the model itself on the collated batch
    when the batch carries the model's own loss (its ``labels``), else :class:`TrainerLoss` on the
    trainer's prepared inputs - or why it runs nothing (a sentence)."""
    cls = type(trainer).__name__
    if trainer is not None and _overrides(trainer, "_prepare_inputs"):
        return (
            f"{cls} prepares each batch in its own _prepare_inputs (GRPO-style trainers generate completions there and "
            "keep them for the next steps), which an extra pass would change"
        )
    if (
        isinstance(batch, Mapping)
        and "labels" not in batch
        and trainer is not None
        and _overrides(trainer, "compute_loss")
    ):
        return TrainerLoss(trainer, model), trainer._prepare_inputs(dict(batch))
    if isinstance(batch, Mapping) or _tensors(batch):
        return model, batch
    inside = f" of {type(batch[0]).__name__}" if isinstance(batch, (list, tuple)) and batch else ""
    return (
        f"the collated batch is a {type(batch).__name__}{inside}, not tensors the model takes, and "
        f"{cls if trainer is not None else 'the trainer'} computes no loss from it that the callback can run"
    )


def tell_reference_model(trainer: Trainer | None, record: MemstackRecord) -> None:
    """Log that a trainer's reference model (DPO, KTO, GRPO with ``beta``) runs outside the policy:
    prepare_model saw only the trained model."""
    ref = getattr(trainer, "ref_model", None)
    if not isinstance(ref, nn.Module) or record_of(ref) is not None:
        return
    inner = getattr(ref, "module", ref)  # Accelerate may wrap it (DDP)
    dtype = next((p.dtype for p in inner.parameters()), None)
    logger.info(
        "hf_memstack: %s's reference model (%s, %s) runs outside the policy %r: prepare_model prepared only the "
        "trained model, so the reference's forwards (without gradients) get neither the policy's autocast nor its "
        "checkpointing or quantization, and estimate_memory/plan do not count its weights; prepare it too "
        "(prepare_model(ref_model, ...)) or train LoRA adapters (the reference is then the model without them)",
        type(trainer).__name__,
        type(inner).__name__,
        dtype,
        record.policy.to_string(),
    )


def _overrides(trainer: Trainer, name: str) -> bool:
    return getattr(type(trainer), name, None) is not getattr(Trainer, name)


def _tensors(batch: object) -> bool:
    if torch.is_tensor(batch):
        return True
    return isinstance(batch, (tuple, list)) and all(torch.is_tensor(v) for v in batch)


@contextlib.contextmanager
def _kept_bookkeeping(trainer: Trainer) -> Iterator[None]:
    """Put back the trainer's plain-data attributes ``compute_loss`` updates as it goes (TRL's
    ``_metrics`` lists, ``_total_train_tokens``): the extra pass must not show in the logs."""
    saved = {k: copy.deepcopy(v) for k, v in vars(trainer).items() if _plain(v)}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)


def _plain(value: object, depth: int = 0) -> bool:
    """Numbers, strings and containers of them (a few levels deep): bookkeeping, cheap to copy."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth >= 3 or not isinstance(value, (dict, list, tuple)) or len(value) > 10_000:
        return False
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    return all(isinstance(k, (str, int)) and _plain(v, depth + 1) for k, v in items)
