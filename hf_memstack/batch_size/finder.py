"""find_batch_size: the largest batch that fits a memory budget, predicted from a few measured
training steps, verified by a real step at that size, agreed across ranks, cached on disk.

How it predicts. Every probe records the live tensor bytes after each operator of the step; each
operator's bytes are a straight line in the batch size, so two small probes give the peak at any
size (:mod:`.fit`). The predicted size is then run; when its peak is the predicted one,
it is the answer (3 real steps), else the lines are refitted through the probes nearest the
answer (:mod:`.search`). Nothing returned is untested: the result is the largest size
whose real step fitted. The jobs are split by module: ``preflight`` checks everything before a
step, ``probe`` runs one measured step, ``search`` decides the sizes, ``snapshot`` restores the
training state, ``cache`` keeps results on disk, ``ranks`` makes the ranks agree and ``result``
builds what is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._device import device_of, preserved_rng
from ..distributed._ranks import on_every_rank
from ..measure.step import LossFn
from ..record import MemstackRecord, record_of
from .cache import agree_entry, cache_key, cache_path, read_entry, write_entry
from .preflight import budget_too_small, preflight
from .probe import StepRunner, batch_signature, seq_len_of
from .ranks import agree_arguments, is_local_leader, world_size
from .result import BatchSizeResult, CacheStatus, build_result
from .search import Found, Search
from .snapshot import SchedulerLike, step_state_restored

__all__ = ["find_batch_size"]


def find_batch_size(
    model: nn.Module,
    make_batch: Callable[[int], object],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    budget: int | str | None = None,
    mode: Literal["train", "eval"] = "train",
    loss_fn: LossFn | None = None,
    scheduler: SchedulerLike | None = None,
    global_batch_size: int | None = None,
    max_batch_size: int = 65536,
    probe_size: int = 2,
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> BatchSizeResult:
    """Find the largest batch size whose real step fits ``budget``.

    Args:
        model: the prepared model (its policy - precision, checkpointing - is what gets measured;
            a compiled model's probes run eagerly, see docs/batch-size.md). LoRA/PEFT and FSDP2 models work.
        make_batch: ``make_batch(n)`` returns a batch of exactly ``n`` samples at the longest
            sequence length the run will see (so a later long batch cannot run out of memory).
        optimizer: stepped in each probe (its state counts); required for ``mode="train"``.
        budget: bytes or a string like ``"20GiB"``. CUDA: defaults to the memory free now plus
            what PyTorch already holds. CPU: inside :func:`~hf_memstack.simulated_memory_limit`
            defaults to its budget; otherwise required (a CPU has no out-of-memory error to catch:
            the process is killed), and the measured peak is compared with it.
        mode: ``train`` (forward + backward + optimizer step) or ``eval`` (forward under no_grad),
            so an evaluation size never shrinks the training size.
        loss_fn: for models that do not return ``outputs.loss``.
        scheduler: a learning-rate scheduler to leave untouched.
        global_batch_size: samples per optimizer step over all ranks; the result gives the
            gradient-accumulation steps that keep it.
        max_batch_size: never probe above this.
        probe_size: the first probe's size (the second is twice it).
        cache: remember the result on disk and re-verify it with one step next time.
        cache_dir: where (default ``~/.cache/hf_memstack``; created readable by you only).

    Returns:
        :class:`BatchSizeResult`. The trainable weights, buffers, gradients, optimizer, scheduler
        and scaler state, every submodule's train/eval mode and the RNG state are exactly as
        before the call (also when it raises).

    Raises:
        ValueError: a bad argument; ``make_batch`` returned the wrong number of samples, or a sample
            the model cannot run (labels or an attention mask of another shape than ``input_ids``, ids
            outside the vocabulary: :func:`hf_memstack.measure.batch_checks.check_batch`); no
            trainable parameter in ``mode="train"``.
        TypeError: an argument of the wrong type.
        BudgetTooSmallError: the budget cannot hold the model or one step at batch size 1 (the
            message says how much is needed and which rung of the ladder to try).
        DistributedMismatchError: another rank failed (every rank raises; none is left waiting).
    """
    budget_bytes, sample = preflight(
        model,
        make_batch,
        optimizer,
        budget=budget,
        mode=mode,
        global_batch_size=global_batch_size,
        max_batch_size=max_batch_size,
        probe_size=probe_size,
    )
    # What decides the probes must match on every rank (the budget may differ: the search takes the minimum).
    agree_arguments(
        mode=mode,
        max_batch_size=max_batch_size,
        global_batch_size=global_batch_size,
        probe_size=probe_size,
        cache=bool(cache),
    )
    device = device_of(model)
    record = record_of(model)
    grad_scaler = record.grad_scaler if record is not None else None
    optimizer = optimizer if mode == "train" else None
    runner = StepRunner(
        model=model,
        make_batch=make_batch,
        optimizer=optimizer,
        loss_fn=loss_fn,
        grad_scaler=grad_scaler,
        mode=mode,
        budget=budget_bytes,
    )
    search = _new_search(runner, budget_bytes, max_batch_size, global_batch_size, mode=mode, record=record)
    path = _cache_file(cache_dir, model, optimizer, record, sample, mode, budget_bytes, loss_fn) if cache else None
    floor = _per_sample_floor(model, sample)
    with ExitStack() as stack, preserved_rng(device):
        # A rank that cannot copy its training state (host memory) stops every rank before the first probe.
        state = on_every_rank(
            "find_batch_size: the snapshot of the training state",
            lambda: stack.enter_context(step_state_restored(model, optimizer, scheduler, grad_scaler)),
        )
        found, status = _run_search(model, runner, search, path, mode=mode, probe_size=probe_size, floor=floor)
    if path is not None and status != "hit" and is_local_leader():
        write_entry(path, search.entry(found))
    return build_result(
        found,
        runner,
        status,
        path,
        sample=sample,
        budget=budget_bytes,
        mode=mode,
        record=record,
        global_batch_size=global_batch_size,
        snapshot_bytes=state.copied_bytes,
    )


def _new_search(
    runner: StepRunner,
    budget: int,
    max_batch_size: int,
    global_batch_size: int | None,
    *,
    mode: str,
    record: MemstackRecord | None,
) -> Search:
    """The search over sizes up to ``max_batch_size`` (and the global batch's share of a rank)."""
    if global_batch_size is not None:
        # A per-device batch above the global batch would overshoot it on its own.
        max_batch_size = min(max_batch_size, max(1, global_batch_size // world_size()))
    return Search(
        runner,
        budget=budget,
        cap=max_batch_size,
        too_small=lambda m: budget_too_small(m, mode=mode, budget=budget, record=record),
    )


def _cache_file(
    cache_dir: str | Path | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    record: MemstackRecord | None,
    sample: object,
    mode: str,
    budget: int,
    loss_fn: LossFn | None,
) -> Path:
    """The cache entry's path, keyed by what changes the answer (agreed across ranks)."""
    return on_every_rank(
        "find_batch_size: the cache key",
        lambda: cache_path(
            cache_dir,
            cache_key(
                model,
                optimizer,
                policy=record.policy.to_dict() if record is not None else None,
                batch=batch_signature(sample),
                mode=mode,
                budget=budget,
                loss_fn=loss_fn,
            ),
        ),
    )


def _per_sample_floor(model: nn.Module, sample: object) -> int:
    """Bytes each sample surely adds to a step's peak: its own tensors (the batch lives through
    the step; ``sample`` is the batch of one) and the last hidden state every forward computes
    (seq_len x hidden_size values of at least 2 bytes). A cache entry whose peak is below its size
    times this was not measured: it is discarded before its size runs."""
    batch_bytes = sum(t.nbytes for t in tree_leaves(sample) if torch.is_tensor(t))
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    seq = seq_len_of(sample)
    hidden_bytes = 2 * seq * hidden if isinstance(hidden, int) and hidden > 0 and seq is not None else 0
    return batch_bytes + hidden_bytes


def _run_search(
    model: nn.Module,
    runner: StepRunner,
    search: Search,
    path: Path | None,
    *,
    mode: str,
    probe_size: int,
    floor: int,
) -> tuple[Found, CacheStatus]:
    """Inside the snapshot: start as a training loop does (no gradients held), create the
    optimizer state, try the cache, else search."""
    for p in model.parameters():
        p.grad = None
    # Probe the mode that will run: a model straight from from_pretrained is in eval mode, where
    # checkpointing and dropout are off (every submodule's mode is restored afterwards).
    model.train(mode == "train")
    if not runner.init_optimizer_state():
        runner.run(min(probe_size, search.cap), "warmup")
    status: CacheStatus = "off"
    if path is not None:
        entry = agree_entry(
            on_every_rank(
                "find_batch_size: reading the cache entry",
                lambda: read_entry(path, budget=search.budget, per_sample_floor=floor),
            )
        )
        status = "miss"
        if entry is not None:
            found = search.warm(entry)
            if found is not None:
                return found, "hit"
            status = "stale"
    return search.cold(probe_size), status
