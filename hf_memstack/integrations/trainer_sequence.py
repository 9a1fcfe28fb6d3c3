"""``sp:N`` (Ulysses sequence parallelism) under ``transformers.Trainer``: the hooks that make its
run equal the unsharded one, installed on the Trainer by ``add_memstack_callback(trainer)`` (or by
``MemstackCallback`` when the Trainer dispatching its ``on_init_end`` can be found).

Transformers' own sequence parallelism (``ParallelismConfig(sp_size=..., sp_backend="deepspeed")``)
runs only inside a DeepSpeed engine; what it does around the loader, here without one:

* **the rows**: the N ranks of a sequence group read the same batches - the training loader's
  ``BatchSamplerShard`` (Accelerate's) is keyed by the data-parallel rank ``rank // N`` over
  ``world // N``, as Accelerate's ``prepare_data_loader`` does for the ranks of a device mesh that
  differ only in a non-data dimension (and as Transformers itself re-keys its ``BatchRebalanceSampler``);
* **the slice**: the loader's collator returns this rank's :func:`shard_batch` of what it collated
  (targets shifted on the whole rows, global ``position_ids``; a right-padding mask over unlabelled
  pads dropped: :func:`drop_right_padding`);
* **the loss**: nothing of ours (TRL's ``SFTTrainer`` does the same arithmetic through its fused head). Trainer counts ``num_items_in_batch`` over each rank's
  ``shift_labels`` and sums the counts over every rank (``average_tokens_across_devices``), so each
  rank's loss is its tokens' sum over the whole step's count, times the world size; DDP (or FSDP2)
  averages the gradients, which gives the sum over each group's ranks over the whole count - the
  unsharded gradient - and the logged loss (the ranks' mean) is the unsharded loss, with gradient
  accumulation and packed rows alike. What would break that arithmetic is refused
  (:func:`sequence_parallel_problems`, :func:`install_sequence_parallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers import TrainingArguments

from ..record import MemstackRecord, unwrap_model
from ..transforms.sequence_parallel.guard import TRAINER_MARK
from ..transforms.sequence_parallel.reduce import sequence_parallel_size
from ..transforms.sequence_parallel.shard import drop_right_padding, shard_batch

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from transformers import Trainer

__all__ = [
    "GroupShardCollator",
    "install_sequence_parallel",
    "is_installed",
    "refuse_uninstalled",
    "sequence_parallel_problems",
]

_OWN_LOOP = (
    "train with recipes/finetune.py --policy ... under torchrun, or your own loop (shard_batch, backward_loss, "
    "reported_loss)"
)


# The varlen kernels' view of packed rows (DataCollatorWithFlattening(return_flash_attn_kwargs=True), TRL's
# padding-free collator): derived from the position ids, which the Ulysses attention reads on the whole rows.
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


_Collate = Callable[[Sequence[Any]], Mapping[str, Any]]


class GroupShardCollator:
    """The training loader's collator under ``sp:N``: ``inner``'s batch of the group's rows, then this
    rank's :func:`shard_batch` of it. ``whole(features)`` is the group's whole batch (what verify compares)."""

    def __init__(self, inner: _Collate, sp_rank: int, sp_size: int, pad: int):
        self.inner, self.sp_rank, self.sp_size, self.pad_token_id = inner, sp_rank, sp_size, pad

    def whole(self, features: Sequence[Any]) -> dict[str, Any]:
        batch = drop_right_padding(self.inner(features))
        if "position_ids" not in batch:
            return batch  # the boundaries are only in the varlen keys: shard_batch refuses them
        return {k: v for k, v in batch.items() if k not in _VARLEN_KEYS}

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        out = shard_batch(
            self.whole(features), sp_rank=self.sp_rank, sp_size=self.sp_size, pad_token_id=self.pad_token_id
        )
        # Trainer counts the step's targets itself, over every rank (the group's count alone would be
        # the wrong denominator when Trainer's count is not passed).
        out.pop("num_items_in_batch", None)
        return out


def sequence_parallel_problems(record: MemstackRecord, args: TrainingArguments) -> list[str]:
    """The settings of ``args`` an ``sp:N`` Trainer run cannot honour, each with its fix (empty without sp:N)."""
    n = record.policy.sequence_parallel.size
    if n == 1:
        return []
    cls, problems = type(args).__name__, list[str]()
    if not getattr(args, "average_tokens_across_devices", True):
        problems.append(
            f"{cls}.average_tokens_across_devices=False: under sp:{n} each rank holds a slice of its group's rows, and the "
            "loss is each rank's tokens over the step's target count summed over every rank; set it True (the default)"
        )
    strategy = getattr(args, "eval_strategy", "no")
    if getattr(strategy, "value", strategy) != "no" or getattr(args, "load_best_model_at_end", False):
        problems.append(
            f"{cls}.eval_strategy={getattr(strategy, 'value', strategy)!r}: evaluation and prediction are not "
            f"sequence-parallel here (the eval loader gives each process other rows); set eval_strategy='no' and "
            f"evaluate the model prepared without sp:{n}"
        )
    if getattr(args, "label_smoothing_factor", 0.0):
        problems.append(
            f"{cls}.label_smoothing_factor={args.label_smoothing_factor}: Trainer's label smoother shifts the labels, "
            f"and under sp:{n} each rank's labels are its slice, already shifted on the whole rows; set it 0"
        )
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        problems.append(
            f"{cls}.train_sampling_strategy='batch_rebalance' deals rows by the process index, not by the sequence "
            "group; use 'random', 'sequential' or 'group_by_length'"
        )
    config = getattr(args, "accelerator_config", None)
    dispatch = config.get("dispatch_batches") if isinstance(config, dict) else getattr(config, "dispatch_batches", None)
    if dispatch:
        problems.append(
            f"{cls}.accelerator_config.dispatch_batches=True: rank 0 would deal batches to every process, not the "
            "same ones to a sequence group; set it False"
        )
    return problems


def install_sequence_parallel(trainer: Trainer) -> None:
    """Make ``trainer`` train its ``sp:N`` model sequence-parallel (nothing without sp:N; once).

    Raises:
        ValueError: what the Trainer run cannot do under sp:N (a ``compute_loss_func``, a model
            Trainer passes no ``num_items_in_batch``), each with its fix. TRL's ``SFTTrainer`` runs as
            Trainer does: its fused LM head scores the pre-shifted ``shift_labels`` over the same count.
    """
    model = trainer.model
    if not isinstance(model, nn.Module):
        return
    n = sequence_parallel_size(model)
    if n == 1 or is_installed(trainer):
        return
    _refuse_trainer(trainer, n)
    args = trainer.args
    world, rank = args.world_size, args.process_index
    pad = getattr(getattr(unwrap_model(model), "config", None), "pad_token_id", None)
    train_loader = trainer.get_train_dataloader  # bound: a subclass's own loader is re-keyed too

    def get_train_dataloader() -> DataLoader:
        return group_loader(train_loader(), n=n, world=world, rank=rank, pad_token_id=pad or 0)

    def no_eval(*args: object, **kwargs: object) -> DataLoader:
        raise ValueError(
            f"{type(trainer).__name__}.evaluate()/predict() under sp:{n}: evaluation is not sequence-parallel here "
            f"(the eval loader gives each process other rows); evaluate the model prepared without sp:{n}, or "
            + _OWN_LOOP
        )

    trainer.get_train_dataloader = get_train_dataloader  # type: ignore[method-assign]
    trainer.get_eval_dataloader = no_eval  # type: ignore[method-assign]
    trainer.get_test_dataloader = no_eval  # type: ignore[method-assign]

    # Samples per optimizer step (its logs and train_samples_per_second): one batch per group, not per process.
    def get_total_train_batch_size(a: TrainingArguments) -> int:
        return int(trainer._train_batch_size * a.gradient_accumulation_steps * (a.world_size // n))

    trainer.get_total_train_batch_size = get_total_train_batch_size  # type: ignore[method-assign,assignment]
    setattr(trainer, TRAINER_MARK, n)


def is_installed(trainer: object) -> bool:
    return bool(getattr(trainer, TRAINER_MARK, None))


def refuse_uninstalled(trainer: Trainer | None, model: nn.Module) -> None:
    """Raise when ``model`` is ``sp:N`` and ``trainer`` (None: not found) lacks the hooks."""
    n = sequence_parallel_size(model)
    if n > 1 and (trainer is None or not is_installed(trainer)):
        raise ValueError(
            f"sp:{n}: MemstackCallback could not give the Trainer's sequence groups their rows "
            f"({'it found no Trainer dispatching its events' if trainer is None else 'the Trainer was not hooked'}); "
            "call hf_memstack.integrations.trainer.add_memstack_callback(trainer) after building the Trainer and "
            "before trainer.train()"
        )


def group_loader(loader: DataLoader, *, n: int, world: int, rank: int, pad_token_id: int) -> DataLoader:
    """``loader`` (Trainer's, prepared by Accelerate) re-keyed by the data-parallel rank, collating slices."""
    from accelerate.data_loader import BatchSamplerShard

    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, BatchSamplerShard):
        raise ValueError(
            f"sp:{n}: the training loader ({type(loader).__name__}, batch sampler {type(sampler).__name__}) is not "
            "Accelerate's sharded map-style loader, whose batches the hooks deal by sequence group; pass a map-style "
            f"train_dataset (a list or datasets.Dataset, not an IterableDataset), or {_OWN_LOOP}"
        )
    # The ranks of a group (rank // n) read the same batches; the groups split the data.
    sampler.num_processes, sampler.process_index = world // n, rank // n
    # Accelerate completes a short last batch from the first rows (even_batches) so that DDP's processes
    # step together; with one sequence group there is nothing to keep even, and the unsharded run on one
    # process (no BatchSamplerShard) trains the short batch as it is - padding it would train other rows.
    if world // n == 1:
        sampler.even_batches = False
    # Accelerate's DataLoaderShard iterates the DataLoader it wraps (base_dataloader): its collator is the one used.
    base = getattr(loader, "base_dataloader", loader)
    if not isinstance(base.collate_fn, GroupShardCollator):
        base.collate_fn = GroupShardCollator(cast("_Collate", base.collate_fn), rank % n, n, pad_token_id)
    return loader


def _refuse_trainer(trainer: Trainer, n: int) -> None:
    cls = type(trainer).__name__
    problems: list[str] = []
    if type(trainer).__module__.split(".")[0] == "trl" and not _is_sft_trainer(trainer):
        problems.append(
            f"{cls} is not sequence-parallel here: only TRL's SFTTrainer is (preference and RL trainers score "
            f"completions row by row, with masks and columns a sequence slice does not carry); train {cls} with a "
            f"policy without sp:{n}, or SFT with SFTTrainer"
        )
    if getattr(trainer, "compute_loss_func", None) is not None:
        problems.append(
            f"{cls}(compute_loss_func=...): under sp:{n} its labels would be each rank's slice, already shifted; drop it"
        )
    if not getattr(trainer, "model_accepts_loss_kwargs", True):
        problems.append(
            f"{cls}.model_accepts_loss_kwargs is False: Trainer would not pass num_items_in_batch to the model, whose "
            f"loss would then average each rank's slice alone; use a model whose forward takes **kwargs"
        )
    if problems:
        raise ValueError(f"sp:{n} under {cls}:\n  - " + "\n  - ".join(problems))


def _is_sft_trainer(trainer: object) -> bool:
    try:
        from trl import SFTTrainer
    except ImportError:  # pragma: no cover - a trl trainer without trl cannot exist
        return False
    return isinstance(trainer, SFTTrainer)
