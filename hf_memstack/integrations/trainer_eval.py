"""Will ``Trainer.evaluate()`` fit? The logits it keeps across the evaluation set, against a budget.

``evaluate()`` with ``compute_metrics`` keeps every eval batch's outputs (the logits: samples x
seq_len x vocab for a causal LM) on the device until the loop ends, unless ``eval_accumulation_steps``
moves them to host memory every N batches (transformers#12878): a run that trains for hours can die at
its first evaluation. :func:`check_eval_logits` measures what one sample keeps - one forward of the
longest eval sample under ``torch.no_grad()``, through the Trainer's own collator and
``preprocess_logits_for_metrics`` - and multiplies it by what the device will hold.

The budget: the one given (``MemstackCallback(eval_budget="20GiB")``), else on CUDA the device's
total memory; on the CPU without one nothing is checked (what a host can spare is not known). It
holds the model's own parameters and buffers too, so they count against it with the kept logits
(as ``hf-memstack estimate --mode eval --budget`` counts the forward's peak, model included, plus
the kept logits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sized
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from .._device import device_of, module_mode, preserved_rng
from ..planning.estimate.eval_logits import KeptOutputs, kept_outputs
from ..sizes import format_bytes, parse_bytes
from ._columns import MapDataset, _longest_first, _signature_columns, _trainer_columns

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["check_eval_logits"]

logger = logging.getLogger("hf_memstack")

_FIXES = (
    "set prediction_loss_only=True (metrics from the loss alone), eval_accumulation_steps=N (every N batches the "
    "logits move to host memory, as numpy), or preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1) "
    "(one id a token kept instead of the vocabulary's scores)"
)


def check_eval_logits(trainer: Trainer, budget: int | str | None = None) -> str | None:
    """Why ``trainer.evaluate()`` may run out of memory keeping its logits, or None.

    Nothing is kept (None) with ``prediction_loss_only=True``, without ``compute_metrics``, with
    ``batch_eval_metrics``, or without an indexable eval dataset. Otherwise one forward of the longest
    eval sample (the concatenated logits are padded to it) tells the bytes a sample keeps, after
    ``preprocess_logits_for_metrics``; the device holds them for every sample, or for
    ``eval_accumulation_steps`` batches. The result names those bytes, the budget and the fixes.

    Args:
        trainer: a ``transformers.Trainer`` (or a TRL trainer) whose model is on its device.
        budget: bytes or a size (``"20GiB"``); None: the CUDA device's total memory (on the CPU: no check).

    Raises:
        ValueError, TypeError: a bad ``budget`` (named ``eval_budget``).
    """
    limit = parse_bytes(budget, field="eval_budget") if budget is not None else None
    args = trainer.args
    if args.prediction_loss_only or trainer.compute_metrics is None or getattr(args, "batch_eval_metrics", False):
        return None
    datasets = trainer.eval_dataset if isinstance(trainer.eval_dataset, Mapping) else {"": trainer.eval_dataset}
    device = device_of(_model(trainer))
    if limit is None:
        if device.type != "cuda":
            logger.info(
                "hf_memstack: the logits Trainer.evaluate keeps are not checked on the CPU without a budget; "
                "pass MemstackCallback(eval_budget=...)"
            )
            return None
        limit = torch.cuda.get_device_properties(device).total_memory
    for name, dataset in datasets.items():
        problem = _dataset_problem(trainer, dataset, name, limit)
        if problem is not None:
            return problem
    return None


def _dataset_problem(trainer: Trainer, dataset: object, name: str, limit: int) -> str | None:
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__") or len(dataset) == 0:
        return None
    one = _one_sample(trainer, cast(MapDataset, dataset))  # Sized and indexable, checked above
    args, samples = trainer.args, len(dataset)
    held = (
        samples
        if args.eval_accumulation_steps is None
        else min(samples, args.eval_accumulation_steps * args.eval_batch_size)
    )
    kept, model = held * one.device_bytes, _model_bytes(_model(trainer))
    if kept + model <= limit:
        return None
    where = f"eval_dataset[{name!r}]" if name else "eval_dataset"
    accumulated = (
        ""
        if args.eval_accumulation_steps is None
        else f" ({args.eval_accumulation_steps} accumulation steps of {args.eval_batch_size})"
    )
    return (
        f"Trainer.evaluate() will keep {format_bytes(kept)} of model outputs on {device_of(_model(trainer))} for {held} of the "
        f"{samples} samples of {where}{accumulated} ({format_bytes(one.device_bytes)} a sample, {', '.join(one.dtypes)}); with the "
        f"model's {format_bytes(model)} of parameters and buffers that is {format_bytes(kept + model)}, more than the budget of "
        f"{format_bytes(limit)}; {_FIXES} (in host memory they take "
        f"{format_bytes(samples * one.host_bytes)} as numpy)"
    )


def _model(trainer: Trainer) -> nn.Module:
    # Trainer types its model as optional (model_init builds it later); evaluate() needs one, and has it by now.
    return cast(nn.Module, trainer.model)


def _model_bytes(model: nn.Module) -> int:
    """The bytes the model's parameters and buffers hold (each tensor once: tied weights are one)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _one_sample(trainer: Trainer, dataset: MapDataset) -> KeptOutputs:
    """What Trainer keeps of the longest sample: its forward under no_grad in eval mode, then
    ``preprocess_logits_for_metrics`` as ``evaluation_loop`` applies it."""

    model = _model(trainer)
    keep = _signature_columns(model) if trainer.args.remove_unused_columns else None
    device = device_of(model)
    with preserved_rng(device):  # a collator may draw random numbers (masking)
        # Trainer types a collator's rows as dicts; they are what the dataset holds, as evaluate() hands them on.
        collate = cast("Callable[[list[object]], Mapping[str, object]]", trainer.data_collator)
        batch = collate([_trainer_columns(dataset[_longest_first(dataset)[0]], keep)])
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    ignore = list(getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", ["cache"]))
    with preserved_rng(device), module_mode(model, training=False), torch.no_grad():
        outputs = model(**batch)
        if trainer.preprocess_logits_for_metrics is None:
            return kept_outputs(outputs, ignore)
        kept = (
            [v for k, v in outputs.items() if k not in {*ignore, "loss"}]
            if isinstance(outputs, Mapping)
            else list(outputs)
        )
        logits = kept[0] if len(kept) == 1 else tuple(kept)  # what prediction_step hands on
        # Typed as taking tensors; prediction_step hands it a tuple of logits and labels=None too, as here.
        preprocess = cast("Callable[[object, object], object]", trainer.preprocess_logits_for_metrics)
        return kept_outputs(preprocess(logits, batch.get("labels")), ignore)
