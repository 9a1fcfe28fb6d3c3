"""find_batch_size: the largest batch that fits a memory budget, predicted from a few measured
training steps, verified by a real step at that size, agreed across ranks, cached on disk.

How it predicts. A training step's peak is ``max(C, A + k * b)``: the forward+backward peak grows
linearly with the batch size ``b`` (activations, logits), while the optimizer step's peak ``C``
(parameters + gradients + optimizer state) does not. The memory meter reports both peaks for
each probe, so two small probes give ``A``, ``k`` and ``C`` - a straight line through the total
peaks of two tiny batches would instead mostly measure the fixed optimizer cost and under-predict.
The predicted size is then run; one more step refines it with the slope measured over the long
range. Nothing returned is untested: the result is the largest size whose real step fitted.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ._device import device_of, preserved_rng
from .errors import BudgetTooSmallError
from .memory import measure_step
from .accounting import model_state_bytes, optimizer_state_bytes
from .record import record_of
from .sizes import format_bytes, parse_bytes
from .step import LossFn

__all__ = ["BatchSizeResult", "Probe", "find_batch_size"]

DEFAULT_CACHE_DIR = Path("~/.cache/hf_memstack").expanduser()


@dataclass(frozen=True, slots=True)
class Probe:
    """One real step run by the search."""

    batch_size: int
    peak_bytes: int | None
    """The step's measured peak; None when it ran out of memory."""
    forward_backward_peak: int | None
    seconds: float
    fits: bool
    """Under the budget on every rank."""
    kind: str
    """``probe`` (for the fit), ``verify`` (the prediction), ``refine``, ``search``, ``cache``."""


@dataclass(slots=True)
class BatchSizeResult:
    """What :func:`find_batch_size` found, and how."""

    batch_size: int
    peak_bytes: int
    """Measured peak of a real step at ``batch_size`` (this rank)."""
    budget: int
    mode: str
    probes: list[Probe]
    fit: dict[str, float]
    """``fixed_bytes`` (A), ``bytes_per_sample`` (k), ``optimizer_peak`` (C) of ``peak = max(C, A + k*b)``."""
    world_size: int = 1
    seq_len: int | None = None
    tokens_per_batch: int | None = None
    global_batch_size: int | None = None
    grad_accum: int = 1
    exact_global_batch: bool = True
    exact_batch_size: int | None = None
    """The largest size <= batch_size that matches ``global_batch_size`` exactly (when it exists)."""
    cache_hit: bool = False
    cache_file: str | None = None
    compile_note: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def steps_run(self) -> int:
        return len(self.probes)

    def summary(self) -> str:
        lines = [f"batch size {self.batch_size} ({self.mode}): peak {format_bytes(self.peak_bytes)} of a "
                 f"{format_bytes(self.budget)} budget, {self.steps_run} real step(s)"
                 + (" (cache hit)" if self.cache_hit else "")]
        if self.tokens_per_batch:
            lines.append(f"  {self.tokens_per_batch} tokens per batch at sequence length {self.seq_len}")
        if self.global_batch_size:
            lines.append(f"  global batch {self.global_batch_size} = {self.batch_size} x {self.grad_accum} accumulation x "
                         f"{self.world_size} device(s)" + ("" if self.exact_global_batch else
                         f" (not exact: {self.batch_size * self.grad_accum * self.world_size}; batch size {self.exact_batch_size} matches exactly)"
                         if self.exact_batch_size else " (not exact)"))
        lines.append("  probes: " + ", ".join(
            f"{p.batch_size}:{'OOM' if p.peak_bytes is None else format_bytes(p.peak_bytes)}{'' if p.fits else '(over)'}" for p in self.probes))
        for note in [self.compile_note, *self.notes]:
            if note:
                lines.append(f"  {note}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps_run"] = self.steps_run
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
        model: the prepared model (its policy - precision, checkpointing, compile - is what gets measured).
        make_batch: ``make_batch(n)`` returns a batch of exactly ``n`` samples at the longest
            sequence length the run will see (so a later long batch cannot run out of memory).
        optimizer: stepped in each probe (its state counts); required for ``mode="train"``.
        budget: bytes or a string like ``"20GiB"``. CUDA: defaults to the memory free now plus what
            PyTorch already holds. CPU: required (a CPU has no out-of-memory error to catch: the
            process is killed), and the meter's measured peak is compared with it.
        mode: ``train`` (forward + backward + optimizer step) or ``eval`` (forward under no_grad),
            so an evaluation size never shrinks the training size.
        loss_fn: for models that do not return ``outputs.loss``.
        scheduler: a learning-rate scheduler to leave untouched.
        global_batch_size: samples per optimizer step over all ranks; the result says the
            gradient-accumulation steps that keep it.
        max_batch_size: never probe above this.
        probe_size: the first probe's size (the second is twice it).
        cache: remember the result on disk and re-verify it with one step next time.
        cache_dir: where (default ``~/.cache/hf_memstack``).

    Returns:
        :class:`BatchSizeResult`. The model's weights, gradients, optimizer and scheduler state,
        train/eval mode and RNG state are exactly as before the call.

    Raises:
        ValueError: bad sizes or budget; ``make_batch`` returned the wrong number of samples; the
            budget cannot hold even the smallest step (the message says how much is needed and
            which rung of the ladder to try).
    """
    if mode not in ("train", "eval"):
        raise ValueError(f"mode={mode!r} is not one of 'train', 'eval'")
    for name, value in (("max_batch_size", max_batch_size), ("probe_size", probe_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size <= 0):
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive integer (samples per optimizer step)")
    if mode == "train" and optimizer is None:
        raise ValueError("mode='train' needs the optimizer (its state is part of the step's memory); pass optimizer=...")
    device = device_of(model)
    budget_bytes = _resolve_budget(budget, device)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    param_bytes = model_state_bytes(model).parameters
    if param_bytes >= budget_bytes:
        raise BudgetTooSmallError(
            f"budget={format_bytes(budget_bytes)} is smaller than the model's parameters alone ({format_bytes(param_bytes)}); "
            f"training needs about {format_bytes(4 * param_bytes)} before activations (parameters, gradients, AdamW state). "
            f"{_next_rung(model, weights_dominate=True)}", budget_bytes=budget_bytes, needed_bytes=4 * param_bytes,
        )
    # Through a DDP, PEFT or compile wrapper (Accelerate's prepare), the record is on the wrapped module.
    record = record_of(model)
    grad_scaler = getattr(record, "grad_scaler", None)
    compiled = bool(record is not None and record.compile.regions)
    searcher = _Search(model, make_batch, optimizer if mode == "train" else None, loss_fn, grad_scaler, budget_bytes,
                       mode, world, compiled, max_batch_size)
    key, signature = _cache_key(model, record, optimizer, searcher.signature, mode, budget_bytes, world, device)
    cache_file = Path(cache_dir or DEFAULT_CACHE_DIR) / "batch_size" / f"{key}.json" if cache else None

    was_training = model.training
    with _Snapshot(model, optimizer, scheduler, grad_scaler), preserved_rng(device):
        try:
            if mode == "eval":
                model.eval()
            result = None
            if cache_file is not None and cache_file.is_file():
                result = searcher.from_cache(json.loads(cache_file.read_text()))
                if result is None:
                    cache_file.unlink(missing_ok=True)
            if result is None:
                result = searcher.search(probe_size)
        finally:
            model.train(was_training)
    result.cache_file = str(cache_file) if cache_file else None
    if cache_file is not None and not result.cache_hit and (world == 1 or dist.get_rank() == 0):
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"batch_size": result.batch_size, "signature": signature, "fit": result.fit}))
        tmp.replace(cache_file)
    result.seq_len = searcher.seq_len
    result.tokens_per_batch = result.batch_size * searcher.seq_len if searcher.seq_len else None
    if compiled:
        result.compile_note = ("compiled model: the batch dimension of the probe batches was marked dynamic, so the "
                               "probes share one compiled graph instead of recompiling per size")
    if global_batch_size is not None:
        _apply_global_batch(result, global_batch_size, world)
    return result


class _Search:
    """The probing and the fit; every decision uses values agreed across ranks."""

    def __init__(self, model: nn.Module, make_batch: Callable[[int], Any], optimizer: torch.optim.Optimizer | None,
                 loss_fn: LossFn | None, grad_scaler: Any, budget: int, mode: str, world: int, compiled: bool, max_batch_size: int):
        self.model, self.make_batch, self.optimizer = model, make_batch, optimizer
        self.loss_fn, self.grad_scaler, self.budget, self.mode = loss_fn, grad_scaler, budget, mode
        self.world, self.compiled, self.max_batch_size = world, compiled, max_batch_size
        self.probes: list[Probe] = []
        self.had_optimizer_state = bool(optimizer is not None and optimizer.state)
        sample = make_batch(1)
        _check_batch_size(sample, 1)
        self.signature = _batch_signature(sample)
        self.seq_len = _seq_len(sample)

    # -- one real step -----------------------------------------------------------------------
    def run(self, n: int, kind: str) -> Probe:
        batch = self.make_batch(n)
        _check_batch_size(batch, n)
        if self.compiled and n >= 2:
            _mark_batch_dynamic(batch)
        step_fn = None if self.mode == "train" else _forward_only
        start = time.perf_counter()
        oom = False
        try:
            m = measure_step(self.model, batch, self.optimizer, loss_fn=self.loss_fn, grad_scaler=self.grad_scaler,
                             warmup=False, timed=False, step_fn=step_fn)
        except Exception as e:  # noqa: BLE001 - only out-of-memory errors are handled; others re-raise
            from accelerate.utils.memory import should_reduce_batch_size

            if not should_reduce_batch_size(e):
                raise
            oom = True
        seconds = time.perf_counter() - start
        peak = fb = None
        if oom:
            # Recovery outside the except block: the traceback no longer holds the step's tensors.
            batch = None
            for p in self.model.parameters():
                p.grad = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        else:
            peak, fb = m.peak_bytes, m.forward_backward_peak
            if self.optimizer is not None and not self.had_optimizer_state:
                # The first step creates the optimizer state after its backward: count it there too,
                # as it will be in every later step.
                fb += optimizer_state_bytes(self.optimizer)
                peak = max(peak, fb)
                self.had_optimizer_state = True
        fits = _agree_all(not oom and peak is not None and peak <= self.budget, self.world)
        probe = Probe(n, peak, fb, seconds, fits, kind)
        self.probes.append(probe)
        return probe

    # -- the search ----------------------------------------------------------------------------
    def from_cache(self, cached: dict[str, Any]) -> BatchSizeResult | None:
        n = _agree_min(int(cached["batch_size"]), self.world)
        probe = self.run(n, "cache")
        if not probe.fits:
            return None
        return self._result(probe, cached.get("fit", {}), cache_hit=True)

    def search(self, probe_size: int) -> BatchSizeResult:
        p = min(probe_size, self.max_batch_size)
        first = self.run(p, "probe")
        while not first.fits and p > 1:
            p = max(1, p // 2)
            first = self.run(p, "probe")
        if not first.fits:
            raise BudgetTooSmallError(self._too_small_message(first), budget_bytes=self.budget, needed_bytes=first.peak_bytes)
        q = min(2 * p, self.max_batch_size)
        if q == p:
            return self._result(first, {})
        second = self.run(q, "probe")
        if second.forward_backward_peak is None:  # a real OOM at 2p: the answer is in [p, 2p)
            return self._bisect(first, q, {})
        fit = self._fit(first, second)
        best = first if not second.fits else second
        predicted = self._predict(fit, best, second)
        if predicted <= best.batch_size:
            if not second.fits:
                return self._bisect(first, q, fit)
            return self._result(best, fit)
        candidate = self.run(predicted, "verify")
        # One refinement with the slope measured over the long range (q -> predicted).
        if candidate.forward_backward_peak is not None and candidate.batch_size > second.batch_size:
            slope = (candidate.forward_backward_peak - second.forward_backward_peak) / (candidate.batch_size - second.batch_size)
        else:
            slope = fit["bytes_per_sample"]
        slope = max(slope, 1.0)
        if candidate.fits:
            best = candidate
            headroom = self.budget - max(candidate.forward_backward_peak or 0, fit["optimizer_peak"])
            step_up = _agree_min(min(self.max_batch_size, candidate.batch_size + int(headroom // slope)), self.world)
            if step_up > candidate.batch_size:
                refined = self.run(step_up, "refine")
                if refined.fits:
                    best = refined
            return self._result(best, fit)
        # Over budget: step down by the measured excess, then search between what fitted and what did not.
        excess = (candidate.peak_bytes or self.budget * 2) - self.budget
        lower = best.batch_size if best.fits else first.batch_size
        step_down = _agree_min(max(lower + 1, candidate.batch_size - math.ceil(excess / slope) - 1), self.world)
        refined = self.run(step_down, "refine")
        if refined.fits:
            return self._bisect(refined, candidate.batch_size, fit)
        return self._bisect(self._best_fitting(), step_down, fit)

    def _bisect(self, good: Probe, bad: int, fit: dict[str, float]) -> BatchSizeResult:
        """Bounded binary search between a size that fitted and one that did not."""
        lo, hi = good, bad
        for _ in range(12):
            if hi - lo.batch_size <= max(1, lo.batch_size // 50):  # within 2%: stop spending steps
                break
            mid = _agree_min((lo.batch_size + hi) // 2, self.world)
            probe = self.run(mid, "search")
            if probe.fits:
                lo = probe
            else:
                hi = mid
        return self._result(lo, fit)

    def _fit(self, a: Probe, b: Probe) -> dict[str, float]:
        k = (b.forward_backward_peak - a.forward_backward_peak) / (b.batch_size - a.batch_size)
        fixed = b.forward_backward_peak - k * b.batch_size
        # The optimizer step's own peak, when it was the step's peak (else it hides below the line).
        opt_peak = max((p.peak_bytes for p in (a, b) if p.peak_bytes and p.peak_bytes > (p.forward_backward_peak or 0)), default=0)
        return {"fixed_bytes": float(fixed), "bytes_per_sample": float(k), "optimizer_peak": float(opt_peak)}

    def _predict(self, fit: dict[str, float], best: Probe, last: Probe) -> int:
        k = fit["bytes_per_sample"]
        if fit["optimizer_peak"] > self.budget:
            return 0
        if k <= 0:
            n = self.max_batch_size
        else:
            # A 1% safety margin for the first prediction: it is run before it is trusted, and the
            # refinement step then uses the slope measured over the long range.
            margin = 0.01 * self.budget
            n = int((self.budget - margin - fit["fixed_bytes"]) // k)
        return _agree_min(max(0, min(n, self.max_batch_size)), self.world)

    def _best_fitting(self) -> Probe:
        return max((p for p in self.probes if p.fits), key=lambda p: p.batch_size)

    def _result(self, best: Probe, fit: dict[str, float], cache_hit: bool = False) -> BatchSizeResult:
        best = max([best, *(p for p in self.probes if p.fits)], key=lambda p: p.batch_size)
        return BatchSizeResult(batch_size=best.batch_size, peak_bytes=best.peak_bytes or 0, budget=self.budget, mode=self.mode,
                               probes=list(self.probes), fit=fit, world_size=self.world, cache_hit=cache_hit)

    def _too_small_message(self, probe: Probe) -> str:
        need = format_bytes(probe.peak_bytes) if probe.peak_bytes else "more than the budget (out of memory)"
        return (f"budget={format_bytes(self.budget)} cannot hold one {self.mode} step at batch size {probe.batch_size}: "
                f"it needs {need}. {_next_rung(self.model, weights_dominate=False)}")


def _next_rung(model: nn.Module, *, weights_dominate: bool) -> str:
    from .ladder import next_rung

    record = record_of(model)
    if record is None:
        return "Prepare the model with a memory policy first, e.g. prepare_model(model, 'bf16+ckpt')."
    return next_rung(record.policy, num_blocks=len(record.blocks or ()), weights_dominate=weights_dominate)


def _resolve_budget(budget: int | str | None, device: torch.device) -> int:
    if budget is not None:
        return parse_bytes(budget, field="budget")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    raise ValueError(
        f"budget is required on {device.type}: there is no out-of-memory error to catch there (the operating system "
        "kills the process), so the measured peak is compared with a budget; pass budget='8GiB' (or bytes)"
    )


def _forward_only(model: nn.Module, batch: Any, optimizer: Any) -> None:
    with torch.no_grad():
        model(**batch) if isinstance(batch, Mapping) else model(batch)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if torch.is_tensor(batch):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _check_batch_size(batch: Any, n: int) -> None:
    tensors = _tensors(batch)
    if not tensors:
        raise ValueError(f"make_batch({n}) returned {type(batch).__name__} with no tensors; return a dict of tensors such as a collator does")
    wrong = [tuple(t.shape) for t in tensors if t.ndim == 0 or t.shape[0] != n]
    if wrong:
        raise ValueError(f"make_batch({n}) returned tensors of shapes {wrong}: their first dimension must be exactly {n}. "
                         "Build the batch from n samples (and pad to the longest sequence of the run)")


def _batch_signature(batch: Any) -> list[list[int]]:
    return [[str(t.dtype), *t.shape[1:]] for t in _tensors(batch)]


def _seq_len(batch: Any) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return int(ids.shape[1]) if torch.is_tensor(ids) and ids.ndim >= 2 else None


def _mark_batch_dynamic(batch: Any) -> None:
    for t in _tensors(batch):
        torch._dynamo.mark_dynamic(t, 0)


def _agree_all(ok: bool, world: int) -> bool:
    """True only if every rank says True (an all-reduce of the minimum: nobody waits on a failed rank)."""
    if world == 1:
        return ok
    t = torch.tensor([1 if ok else 0], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _agree_min(n: int, world: int) -> int:
    if world == 1:
        return n
    t = torch.tensor([n], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _apply_global_batch(result: BatchSizeResult, global_batch: int, world: int) -> None:
    per_step = result.batch_size * world
    result.global_batch_size = global_batch
    result.grad_accum = max(1, math.ceil(global_batch / per_step))
    result.exact_global_batch = result.grad_accum * per_step == global_batch
    if not result.exact_global_batch:
        exact = next((b for b in range(result.batch_size, 0, -1) if global_batch % (b * world) == 0), None)
        result.exact_batch_size = exact
        result.notes.append(
            f"global batch {global_batch} is not a multiple of {result.batch_size} x {world}: {result.grad_accum} accumulation "
            f"steps give {result.grad_accum * per_step}" + (f"; batch size {exact} with {global_batch // (exact * world)} steps matches exactly" if exact else ""))


def _cache_key(model: nn.Module, record: Any, optimizer: Any, signature: Any, mode: str, budget: int, world: int,
               device: torch.device) -> tuple[str, dict[str, Any]]:
    import transformers

    from ._version import __version__

    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    sig = {
        "model": config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else
        [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "policy": record.policy.to_dict() if record is not None else None,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "batch": signature, "mode": mode, "budget": budget, "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "versions": [torch.__version__, transformers.__version__, __version__],
    }
    return hashlib.sha256(json.dumps(sig, sort_keys=True, default=str).encode()).hexdigest()[:24], sig


class _Snapshot:
    """Copies (on the CPU, so the search does not double device memory) of everything a training
    step changes, written back in place afterwards: parameters, buffers, gradients, optimizer,
    scheduler and scaler state."""

    def __init__(self, model: nn.Module, optimizer: Any, scheduler: Any, grad_scaler: Any):
        self.model, self.optimizer, self.scheduler, self.grad_scaler = model, optimizer, scheduler, grad_scaler

    def __enter__(self) -> _Snapshot:
        self.tensors = [(t, t.detach().to("cpu", copy=True)) for t in [*self.model.parameters(), *self.model.buffers()]]
        self.grads = [(p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in self.model.parameters()]
        self.opt = _to_cpu(self.optimizer.state_dict()) if self.optimizer is not None else None
        self.sched = _to_cpu(self.scheduler.state_dict()) if self.scheduler is not None else None
        self.scaler = self.grad_scaler.state_dict() if self.grad_scaler is not None else None
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                t.copy_(saved)
            for p, g in self.grads:
                p.grad = None if g is None else g.to(p.device)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self.opt)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(self.sched)
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(self.scaler)


def _to_cpu(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj

