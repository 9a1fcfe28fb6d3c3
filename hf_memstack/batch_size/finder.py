"""find_batch_size: the largest batch that fits a memory budget, predicted from a few measured
training steps, verified by a real step at that size, agreed across ranks, cached on disk.

How it predicts. Every probe records the live tensor bytes after each operator of the step; each
operator's bytes are a straight line in the batch size, so two small probes give the peak at any
size (:mod:`.fit`). The predicted size is then run; when its peak is the predicted one,
it is the answer (3 real steps), else the lines are refitted through the probes nearest the
answer (:mod:`.search`). Nothing returned is untested: the result is the largest size
whose real step fitted. The jobs are split by module: ``probe`` runs one measured step,
``search`` decides the sizes, ``snapshot`` restores the training state, ``cache`` keeps results on
disk and ``ranks`` makes the ranks agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .._device import device_of, preserved_rng
from ..data.boundaries import is_packed
from ..distributed._ranks import on_every_rank
from ..errors import BudgetTooSmallError
from ..measure.accounting import model_state_bytes
from ..measure.simulated import current_limit, untracked
from ..measure.step import LossFn
from ..record import MemstackRecord, record_of
from ..sizes import format_bytes, parse_bytes
from .cache import (
    agree_entry,
    cache_key,
    cache_path,
    read_entry,
    write_entry,
)
from .fit import Phase
from .probe import (
    Measured,
    ProbeKind,
    StepRunner,
    batch_signature,
    check_batch_size,
    seq_len_of,
)
from .ranks import agree_arguments, agree_no_error, is_local_leader, world_size
from .search import Found, Search
from .snapshot import step_state_restored

__all__ = ["BatchSizeResult", "Fit", "Probe", "find_batch_size"]

CacheStatus = Literal["off", "miss", "hit", "stale"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One real step run by the search."""

    batch_size: int
    """Samples in the step's batch."""
    kind: ProbeKind
    """Why it ran: ``probe`` (the small sizes the fit starts from), ``predict`` (the fit's answer),
    ``refine`` (a refitted answer), ``search`` (bisection, when no fit is usable), ``cache`` (the
    cached size, re-verified), ``warmup`` (creates the optimizer state when it cannot be created
    without a step)."""
    fits: bool
    """Ran to the end under the budget, on every rank."""
    peak_bytes: int | None
    """The step's measured peak on this rank; None when it ran out of memory part-way."""
    seconds: float
    """Wall time of the step."""

    @property
    def partial(self) -> bool:
        """Stopped by an out-of-memory error part-way through the step."""
        return self.peak_bytes is None


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    """The line that holds the peak at the answer: ``peak ~ fixed_bytes + bytes_per_sample * batch``."""

    method: Literal["per-operator", "peak-line"]
    """``per-operator``: one line per operator of the step, exact when the probes ran the same
    operators; ``peak-line``: one line through two probes' peaks (the fallback)."""
    fixed_bytes: int
    """The binding line's bytes at batch size 0 (weights, gradients, optimizer state, buffers)."""
    bytes_per_sample: int
    """Its bytes per sample: about what one more sample would need."""
    binding_phase: Phase
    """Where the step peaks at the answer: ``forward``, ``backward`` or ``optimizer``."""
    from_sizes: tuple[int, int]
    """The two probe sizes the lines go through."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizeResult:
    """What :func:`find_batch_size` found, and how."""

    batch_size: int
    """The largest batch size whose real step fitted the budget (on every rank)."""
    peak_bytes: int
    """The measured peak of that step (this rank)."""
    budget: int
    """The budget in bytes."""
    mode: Literal["train", "eval"]
    """``train``: forward, backward and optimizer step; ``eval``: forward under no_grad."""
    probes: tuple[Probe, ...]
    """Every real step, in order."""
    fit: Fit | None
    """The prediction at the answer (None when none was needed: a cache hit, or the first probe was the cap)."""
    capped: bool
    """``batch_size`` is ``max_batch_size``: larger sizes were not tried."""
    world_size: int
    """Ranks that agreed on the size."""
    seq_len: int | None
    """The batches' sequence length (``input_ids``), when they have one."""
    tokens_per_batch: int | None
    """``batch_size * seq_len``."""
    global_batch_size: int | None
    """The requested samples per optimizer step over all ranks."""
    grad_accum: int
    """Gradient-accumulation steps for ``global_batch_size`` (1 without one)."""
    exact_global_batch: bool
    """``batch_size * grad_accum * world_size == global_batch_size``."""
    exact_batch_size: int | None
    """When not exact: the largest size below ``batch_size`` that gives ``global_batch_size`` exactly."""
    cache: CacheStatus
    """``off``; ``miss`` (searched, then stored); ``hit`` (one verifying step); ``stale`` (the
    entry no longer held: searched again)."""
    cache_file: str | None
    """The cache entry's path (None with ``cache=False``)."""
    snapshot_bytes: int
    """Host memory taken by the copy of what a step changes (frozen weights are not copied)."""
    notes: tuple[str, ...] = ()
    """Anything else worth knowing (compiled model, inexact global batch)."""
    packed: bool = False
    """The batches are packed rows (``position_ids`` restarting, :class:`hf_memstack.data.PackedCollator`):
    ``batch_size`` counts rows of ``seq_len`` tokens, each holding several samples, and
    ``tokens_per_batch`` is the token budget of a step (with SDPA or eager attention the probes
    measured the dense mask such rows make)."""

    @property
    def steps_run(self) -> int:
        """Real steps run, full or stopped part-way."""
        return len(self.probes)

    @property
    def over_budget_probes(self) -> int:
        """Steps that did not fit (ran out of memory, or peaked above the budget)."""
        return sum(not p.fits for p in self.probes)

    @property
    def cache_hit(self) -> bool:
        return self.cache == "hit"

    def summary(self) -> str:
        lines = [
            f"batch size {self.batch_size} ({self.mode}): peak {format_bytes(self.peak_bytes)} of a "
            f"{format_bytes(self.budget)} budget, {self.steps_run} real step(s)"
            + (f", {self.over_budget_probes} over budget" if self.over_budget_probes else "")
            + (" (cache hit)" if self.cache_hit else "")
            + (" (max_batch_size)" if self.capped else "")
        ]
        if self.tokens_per_batch and self.packed:
            lines.append(
                f"  {self.tokens_per_batch} tokens per batch: {self.batch_size} packed rows of {self.seq_len} tokens"
            )
        elif self.tokens_per_batch:
            lines.append(f"  {self.tokens_per_batch} tokens per batch at sequence length {self.seq_len}")
        if self.global_batch_size:
            lines.append(
                f"  global batch {self.global_batch_size} = {self.batch_size} x {self.grad_accum} accumulation x "
                f"{self.world_size} device(s)" + ("" if self.exact_global_batch else " (not exact)")
            )
        if self.fit is not None:
            lines.append(
                f"  fit ({self.fit.method}, probes {self.fit.from_sizes[0]} and {self.fit.from_sizes[1]}): "
                f"{format_bytes(self.fit.bytes_per_sample)} per {'packed row' if self.tokens_per_batch and self.packed else 'sample'}, "
                + (
                    f"peak in the {self.fit.binding_phase}"
                    if self.fit.binding_phase != "unknown"
                    else "peak phase not measured"
                )
            )
        lines.append(
            "  probes: "
            + ", ".join(
                f"{p.batch_size}:{'OOM' if p.partial else format_bytes(p.peak_bytes or 0)}{'' if p.fits else '(over)'}"
                for p in self.probes
            )
        )
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(steps_run=self.steps_run, over_budget_probes=self.over_budget_probes, cache_hit=self.cache_hit)
        return d


def find_batch_size(
    model: nn.Module,
    make_batch: Callable[[int], Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    budget: int | str | None = None,
    mode: Literal["train", "eval"] = "train",
    loss_fn: LossFn | None = None,
    scheduler: Any | None = None,
    global_batch_size: int | None = None,
    max_batch_size: int = 65536,
    probe_size: int = 2,
    cache: bool = True,
    cache_dir: str | Path | None = None,
) -> BatchSizeResult:
    """Find the largest batch size whose real step fits ``budget``.

    Args:
        model: the prepared model (its policy - precision, checkpointing - is what gets measured;
            a compiled model's probes run eagerly, see the README). LoRA/PEFT and FSDP2 models work.
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
        ValueError: a bad argument; ``make_batch`` returned the wrong number of samples; no
            trainable parameter in ``mode="train"``.
        TypeError: an argument of the wrong type.
        BudgetTooSmallError: the budget cannot hold the model or one step at batch size 1 (the
            message says how much is needed and which rung of the ladder to try).
        DistributedMismatchError: another rank failed (every rank raises; none is left waiting).
    """
    budget_bytes, sample = _preflight(
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
    if global_batch_size is not None:
        # A per-device batch above the global batch would overshoot it on its own.
        max_batch_size = min(max_batch_size, max(1, global_batch_size // world_size()))
    search = Search(
        runner,
        budget=budget_bytes,
        cap=max_batch_size,
        too_small=lambda m: _too_small(m, mode=mode, budget=budget_bytes, record=record),
    )
    path = None
    if cache:
        path = on_every_rank(
            "find_batch_size: the cache key",
            lambda: cache_path(
                cache_dir,
                cache_key(
                    model,
                    optimizer,
                    policy=record.policy.to_dict() if record is not None else None,
                    batch=batch_signature(sample),
                    mode=mode,
                    budget=budget_bytes,
                    loss_fn=loss_fn,
                ),
            ),
        )
    with ExitStack() as stack, preserved_rng(device):
        # A rank that cannot copy its training state (host memory) stops every rank before the first probe.
        state = on_every_rank(
            "find_batch_size: the snapshot of the training state",
            lambda: stack.enter_context(step_state_restored(model, optimizer, scheduler, grad_scaler)),
        )
        found, status = _run_search(model, runner, search, path, mode=mode, probe_size=probe_size)
    if path is not None and status != "hit" and is_local_leader():
        write_entry(path, search.entry(found))
    return _result(
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


def _run_search(
    model: nn.Module, runner: StepRunner, search: Search, path: Path | None, *, mode: str, probe_size: int
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
            on_every_rank("find_batch_size: reading the cache entry", lambda: read_entry(path, budget=search.budget))
        )
        status = "miss"
        if entry is not None:
            found = search.warm(entry)
            if found is not None:
                return found, "hit"
            status = "stale"
    return search.cold(probe_size), status


def _preflight(
    model: Any,
    make_batch: Any,
    optimizer: Any,
    *,
    budget: Any,
    mode: Any,
    global_batch_size: Any,
    max_batch_size: Any,
    probe_size: Any,
) -> tuple[int, Any]:
    """Every check before any step, agreed across ranks (a rank that fails - a wrong argument, a
    budget that does not parse or cannot hold the weights, a ``make_batch`` that fails - makes
    every rank raise). Returns the budget in bytes and a batch of one sample."""
    error: BaseException | None = None
    budget_bytes, sample = 0, None
    try:
        _check_arguments(
            model,
            make_batch,
            optimizer,
            mode=mode,
            global_batch_size=global_batch_size,
            max_batch_size=max_batch_size,
            probe_size=probe_size,
        )
        budget_bytes = _resolve_budget(budget, device_of(model))
        sample = _check_model_and_sample(model, make_batch, mode=mode, budget=budget_bytes, record=record_of(model))
    except Exception as e:  # noqa: BLE001 - agreed with the other ranks first, then raised on every rank
        error = e
    agree_no_error(error, "pre-flight checks", budget=budget_bytes)
    return budget_bytes, sample


def _check_model_and_sample(
    model: nn.Module, make_batch: Callable[[int], Any], *, mode: str, budget: int, record: MemstackRecord | None
) -> Any:
    if mode == "train" and not any(p.requires_grad for p in model.parameters()):
        n = sum(1 for _ in model.parameters())
        raise ValueError(
            f"mode='train' but every one of the model's {n} parameters is frozen (requires_grad=False): "
            "a training step would change nothing. Unfreeze what should train (e.g. PEFT's "
            "get_peft_model adds trainable adapters), or size evaluation with mode='eval'"
        )
    params = model_state_bytes(model).parameters  # this rank's local shards under FSDP
    if params >= budget:
        raise BudgetTooSmallError(
            f"budget={format_bytes(budget)} is smaller than the model's parameters alone ({format_bytes(params)}); "
            f"training needs about {format_bytes(4 * params)} before activations (parameters, gradients, AdamW "
            f"state). {_next_rung(record, weights_dominate=True)}",
            budget_bytes=budget,
            needed_bytes=4 * params,
        )
    with untracked():  # a look at the batch's shapes, not part of any step
        sample = make_batch(1)
        check_batch_size(sample, 1)
    return sample


def _result(
    found: Found,
    runner: StepRunner,
    status: CacheStatus,
    path: Path | None,
    *,
    sample: Any,
    budget: int,
    mode: Any,
    record: MemstackRecord | None,
    global_batch_size: int | None,
    snapshot_bytes: int,
) -> BatchSizeResult:
    best, world = found.best, world_size()
    seq_len = seq_len_of(sample)
    fit = None
    if found.lines is not None:
        fixed, per_sample, phase = found.lines.binding(best.batch_size)
        fit = Fit(
            method=found.lines.method,
            fixed_bytes=fixed,
            bytes_per_sample=per_sample,
            binding_phase=phase,
            from_sizes=(found.lines.a, found.lines.b),
        )
    accum, exact, exact_size, notes = _global_batch(best.batch_size, global_batch_size, world)
    if record is not None and record.compile.regions:
        notes += (
            (
                "compiled model: the probes ran eagerly (Dynamo does not run compiled code under the finder's memory "
                "tracker), so the size comes from eager memory and no graph was compiled for the probe sizes"
            ),
        )
    return BatchSizeResult(
        batch_size=best.batch_size,
        peak_bytes=best.peak_bytes or 0,
        budget=budget,
        mode=mode,
        probes=tuple(_probe(m) for m in runner.steps),
        fit=fit,
        capped=found.capped,
        world_size=world,
        seq_len=seq_len,
        tokens_per_batch=best.batch_size * seq_len if seq_len else None,
        global_batch_size=global_batch_size,
        grad_accum=accum,
        exact_global_batch=exact,
        exact_batch_size=exact_size,
        cache=status,
        cache_file=str(path) if path is not None else None,
        snapshot_bytes=snapshot_bytes,
        notes=notes,
        packed=isinstance(sample, dict) and is_packed(sample.get("position_ids"), sample.get("attention_mask")),
    )


def _probe(m: Measured) -> Probe:
    return Probe(batch_size=m.batch_size, kind=m.kind, fits=m.fits, peak_bytes=m.peak_bytes, seconds=m.seconds)


def _global_batch(
    batch_size: int, global_batch: int | None, world: int
) -> tuple[int, bool, int | None, tuple[str, ...]]:
    """Accumulation steps for ``global_batch`` (and, when inexact, the largest size that is exact)."""
    if global_batch is None:
        return 1, True, None, ()
    per_step = batch_size * world
    accum = max(1, math.ceil(global_batch / per_step))
    if accum * per_step == global_batch:
        return accum, True, None, ()
    exact = next((b for b in range(batch_size, 0, -1) if global_batch % (b * world) == 0), None)
    note = (
        f"global batch {global_batch} is not a multiple of {batch_size} x {world}: {accum} accumulation steps give "
        f"{accum * per_step}"
        + (f"; batch size {exact} with {global_batch // (exact * world)} steps matches exactly" if exact else "")
    )
    return accum, False, exact, (note,)


def _check_arguments(
    model: Any,
    make_batch: Any,
    optimizer: Any,
    *,
    mode: Any,
    global_batch_size: Any,
    max_batch_size: Any,
    probe_size: Any,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__} must be a torch.nn.Module")
    if not callable(make_batch):
        raise TypeError(f"make_batch={make_batch!r} must be callable: make_batch(n) returns a batch of n samples")
    if mode not in ("train", "eval"):
        raise ValueError(f"mode={mode!r} is not one of 'train', 'eval'")
    for name, value in (("max_batch_size", max_batch_size), ("probe_size", probe_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if global_batch_size is not None and (
        not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0
    ):
        raise ValueError(
            f"global_batch_size={global_batch_size!r} must be a positive integer (samples per optimizer step)"
        )
    if mode == "train" and optimizer is None:
        raise ValueError(
            "mode='train' needs the optimizer (its state is part of the step's memory); pass optimizer=..."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__} must be a torch.optim.Optimizer")


def _resolve_budget(budget: int | str | None, device: torch.device) -> int:
    if budget is not None:
        return parse_bytes(budget, field="budget")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    limit = current_limit(device.type)
    if limit is not None:
        return limit.budget
    raise ValueError(
        f"budget is required on {device.type}: there is no out-of-memory error to catch there (the operating system "
        "kills the process), so the measured peak is compared with a budget; pass budget='8GiB' (or bytes), or run "
        "inside hf_memstack.simulated_memory_limit(...)"
    )


def _too_small(m: Measured, *, mode: str, budget: int, record: MemstackRecord | None) -> BudgetTooSmallError:
    need = format_bytes(m.peak_bytes) if m.peak_bytes else "more than the budget (out of memory)"
    return BudgetTooSmallError(
        f"budget={format_bytes(budget)} cannot hold one {mode} step at batch size {m.batch_size}: "
        f"it needs {need}. {_next_rung(record, weights_dominate=False)}",
        budget_bytes=budget,
        needed_bytes=m.peak_bytes,
    )


def _next_rung(record: MemstackRecord | None, *, weights_dominate: bool) -> str:
    from ..planning.rungs import next_rung
    from ..transforms.quant import quantizable

    if record is None:
        return "Prepare the model with a memory policy first, e.g. prepare_model(model, 'bf16+ckpt')."
    return next_rung(
        record.policy,
        num_blocks=len(record.blocks or ()),
        weights_dominate=weights_dominate,
        causal_lm=record.chunkable_loss,
        quantize=quantizable(record.blocks),
    )
