"""The planner's walk down the ladder: each rung estimated (or bounded by a stronger one, or by the
weights and optimizer state a rung before it already held over the budget) until one fits; then,
when a model-state saving is what made it fit, the faster activation rungs tried with that saving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..policy import MemoryPolicy
from .memory_estimate import MemoryEstimate
from .plan import Plan, PlanRow
from .plan_advice import optimizer_notes
from .plan_estimates import Estimates, max_batch
from .rungs import MEASURED_SPEED

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["num_blocks", "walk_rungs"]


def walk_rungs(
    plan: Plan, est: Estimates, rungs: list[Any], batch_size: int | Literal["max"], usable: float
) -> list[int]:
    """Add a row to ``plan`` for each rung until one fits (then ``plan`` holds it, its batch, its
    estimate and the notes on running it); each row's bytes over ``usable``."""
    shortfalls = []
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
            chosen, fitted, e = _faster_with_its_states(plan, est, rungs[:i], rung, batch_size, usable, floors) or (
                rung.policy,
                fitted,
                e,
            )
            plan.policy, plan.batch_size, plan.estimate = MemoryPolicy.coerce(chosen), fitted, e
            plan.suggestions = [
                f"add compile ('{plan.policy.to_string()}+compile') for speed: it needs no more memory",
                *optimizer_notes(plan.policy),
            ]
            break
    return shortfalls


def _faster_with_its_states(
    plan: Plan,
    est: Estimates,
    before: list[Any],
    fitting: Any,
    batch_size: int | Literal["max"],
    usable: float,
    floors: dict[str, int],
) -> tuple[str, int, MemoryEstimate] | None:
    """A faster policy than the first rung that fits, when that rung fits by a model-state saving
    (4-bit base weights, the optimizer rungs, pure bf16): the ladder reaches those only after its
    heaviest activation rung, yet with the states smaller a lighter one may fit too (Qwen2-1.5B at
    16 GiB: ``ckpt:selective+weights:bf16`` where the walk reached ``ckpt+mlp:tiled+weights:bf16``).
    The earlier rungs, faster than it, with its state savings added are the candidates; the rows
    traced are appended to ``plan``'s and the earliest that fits returned (policy, batch, estimate)."""
    target = MemoryPolicy.coerce(fitting.policy)
    factor = _state_speed(target)
    seen: set[str] = set()
    candidates = []
    for rung in before:
        p = MemoryPolicy.coerce(rung.policy)
        if p.checkpointing.mode == "offload" or p.fsdp.mode != "none":
            continue
        try:
            merged = MemoryPolicy.from_dict(
                {**p.to_dict(), **{k: target.to_dict()[k] for k in ("quant", "optimizer", "master_weights")}}
            )
        except ValueError:  # a combination the policy refuses is no candidate
            continue
        if merged == p:
            continue
        speed = rung.relative_speed * factor / _state_speed(p)
        if speed > fitting.relative_speed and merged.to_string() not in seen:
            seen.add(merged.to_string())
            candidates.append(_Candidate(merged.to_string(), speed))
    # The earliest that fits, by bisection: down the ladder each rung saves more activation memory
    # than the one before it (the order the walk relies on too), so a few traces instead of one a
    # candidate; then the fastest from there on (the ladder's order is not quite its speed's: ckpt:4
    # runs faster than ckpt:selective before it), one trace more. Only a traced candidate that fits is
    # chosen, the fastest of those: a wrong guess costs speed, never a fit.
    lo, hi, earliest = 0, len(candidates) - 1, len(candidates)
    tried: dict[int, tuple[PlanRow, int, MemoryEstimate | None]] = {}
    while lo <= hi:
        mid = (lo + hi) // 2
        tried[mid] = _try_rung(est, candidates[mid], batch_size, usable, floors)
        if tried[mid][1] >= 1:
            earliest, hi = mid, mid - 1
        else:
            lo = mid + 1
    if earliest < len(candidates):
        fastest = max(range(earliest, len(candidates)), key=lambda k: candidates[k].relative_speed)
        if fastest not in tried:
            tried[fastest] = _try_rung(est, candidates[fastest], batch_size, usable, floors)
    plan.rows += [tried[k][0] for k in sorted(tried)]
    fits = [k for k, (_, fitted, e) in tried.items() if fitted >= 1 and e is not None]
    if not fits:
        return None
    best = max(fits, key=lambda k: candidates[k].relative_speed)
    _, fitted, e = tried[best]
    assert e is not None  # in fits
    return candidates[best].policy, fitted, e


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A lighter rung with a fitting rung's state savings: what :func:`_try_rung` reads of a rung."""

    policy: str
    relative_speed: float


def _state_speed(policy: MemoryPolicy) -> float:
    """The speed factors of a policy's model-state savings (``MEASURED_SPEED``), multiplied."""
    s = MEASURED_SPEED
    factor = s["quant"] if policy.quant.mode != "none" else 1.0
    factor *= s["8bit"] if policy.optimizer.state == "8bit" else 1.0
    factor *= s["in_backward"] if policy.optimizer.step == "in_backward" else 1.0
    return factor * (s["pure_bf16"] if policy.master_weights == "bf16" else 1.0)


def _try_rung(
    est: Estimates, rung: Any, batch_size: int | Literal["max"], usable: float, floors: dict[str, int]
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
        fitted, e = max_batch(est, rung.policy, usable)
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
    est: Estimates, rung: Any, later: list[Any], batch_size: int | Literal["max"], usable: float
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


def _every_n_between(est: Estimates, policy: str, batch_size: int) -> int | None:
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
    layers = num_blocks(est.config)
    kept = layers - -(-layers // p.checkpointing.every_n)  # blocks not checkpointed
    none_peak, full_peak = est(plain, batch_size).peak_bytes, est(full, batch_size).peak_bytes
    return full_peak + (none_peak - full_peak) * kept // layers


def _states_key(policy: str) -> str:
    """What fixes the weights' and the optimizer's bytes: 4-bit base weights, the optimizer's state
    (fp32 or 8-bit moments), sharding, the master weights' dtype. Not when the optimizer steps: in
    the backward it frees each gradient sooner, and holds the same moments."""
    p = MemoryPolicy.coerce(policy)
    return repr((p.quant, p.optimizer.state, p.fsdp, p.master_weights))


def num_blocks(config: PretrainedConfig) -> int:
    return int(
        getattr(config, "num_hidden_layers", 0)  # 0 and None alike: not set, try the next name
        or getattr(config, "n_layer", 0)
        or getattr(config, "num_layers", 4)
    )
