"""``TrainingArguments`` filled from the policy: precision, checkpointing and compile left to the
policy, the per-device batch size from the batch-size finder under a budget, the accumulation that
keeps a global batch size, and packed rows that keep the columns their collator needs.

Written here once so that a script does not restate (and contradict) what the prepared model
already does; :func:`~hf_memstack.integrations.trainer_checks.check_training_arguments` checks
the result.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sized
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers import TrainingArguments

from .. import batch_size as finder  # looked up at call time: a patched finder (tests spy on it) is the one used
from .._device import device_of
from ..data import LabelFraction, PackedCollator, measure_label_fraction
from ..record import MemstackRecord, record_of
from ..transforms.optim.bf16_adamw import BF16AdamW
from ._columns import MapDataset, _longest_first, _signature_columns, _trainer_columns
from .trainer_checks import _CHECKPOINTING_FIELD, _record, check_training_arguments

__all__ = ["training_arguments"]

if TYPE_CHECKING:
    from ..batch_size import BatchSizeResult

logger = logging.getLogger("hf_memstack")


def training_arguments(
    model: nn.Module,
    *,
    output_dir: str,
    train_dataset: object = None,
    data_collator: Callable[..., object] | None = None,
    budget: int | str | None = None,
    global_batch_size: int | None = None,
    **kwargs: Any,
) -> TrainingArguments:
    """``TrainingArguments`` consistent with the prepared ``model``'s policy.

    Precision flags follow the policy (``bf16=True`` / ``fp16=True``: Trainer's autocast around the
    model's own is the same dtype twice, covers code that bypasses ``model.forward`` such as TRL's
    fused LM head, and on a GPU gives fp16 Trainer's loss scaler; on the CPU Accelerate creates no
    scaler, so an fp16 policy is refused there), checkpointing and compile are left to the policy
    (``gradient_checkpointing=False``, ``torch_compile=False``). The per-device batch size comes
    from ``per_device_train_batch_size`` when given, else from :func:`hf_memstack.find_batch_size`
    under ``budget`` (measured steps on the longest sample of ``train_dataset``, padded by
    ``data_collator``); ``gradient_accumulation_steps`` keeps ``global_batch_size`` (rounded up,
    as the finder does). Any other ``TrainingArguments`` field passes through ``kwargs``.

    Raises:
        ValueError: the model is not prepared; ``kwargs`` contradict the policy; an fp16 policy on
            the CPU; a budget without a dataset to measure; a bad ``global_batch_size``, or one
            that an explicit ``gradient_accumulation_steps`` contradicts (they must agree exactly).
    """
    record = _record(model)
    sp = _sequence_group_size(record, budget, kwargs)
    # The deprecated name is what most scripts still pass: it means the same field.
    for old, new in (
        ("gradient_checkpointing", _CHECKPOINTING_FIELD),
        ("gradient_checkpointing_kwargs", f"{_CHECKPOINTING_FIELD}_kwargs"),
    ):
        if old != new and old in kwargs:
            kwargs.setdefault(new, kwargs.pop(old))
    precision = (
        {}
        if {"bf16", "fp16"} & set(kwargs)
        else {"bf16": record.precision.name == "bf16", "fp16": record.precision.name == "fp16"}
    )
    # optim:in_backward steps inside the backward: no global-norm clipping there (Trainer's default is 1.0).
    no_clip = {"max_grad_norm": 0.0} if record.policy.optimizer.step == "in_backward" else {}
    fields = {**precision, "torch_compile": False, _CHECKPOINTING_FIELD: False, **no_clip, **kwargs}
    _keep_packed_rows(train_dataset, data_collator, fields, "position_ids" in _signature_columns(model))
    # Without a GPU, Trainer accepts bf16 only when told it trains on the CPU.
    fields.setdefault("use_cpu", not torch.cuda.is_available())
    if global_batch_size is not None and (
        not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0
    ):
        raise ValueError(
            f"global_batch_size={global_batch_size!r} must be a positive integer (samples per optimizer step)"
        )
    world = max(1, _world_size() // sp)  # under sp:N a group of N processes reads one batch
    accumulation = kwargs.get("gradient_accumulation_steps")
    if global_batch_size is not None and accumulation is not None and global_batch_size % (accumulation * world):
        # Refused before the finder measures anything: no per-device size can make them agree.
        _refuse_accumulation(global_batch_size, accumulation, None, world)
    if "per_device_train_batch_size" not in fields and budget is not None:
        result = _find_batch_size(
            model,
            train_dataset,
            data_collator,
            budget,
            global_batch_size,
            remove_unused_columns=fields.get("remove_unused_columns", True),
        )
        fields["per_device_train_batch_size"] = result.batch_size
        fields.setdefault("per_device_eval_batch_size", result.batch_size)
        keep = _signature_columns(model) if fields.get("remove_unused_columns", True) else None
        _report_batch_size(result, _label_fraction(train_dataset, data_collator, keep))
    per_device = fields.get("per_device_train_batch_size", 8)
    if global_batch_size is not None and accumulation is None:
        fields["gradient_accumulation_steps"] = max(1, math.ceil(global_batch_size / (per_device * world)))
    elif (
        global_batch_size is not None
        and accumulation is not None
        and per_device * world * accumulation != global_batch_size
    ):
        _refuse_accumulation(global_batch_size, accumulation, per_device, world)
    args = TrainingArguments(output_dir=output_dir, **fields)
    for note in check_training_arguments(model, args):
        warnings.warn(note, stacklevel=2)
    return args


def _sequence_group_size(record: MemstackRecord, budget: object, kwargs: Mapping[str, Any]) -> int:
    """N of ``sp:N`` (a group of N processes reads one batch); the batch-size finder refused under it,
    before it measures anything: it measures whole rows on one process, not a group's slices."""
    sp = int(record.policy.sequence_parallel.size)
    if sp > 1 and budget is not None and "per_device_train_batch_size" not in kwargs:
        raise ValueError(
            f"training_arguments(budget={budget!r}) with sp:{sp}: the batch-size finder measures whole rows on one "
            f"process, not a sequence group's slices; pass per_device_train_batch_size=N (rows per group of {sp} ranks)"
        )
    return sp


def _keep_packed_rows(
    dataset: object, collator: object, fields: dict[str, Any], model_takes_position_ids: bool
) -> None:
    """Packed rows (``pack_dataset``'s ``seq_lengths`` column) reach a collator that reads them.

    Trainer removes the columns the model's forward does not take before collating, and
    ``seq_lengths`` is one of them: without it (and without the rows' ``position_ids``, which
    ``pack_dataset`` also writes and Trainer keeps for a forward that takes them) every row is
    collated as one sample, the samples in it attend to each other, and the loss still falls
    (silently wrong, transformers#46634's symptom). So a packed dataset keeps its columns
    (``remove_unused_columns=False``; the collator builds the batch from ``input_ids``,
    ``labels`` and ``seq_lengths`` alone), ``remove_unused_columns=True`` is refused for rows whose
    boundaries would not survive it, and a collator that ignores ``seq_lengths`` is refused.
    """
    columns = _columns_of(dataset) if dataset is not None else set()
    if "seq_lengths" not in columns:
        return
    if not _reads_seq_lengths(collator):
        raise ValueError(
            f"train_dataset holds packed rows (a 'seq_lengths' column, from hf_memstack.data.pack_dataset) but "
            f"data_collator={type(collator).__name__ if collator is not None else None} collates each row as one "
            "sample: the samples in a row would attend to each other; pass "
            "data_collator=hf_memstack.data.PackedCollator(pad_token_id=tokenizer.pad_token_id)"
        )
    # TRL's trainers keep seq_lengths among their signature columns; Trainer does not.
    kept = "position_ids" in columns and model_takes_position_ids
    if fields.setdefault("remove_unused_columns", False) and isinstance(collator, PackedCollator) and not kept:
        raise ValueError(
            "remove_unused_columns=True: Trainer would drop the packed rows' 'seq_lengths' column (the model's "
            "forward does not take it) before the collator sees it, and each row would train as one sample "
            "whose parts attend to each other; leave remove_unused_columns unset (False for packed rows)"
        )


def _columns_of(dataset: object) -> set[str]:
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return set(names)
    if isinstance(dataset, Sized) and hasattr(dataset, "__getitem__") and len(dataset) and isinstance(dataset[0], dict):
        return set(dataset[0])
    return set()


def _reads_seq_lengths(collator: object) -> bool:
    """The collators that split a packed row at its ``seq_lengths``: the library's, and TRL's
    padding-free one (``DataCollatorForLanguageModeling(padding_free=True)``)."""
    return isinstance(collator, PackedCollator) or (
        type(collator).__module__.startswith("trl.") and getattr(collator, "padding_free", False)
    )


def _refuse_accumulation(global_batch_size: int, accumulation: int, per_device: int | None, world: int) -> None:
    """A ``global_batch_size`` that an explicit ``gradient_accumulation_steps`` contradicts: the
    run would silently step on another number of samples than the one asked for."""
    per_step = (
        f"per_device_train_batch_size={per_device} x {world} process(es) x gradient_accumulation_steps={accumulation} "
        f"= {per_device * world * accumulation} samples per optimizer step"
        if per_device is not None
        else f"gradient_accumulation_steps={accumulation} x {world} process(es) does not divide it"
    )
    raise ValueError(
        f"global_batch_size={global_batch_size} contradicts gradient_accumulation_steps={accumulation}: {per_step}; "
        "pass one of them: global_batch_size (the accumulation is derived from the per-device batch size) "
        "or gradient_accumulation_steps"
    )


def _label_fraction(dataset: object, collator: object, keep: set[str] | None) -> LabelFraction | None:
    """The share of the training positions that carry a label, over a bounded sample of the rows
    through the collator, with the columns Trainer keeps: the rows ``loss:chunked`` runs its head
    over. Said beside the batch size, never in its way: data it cannot measure makes no claim."""
    try:
        return measure_label_fraction(
            dataset, cast("Callable[[list[Any]], Mapping[str, object]]", collator), columns=keep
        )
    except (ValueError, TypeError, KeyError) as e:
        logger.info("hf_memstack: the label fraction was not measured (%s)", e)
        return None


def _report_batch_size(result: BatchSizeResult, labels: LabelFraction | None = None) -> None:
    """Say once, on the main process, what the finder chose: the batch size is the answer the
    caller asked for, and a logger at INFO level is silent unless logging was configured. With
    the data's label fraction: a prompt-masked set's chunked head runs over that share only
    (the finder measured it on its longest rows, with their own labels)."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    said = result.summary() + (f"\n  {labels.summary()}" if labels is not None else "")
    logger.info("hf_memstack: %s", said)
    if rank == 0:
        print(
            f"hf_memstack training_arguments: per_device_train_batch_size={result.batch_size} from the batch-size finder: "
            f"{said}",
            flush=True,
        )


def _world_size() -> int:
    """Processes in the run: the process group's size, or the launcher's WORLD_SIZE before Trainer
    creates the group (torchrun and accelerate launch set it)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _find_batch_size(
    model: nn.Module,
    dataset: object,
    collator: Callable[..., object] | None,
    budget: int | str,
    global_batch_size: int | None,
    *,
    remove_unused_columns: bool = True,
) -> BatchSizeResult:
    """The finder on the batches Trainer's loader will build: the longest samples of ``dataset``,
    with the columns Trainer removes removed (``remove_unused_columns``), through ``collator``,
    so each probe has the padding and the length of the widest training batch."""

    if dataset is None or collator is None or not isinstance(dataset, Sized) or len(dataset) == 0:
        raise ValueError(
            "budget= needs train_dataset (a non-empty, indexable dataset) and data_collator to measure steps "
            "with; pass both, or per_device_train_batch_size instead of budget"
        )
    samples = cast(MapDataset, dataset)  # Sized, checked above; indexable, as Trainer's own loader needs
    order = _longest_first(samples)
    keep = _signature_columns(model) if remove_unused_columns else None
    device = device_of(model)

    def make_batch(n: int) -> dict[str, object]:
        rows = [_trainer_columns(samples[order[i % len(order)]], keep) for i in range(n)]
        batch = cast("Mapping[str, object]", collator(rows))  # a collator returns a dict of tensors
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    optimizer = _probe_optimizer(model)
    # Under a launcher, before Trainer creates the process group, the finder sees one process:
    # cap the per-device batch by the launcher's count instead.
    cap = max(1, global_batch_size // _world_size()) if global_batch_size else 65536
    cap = min(cap, len(dataset))  # a batch larger than the dataset is never built
    return finder.find_batch_size(
        model, make_batch, optimizer, budget=budget, global_batch_size=global_batch_size, max_batch_size=cap
    )


def _probe_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the probes step: the one that will train, as far as it can be built without
    touching the model. Under weights:bf16 that is BF16AdamW (what make_optimizer builds and the
    callback requires): its step differs from AdamW's, and AdamW over pure-bf16 weights would print
    the library's own "without stochastic rounding" warning at a user who did everything right."""
    params = [p for p in model.parameters() if p.requires_grad]
    record = record_of(model)
    pure = record is not None and record.policy.master_weights == "bf16"
    if pure and params and all(p.dtype == torch.bfloat16 for p in params):
        return BF16AdamW(params, lr=1e-5)
    return torch.optim.AdamW(params, lr=1e-5)
