"""Sequence parallelism (``--policy ...+sp:N``) in the recipe: which rows each rank reads, and its slice of them.

The W processes form W/N data-parallel groups of N contiguous ranks (SP innermost, as the library's
sequence group). The ranks of one group read the same rows - the training loader is sharded by the
data-parallel rank (rank // N) over W/N, not by the rank over W - and each runs its 1/N of every row's
tokens (``shard_batch``: shifted labels, global position_ids, the group's token count). The loss each
rank backpropagates is N x its share (``backward_loss``: DDP and FSDP average over W ranks), and the
logged loss is each group's sum averaged over the groups, so that an ``sp:2`` run logs what ``sp:1`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .common import RecipeError

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard

    from hf_memstack.policy import MemoryPolicy

    from .common import Batch, Sample
    from .flags import FinetuneConfig


@dataclass(frozen=True, slots=True)
class SequenceGroups:
    """Where this process sits: ``size`` ranks per sequence group, ``dp`` groups."""

    size: int
    dp: int
    dp_rank: int
    sp_rank: int


def sequence_groups(policy: MemoryPolicy, world: int, rank: int) -> SequenceGroups:
    n = policy.sequence_parallel.size
    return SequenceGroups(size=n, dp=max(1, world // n), dp_rank=rank // n, sp_rank=rank % n)


def check_sequence_parallel(cfg: FinetuneConfig, policy: MemoryPolicy, task: str, world: int) -> None:
    """What sp:N cannot run here, refused before anything is loaded or written.

    Raises:
        RecipeError: a classification task, the batch-size finder, or a process count N does not divide.
    """
    n = policy.sequence_parallel.size
    if n == 1:
        return
    where = f"policy={policy.to_string()!r}"
    if task != "causal-lm":
        raise RecipeError(
            f"{where}: sp:{n} shards every row's tokens over {n} ranks, which only a causal language model's loss "
            "adds up over; this run trains a classifier (--task auto found labels): drop sp:N, or pass --task causal-lm"
        )
    if cfg.memory.batch_size == "auto":
        raise RecipeError(
            f"batch_size='auto' with {where}: the batch-size finder measures whole rows on one rank, not a "
            f"sequence group's slices; pass --batch-size N (rows per group of {n} ranks)"
        )
    if world % n:
        raise RecipeError(
            f"{where}: sp:{n} needs a multiple of {n} processes, this run has {world}; launch with torchrun "
            f"--nproc_per_node {n} (or a multiple), or drop sp:{n}"
        )


def dp_loader(
    accelerator: Accelerator, loader: torch.utils.data.DataLoader[Sample], groups: SequenceGroups
) -> DataLoaderShard:
    """``loader`` through Accelerate, sharded by the data-parallel rank over ``groups.dp``: the N ranks
    of a group get the same batches (Accelerate's own prepare shards by the rank over every process)."""
    from accelerate.data_loader import prepare_data_loader

    prepared = prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=groups.dp,
        process_index=groups.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=True,
        rng_types=accelerator.rng_types.copy(),
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
    )
    # What Accelerator.prepare_data_loader does with its own: save_state/load_state and
    # end-of-loader bookkeeping (accumulation's last step) find it there.
    accelerator._dataloaders.append(prepared)
    return prepared


def shard(batch: Batch, groups: SequenceGroups) -> Batch:
    """This rank's slice of ``batch`` (the group's rows). A rank whose batch cannot be sharded ends every
    rank with its message (one small all-reduce per step), not a peer waiting in the all-to-all."""
    if groups.size == 1:
        return batch
    from hf_memstack.distributed._ranks import on_every_rank
    from hf_memstack.transforms.sequence_parallel import shard_batch

    return on_every_rank(
        "sequence parallel: sharding the batch",
        lambda: shard_batch(_right_padding_dropped(batch), sp_rank=groups.sp_rank, sp_size=groups.size),
    )


def _right_padding_dropped(batch: Batch) -> Batch:
    """Unpacked rows come right-padded with an attention mask, which the sequence-parallel attention
    cannot carry across the all-to-all. Under causal attention no real token attends to a later pad,
    and pads are labelled -100, so the mask changes nothing there and is dropped; a mask that is not
    right padding (a zero before a one) is left for shard_batch to refuse."""
    mask = batch.get("attention_mask")
    if mask is None:
        return batch
    right = bool((mask.cummin(dim=-1).values == mask).all())
    return {k: v for k, v in batch.items() if k != "attention_mask"} if right else batch


def reported(loss: torch.Tensor, groups: SequenceGroups) -> torch.Tensor:
    """The mean over every rank (Accelerate's reduce) times N: each group's sum, averaged over the groups."""
    return loss * groups.size
