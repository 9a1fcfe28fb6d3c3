"""plan_policy: walk the ladder, cheapest rung first, and return the first policy whose estimated
peak fits the budget with a margin - with the table of every rung considered."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from ..policy import MemoryPolicy
from ..sizes import format_bytes, parse_bytes
from .estimate import MemoryEstimate, chunked_loss_problem, estimate_memory, infer_task, load_config
from .rungs import memory_rungs
from .weights_dtype import parse_dtype, resolve_weights_dtype

__all__ = ["Plan", "PlanRow", "plan_policy"]


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One rung the planner considered."""

    policy: str
    """The rung's policy string."""
    peak_bytes: int
    """Its estimated peak at the plan's batch size (batch 1 for ``batch_size="max"``)."""
    fits: bool
    """Under the budget minus the margin."""
    relative_speed: float
    """Step speed relative to eager fp32 (from the ladder benchmark)."""
    max_batch_size: int | None = None
    """With ``batch_size="max"``: the largest batch whose estimate fits."""
    traced: bool = True
    """False: not traced, because a rung before it with the same weights and optimizer state
    already held more than the budget in those alone (``peak_bytes`` is then that floor)."""
    interpolated: bool = False
    """A ``ckpt:N`` rung not traced: ``peak_bytes`` is read between the same policy without
    checkpointing and with every block checkpointed, by the share of blocks each holds, and lies
    far enough above the budget (see ``_SCREEN``) that the rung cannot fit."""
    bound_by: str = ""
    """Not traced: a later rung (``bound_by``) is the same policy saving strictly more (the chunked
    loss added, or selective checkpointing's alternate variant) and was over the budget:
    ``peak_bytes`` is that rung's peak, a lower bound of this one's."""


@dataclass(slots=True)
class Plan:
    """The cheapest policy that fits (None when nothing does), and every rung considered."""

    policy: MemoryPolicy | None
    batch_size: int
    budget: int
    rows: list[PlanRow] = field(default_factory=list)
    estimate: MemoryEstimate | None = None
    shortfall_bytes: int = 0
    suggestions: list[str] = field(default_factory=list)
    weights_dtype: str = "fp32"
    """The dtype every rung counted the weights at (see :attr:`MemoryEstimate.weights_dtype`)."""
    weights_dtype_source: str = ""

    @property
    def fits(self) -> bool:
        return self.policy is not None

    def table(self) -> str:
        lines = [
            "| policy | estimated peak | fits | relative speed |"
            + (" max batch |" if any(r.max_batch_size for r in self.rows) else ""),
            "|---|---|---|---|" + ("---|" if any(r.max_batch_size for r in self.rows) else ""),
        ]
        for r in self.rows:
            peak = (
                format_bytes(r.peak_bytes)
                if r.traced
                else f"~{format_bytes(r.peak_bytes)} (interpolated)"
                if r.interpolated
                else f">= {format_bytes(r.peak_bytes)} (as {r.bound_by})"
                if r.bound_by
                else f">= {format_bytes(r.peak_bytes)} (weights + optimizer state)"
            )
            line = f"| {r.policy} | {peak} | {'yes' if r.fits else 'no'} | {r.relative_speed:.2f}x |"
            if any(x.max_batch_size for x in self.rows):
                line += f" {r.max_batch_size or 0} |"
            lines.append(line)
        lines.append(
            f"\nweights counted in {self.weights_dtype} ({self.weights_dtype_source}); --dtype / dtype= to plan another load"
        )
        if self.fits:
            lines.append(
                f"choose: {self.policy.to_string()} at batch size {self.batch_size} (budget {format_bytes(self.budget)})"
            )
            lines += [f"  - {s}" for s in self.suggestions]
        else:
            lines.append(
                f"nothing fits {format_bytes(self.budget)}: short by {format_bytes(self.shortfall_bytes)} at best"
            )
            lines += [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy.to_string() if self.policy else None,
            "batch_size": self.batch_size,
            "budget": self.budget,
            "fits": self.fits,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "shortfall_bytes": self.shortfall_bytes,
            "suggestions": self.suggestions,
            "weights_dtype": self.weights_dtype,
            "weights_dtype_source": self.weights_dtype_source,
            "estimate": self.estimate.as_dict() if self.estimate else None,
        }


def plan_policy(
    model: Any,
    *,
    budget: int | str,
    seq_len: int,
    batch_size: int | Literal["max"] = 1,
    world_size: int = 1,
    margin: float = 0.1,
    task: str | None = None,
    device: str | None = None,
    trainable: Any = "all",
    step_in_backward: bool = True,
    dtype: Any = "auto",
    packed: bool = False,
) -> Plan:
    """The cheapest rung of the ladder whose estimated peak fits ``budget`` with ``margin``: plain
    mixed precision, then the chunked loss head (causal LMs), selective then block checkpointing,
    4-bit base weights (LoRA runs, where torchao is installed), the optimizer rungs (stepped in the
    backward, 8-bit moments where torchao is installed, both), offload, FSDP (see
    :func:`hf_memstack.planning.rungs.memory_rungs`).

    Args:
        model: hub id (local cache), local directory, config or model.
        budget: per-device memory, bytes or ``"80GiB"``.
        seq_len: tokens per sample.
        batch_size: per-device batch, or ``"max"``: the largest batch each rung fits (the first rung
            that fits at least one sample is chosen, at its largest batch, whose own estimate fits).
        world_size: devices; FSDP rungs are considered when > 1.
        margin: fraction of the budget kept free (allocator fragmentation, the CUDA context).
        task: ``causal-lm`` or ``classification``; default: from the model (see :func:`estimate_memory`).
        device: where it will train (``cuda``/``cpu``; default: this machine) - picks bf16, fp16 or fp32
            (``cuda`` on a machine without a GPU: bf16).
        trainable: what trains, as for :func:`estimate_memory` (``"all"``, ``"lora"``, a PEFT config, a dict);
            anything but ``"all"`` is a LoRA run, offered the 4-bit base weights rung (``quant:nf4``).
        step_in_backward: whether the optimizer may step inside the backward (``optim:in_backward``
            rungs); pass False when the training loop accumulates gradients, clips them by their
            global norm or averages them with DDP, none of which that rung can do.
        dtype: the weights' dtype, as for :func:`estimate_memory` (default ``"auto"``: what
            ``from_pretrained`` gives); every rung is estimated at it.
        packed: rows of ``seq_len`` tokens packed with several samples (see :func:`estimate_memory`).

    Returns:
        :class:`Plan`. When nothing fits: the shortfall, and what would (more ranks, shorter
        sequences, a smaller batch with gradient accumulation).
    """
    import torch

    from ..transforms.precision import resolve_precision

    budget_bytes = parse_bytes(budget, field="budget")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be a number in [0, 1), e.g. 0.1 (10% of the budget kept free)")
    if batch_size != "max" and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer or 'max'")
    usable = budget_bytes * (1 - margin)
    parse_dtype(dtype)  # a bad dtype= is refused before any work
    config = load_config(model)
    task = task or infer_task(model, config)
    # Resolved once from what was given (the estimates below get its config, which no longer says
    # where its weights are): every rung counts the same weights.
    weights = resolve_weights_dtype(model, config, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Planning a GPU run on a machine without one (a laptop, a CPU login node): bf16, as every GPU since Ampere runs.
    precision = (
        "bf16"
        if device.startswith("cuda") and not torch.cuda.is_available()
        else resolve_precision("auto", device).name
    )
    est = _Estimates(
        config,
        seq_len=seq_len,
        world_size=world_size,
        task=task,
        trainable=trainable,
        dtype=weights.dtype,
        packed=packed,
    )
    plan = Plan(
        policy=None,
        batch_size=0 if batch_size == "max" else batch_size,
        budget=budget_bytes,
        weights_dtype=weights.name,
        weights_dtype_source=weights.source,
    )
    shortfalls = []
    # The chunked-loss rungs only where prepare_model would accept loss:chunked (not BERT's LM head).
    chunked = task == "causal-lm" and chunked_loss_problem(config, task) is None
    torchao = importlib.util.find_spec("torchao") is not None
    rungs = memory_rungs(
        precision,
        num_blocks=_num_blocks(config),
        world_size=world_size,
        causal_lm=chunked,
        eightbit=torchao,
        step_in_backward=step_in_backward,
        quantize=torchao and not _trains_all(trainable),
        tiled_mlp=_tiles_help(config, seq_len * (1 if batch_size == "max" else batch_size)),
        pure_bf16=_trains_all(trainable),
    )
    floors: dict[str, int] = {}
    for i, rung in enumerate(rungs):
        bound = (
            None
            if floors.get(_states_key(rung.policy), 0) > usable
            else _bounded_by_next(est, rung, rungs[i + 1 :], batch_size, usable)
        )
        if bound is not None:
            plan.rows.append(bound)
            shortfalls.append(int(bound.peak_bytes - usable))
            continue
        row, fitted, e = _try_rung(est, rung, batch_size, usable, floors)
        plan.rows.append(row)
        shortfalls.append(int(row.peak_bytes - usable))
        if fitted >= 1 and e is not None:
            plan.policy, plan.batch_size, plan.estimate = MemoryPolicy.coerce(rung.policy), fitted, e
            plan.suggestions = [
                f"add compile ('{plan.policy.to_string()}+compile') for speed: it needs no more memory",
                *_optimizer_notes(plan.policy),
            ]
            return plan
    plan.shortfall_bytes = max(0, min(shortfalls))
    closest = min(plan.rows, key=lambda r: r.peak_bytes).policy if plan.rows else f"{precision}+ckpt"
    plan.suggestions = _suggestions(est, closest, batch_size, seq_len, world_size, usable)
    return plan


def _try_rung(
    est: _Estimates, rung: Any, batch_size: int | str, usable: float, floors: dict[str, int]
) -> tuple[PlanRow, int, MemoryEstimate | None]:
    """Estimate one rung (its largest batch, or the plan's), unless a rung before it with the same
    weights and optimizer state already held more than ``usable`` in those alone: what only saves
    activations (the loss head, checkpointing) cannot bring the peak below them. Big models then
    trace a handful of rungs instead of every one (a 7B LoRA base in fp32 is 25 GiB on each)."""
    key = _states_key(rung.policy)
    if floors.get(key, 0) > usable:
        return (
            PlanRow(
                rung.policy, floors[key], False, rung.relative_speed, 0 if batch_size == "max" else None, traced=False
            ),
            0,
            None,
        )
    if batch_size != "max":
        guess = _every_n_between(est, rung.policy, int(batch_size))
        if guess is not None and guess > _SCREEN * usable:
            return (
                PlanRow(rung.policy, guess, False, rung.relative_speed, None, traced=False, interpolated=True),
                0,
                None,
            )
    if batch_size == "max":
        fitted, e = _max_batch(est, rung.policy, usable)
    else:
        e = est(rung.policy, int(batch_size))
        fitted = int(batch_size) if e.peak_bytes <= usable else 0
    # Parameters and optimizer state are alive at every moment of a step, whatever saves activations.
    floors[key] = min(floors.get(key, e.parameters + e.optimizer), e.parameters + e.optimizer)
    return (
        PlanRow(rung.policy, e.peak_bytes, fitted >= 1, rung.relative_speed, fitted if batch_size == "max" else None),
        fitted,
        e,
    )


def _bounded_by_next(
    est: _Estimates, rung: Any, later: list[Any], batch_size: int | str, usable: float
) -> PlanRow | None:
    """A rung not traced when a later rung is the same policy saving strictly more, and that one is
    over the budget: its peak is then a lower bound of this one's. Two such pairs are on the ladder:
    adding the chunked loss (it only removes the logits and their fp32 copy), and selective
    checkpointing's alternate variant (it recomputes every second matmul that the plain one keeps,
    and keeps nothing the plain one drops). One to two traces fewer on every plan of a causal LM too
    large for its budget; the later rung is traced anyway, for its own row."""
    if batch_size == "max":
        return None
    p = MemoryPolicy.coerce(rung.policy)
    stronger = []
    if p.loss.mode == "default":
        stronger.append(MemoryPolicy.from_dict({**p.to_dict(), "loss": {"mode": "chunked"}}))
    if p.checkpointing.mode == "selective" and p.checkpointing.selective_matmuls == "save_all":
        stronger.append(
            MemoryPolicy.from_dict(
                {
                    **p.to_dict(),
                    "checkpointing": {**p.to_dict()["checkpointing"], "selective_matmuls": "save_alternate"},
                }
            )
        )
    bound = next((r for r in later if MemoryPolicy.coerce(r.policy) in stronger), None)
    if bound is None:
        return None
    e = est(bound.policy, int(batch_size))
    if e.peak_bytes <= usable:
        return None  # the stronger rung fits: this one is traced, as it comes first
    return PlanRow(rung.policy, e.peak_bytes, False, rung.relative_speed, None, traced=False, bound_by=bound.policy)


# A ckpt:N rung whose interpolated peak is this far above the budget is not traced (a ckpt:N trace
# holds 3N blocks, the others 3). On a 7B LoRA at 2,048 tokens the interpolation read 1.7-2.3% above
# the traced ckpt:2-4 peaks (bench/estimate_speed.py): 15% leaves a rung that could fit traced.
_SCREEN = 1.15


def _every_n_between(est: _Estimates, policy: str, batch_size: int) -> int | None:
    """A ``ckpt:N`` rung's peak read between the same policy without checkpointing (traced as an
    earlier rung: else None) and with every block checkpointed, by the share of blocks that keep
    their activations (Transformers checkpoints blocks 0, N, 2N...)."""
    p = MemoryPolicy.coerce(policy)
    if p.checkpointing.mode != "every_n":
        return None
    d = p.to_dict()
    try:
        plain = MemoryPolicy.from_dict({**d, "checkpointing": {"mode": "none"}}).to_string()
        full = MemoryPolicy.from_dict({**d, "checkpointing": {"mode": "full"}}).to_string()
    except ValueError:
        return None
    if not est.has(plain, batch_size):
        return None
    layers = _num_blocks(est.config)
    kept = layers - -(-layers // p.checkpointing.every_n)  # blocks not checkpointed
    none_peak, full_peak = est(plain, batch_size).peak_bytes, est(full, batch_size).peak_bytes
    return full_peak + (none_peak - full_peak) * kept // layers


def _states_key(policy: str) -> str:
    """What fixes the weights' and the optimizer's bytes: 4-bit base weights, the optimizer's state
    (fp32 or 8-bit moments), sharding, the master weights' dtype. Not when the optimizer steps: in
    the backward it frees each gradient sooner, and holds the same moments."""
    p = MemoryPolicy.coerce(policy)
    return repr((p.quant, p.optimizer.state, p.fsdp, p.master_weights))


class _Estimates:
    """Estimates for one model and job, each policy and batch size traced once."""

    def __init__(self, config: Any, **job: Any) -> None:
        self.config, self.job = config, job
        self.cache: dict[tuple[str, int], MemoryEstimate] = {}

    def __call__(self, policy: str, batch_size: int) -> MemoryEstimate:
        key = self._key(policy, batch_size)
        if key not in self.cache:
            self.cache[key] = estimate_memory(
                self.config, policy.replace("+compile", ""), batch_size=batch_size, **self.job
            )
        return self.cache[key]

    def has(self, policy: str, batch_size: int) -> bool:
        return self._key(policy, batch_size) in self.cache

    @staticmethod
    def _key(policy: str, batch_size: int) -> tuple[str, int]:
        # Compile is estimated as eager: rungs that differ only by compile share one trace; the
        # policy's own spelling, so bf16+loss:chunked+ckpt and bf16+ckpt+loss:chunked do too.
        return MemoryPolicy.coerce(policy.replace("+compile", "")).to_string(), batch_size


_MAX_TRACES = 16  # per rung: a linear peak needs 4 (batch 1, 2, the answer, the answer + 1)


def _max_batch(est: _Estimates, policy: str, usable: float) -> tuple[int, MemoryEstimate]:
    """The largest batch whose estimated peak fits ``usable`` - that batch fits and the next one
    does not - and its estimate (0 and batch 1's when none fits).

    The forward+backward peak grows about linearly with the batch, the optimizer step's does
    not (the finder's model): a line through the *total* peaks would mostly measure the fixed
    optimizer cost, so the next size is read off the forward+backward peaks; bisection takes over
    where the line misses. Stops when the answer's neighbour was estimated and does not fit.
    """
    points = {1: est(policy, 1)}
    if points[1].peak_bytes > usable:
        return 0, points[1]
    good, bad = 1, None
    for _ in range(_MAX_TRACES):
        if bad == good + 1:
            break
        size = _next_size(points, good, bad, usable)
        points[size] = est(policy, size)
        if points[size].peak_bytes <= usable:
            good = size
        else:
            bad = size
    return good, points[good]


def _next_size(points: dict[int, MemoryEstimate], good: int, bad: int | None, usable: float) -> int:
    """The next batch to estimate, strictly between ``good`` (fits) and ``bad`` (does not; None: none
    seen yet): where the line through the forward+backward peaks of the two nearest sizes reaches
    ``usable``; the midpoint when that line points outside the bracket."""
    if len(points) == 1:
        return 2
    lo = max(b for b in points if b < good) if bad is None else good
    hi = good if bad is None else bad
    slope = (points[hi].forward_backward_peak - points[lo].forward_backward_peak) / (hi - lo)
    if bad is None:
        if slope <= 0:  # nothing grows with the batch here: look further out
            return good * 2
        reach = good + int((usable - points[good].forward_backward_peak) // slope)
        return min(max(reach, good + 1), good * 64)
    reach = good + int((usable - points[good].forward_backward_peak) // slope) if slope > 0 else good
    return reach if good < reach < bad else (good + bad) // 2


def _trains_all(trainable: Any) -> bool:
    return isinstance(trainable, str) and trainable == "all"


def _optimizer_notes(policy: MemoryPolicy) -> list[str]:
    notes = []
    if policy.quant.mode == "nf4":
        notes.append(
            "quant:nf4 keeps the blocks' frozen linear weights in 4 bits (torchao's NF4, about 4.1 bits each): the "
            "adapters train on the rounded weights; save the adapters, and merge them into a 16-bit model with "
            "hf_memstack.merge_adapters"
        )
    if policy.optimizer != MemoryPolicy().optimizer or policy.master_weights == "bf16":
        notes.append(
            "build the optimizer with hf_memstack.make_optimizer(model, lr=...): it follows the policy's optimizer rung"
        )
    if policy.optimizer.step == "in_backward":
        notes.append(
            "optim:in_backward updates each parameter inside the backward: no gradient accumulation and no "
            "global-norm clipping (make_optimizer refuses them)"
        )
    if policy.optimizer.state == "8bit":
        notes.append(
            "optim:8bit keeps AdamW's moments in 8 bits (torchao): slightly different updates, a slower step on CPUs"
        )
    if policy.master_weights == "bf16":
        notes.append(
            "weights:bf16 trains pure bf16 (weights, gradients and moments; hf_memstack's BF16AdamW with stochastic rounding, "
            "so that updates below bf16's resolution survive in expectation): 8 bytes per trainable parameter instead "
            "of 16; see bench/optimizer_curves.py for its loss curve beside fp32 master weights"
        )
    return notes


def _tiles_help(config: Any, tokens: int) -> bool:
    """A step's tokens span more than one MLP tile (the mlp:tiled rung then saves memory)."""
    from ..transforms.tiled_mlp import auto_tile_tokens

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    experts = any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return bool(hidden) and not experts and tokens > auto_tile_tokens(hidden)


def _num_blocks(config: Any) -> int:
    return int(
        getattr(config, "num_hidden_layers", None)
        or getattr(config, "n_layer", None)
        or getattr(config, "num_layers", 4)
    )


def _suggestions(est: Any, closest: str, batch_size: Any, seq_len: int, world_size: int, usable: float) -> list[str]:
    """What would make ``closest`` (the rung that came nearest to fitting) fit: more ranks for its
    model states, a smaller batch, a shorter sequence - with numbers from its batch-1 estimate."""
    base = est(closest, 1)
    states = base.parameters + base.gradients + base.optimizer
    activations = base.peak_bytes - states
    out = []
    ranks = max(2, world_size * 2)
    while ranks <= 4096 and states / ranks + activations > usable:
        ranks *= 2
    if ranks <= 4096:
        out.append(
            f"more ranks: FSDP over about {ranks} devices shards the {format_bytes(states)} of parameters, gradients and "
            f"optimizer state of {closest}"
        )
    else:  # what is not sharded (the activations) alone exceeds the budget: more ranks cannot help
        out.append(
            f"the activations alone ({format_bytes(activations)} at batch 1) exceed the budget: more ranks "
            "do not shard them"
        )
    if isinstance(batch_size, int) and batch_size > 1:
        out.append(
            f"a smaller batch with gradient accumulation: batch 1 x {batch_size} accumulation steps keeps the global batch"
        )
    shorter = _shorter_sequence(est, closest, base, seq_len, usable)
    if shorter is not None:
        out.append(
            f"a shorter sequence: {shorter.seq_len} tokens instead of {seq_len} fits at batch 1 with {closest} "
            f"(estimated peak {format_bytes(shorter.peak_bytes)})"
        )
    else:
        out.append(f"a shorter sequence than {seq_len} (activations grow linearly with it)")
    return out


def _shorter_sequence(
    est: _Estimates, policy: str, full: MemoryEstimate, seq_len: int, usable: float
) -> MemoryEstimate | None:
    """The estimate of the longest sequence (a multiple of 64, or of 8 below 256) that fits at
    batch 1, found on the line through the forward+backward peaks at ``seq_len`` and half of it
    (the optimizer step's peak does not depend on the sequence), then confirmed by estimating it;
    None when the line finds none or three tries do not fit."""
    if seq_len < 16:
        return None
    half = _Estimates(est.config, **{**est.job, "seq_len": seq_len // 2})(policy, 1)
    slope = (full.forward_backward_peak - half.forward_backward_peak) / (seq_len - seq_len // 2)
    if slope <= 0:
        return None
    tokens = int((usable - (full.forward_backward_peak - slope * seq_len)) / slope)
    for _ in range(3):
        tokens = min(tokens, seq_len - 1)
        tokens = tokens // 64 * 64 if tokens >= 256 else tokens // 8 * 8
        if tokens < 8:
            return None
        guess = _Estimates(est.config, **{**est.job, "seq_len": tokens})(policy, 1)
        if guess.peak_bytes <= usable:
            return guess
        tokens = int(tokens * 0.9)
    return None
