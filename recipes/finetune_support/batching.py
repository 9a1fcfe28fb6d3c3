"""The micro-batch and the accumulation steps: the flag's, the batch-size finder's (--batch-size
auto, on the training loader's own batches), or, resuming an auto run, what the finder found then."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .common import RecipeError
from .flags import FinetuneConfig
from .run_dir import OutputPlan

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from collections.abc import Callable

    from accelerate import Accelerator
    from datasets import Dataset

    from .checkpoint_dirs import Resolved
    from .common import Batch, Collate


def choose_batch_size(
    cfg: FinetuneConfig,
    plan: OutputPlan,
    resolved: Resolved | None,
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_ds: Dataset,
    batch_collate: Collate,
) -> tuple[int, int]:
    """The micro-batch and the accumulation steps: the flag's, the finder's (--batch-size auto), or,
    resuming an auto run on as many processes, what the finder found when it started."""
    from hf_memstack import find_batch_size
    from hf_memstack.transforms.sequence_parallel.reduce import sequence_parallel_size

    world, log = accelerator.num_processes, accelerator.print
    if (
        resolved
        and cfg.memory.batch_size == "auto"
        and plan.reference
        and plan.reference.get("batch_size") == "auto"
        and plan.reference.get("world_size") == world
    ):
        batch_size = resolved["batch_size"]  # what the finder found when the run started
        if batch_size > max(1, len(train_ds) // world):  # the finder's own ceiling: a received state could say any
            raise RecipeError(
                f"resume_from: trainer_state.json resolved batch_size={batch_size}, more than the finder ever picks "
                f"here (one process's share of the {len(train_ds)} training rows); it was altered: resume from a "
                "checkpoint this recipe wrote, or start again"
            )
        grad_accum = grad_accum_steps(cfg.memory.global_batch_size, batch_size, world)
    elif cfg.memory.batch_size == "auto":
        make_batch = finder_batches(train_ds, batch_collate, accelerator.device)
        try:
            # No larger than one process's share of the training rows: a bigger batch never runs whole
            # (under compile, which drops the last partial batch, it would not run at all).
            found = find_batch_size(
                model,
                make_batch,
                optimizer,
                budget=cfg.memory.memory_budget,
                global_batch_size=cfg.memory.global_batch_size,
                max_batch_size=max(1, len(train_ds) // world),
            )
        except ValueError as e:
            raise RecipeError(f"batch_size=auto with memory_budget={cfg.memory.memory_budget!r}: {e}") from None
        log(found.summary())
        _log_label_fraction(cfg, train_ds, batch_collate, log)
        batch_size = found.batch_size
        grad_accum = found.grad_accum if cfg.memory.global_batch_size else 1
    else:
        # sp:N (refused with auto): the N ranks of a sequence group read the same rows, so world / N read others.
        world //= sequence_parallel_size(model)
        batch_size = int(cfg.memory.batch_size)
        grad_accum = grad_accum_steps(cfg.memory.global_batch_size, batch_size, world)
    if cfg.memory.global_batch_size and grad_accum * batch_size * world != cfg.memory.global_batch_size:
        log(
            f"note: global batch {cfg.memory.global_batch_size} is not a multiple of {batch_size} x {world} "
            "process(es) (or sequence groups); "
            f"{grad_accum} accumulation steps (rounded up) give {grad_accum * batch_size * world}"
        )
    return batch_size, grad_accum


def _log_label_fraction(
    cfg: FinetuneConfig, train_ds: Dataset, batch_collate: Collate, log: Callable[..., None]
) -> None:
    """The training rows' label fraction through the loader's collate, beside the finder's answer
    (its steps ran the chunked head over their rows' labelled positions); said once: under
    --policy auto the planner's line already gave it. A classifier's rows make no claim."""
    from hf_memstack.data import measure_label_fraction

    if cfg.memory.policy == "auto" and cfg.memory.memory_budget:
        return
    try:
        labels = measure_label_fraction(train_ds, batch_collate)
    except ValueError:  # rows with nothing to learn: tokenize refused them already
        return
    if labels is not None:
        log(labels.summary())


def finder_batches(train_ds: Dataset, batch_collate: Collate, device: torch.device) -> Callable[[int], Batch]:
    """``make_batch(n)`` for the batch-size finder: the ``n`` longest training rows through the
    training loader's own collate, so the finder sizes the widest batch training will run, at the
    length and with the padding it runs (under compile every batch is padded to --seq-len)."""
    lengths = [len(ids) for ids in train_ds["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])

    def make_batch(n: int) -> Batch:
        rows = [train_ds[order[i % len(order)]] for i in range(n)]
        return {k: v.to(device) for k, v in batch_collate(rows).items()}

    return make_batch


def grad_accum_steps(global_batch: int | None, batch_size: int, world: int) -> int:
    """Accumulation steps for a global batch, rounded up like the batch-size finder's result
    (never a smaller global batch than asked for)."""
    return max(1, math.ceil(global_batch / (batch_size * world))) if global_batch else 1
