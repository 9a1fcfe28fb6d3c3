"""The planner's walk down the ladder: each rung estimated (or bounded by a stronger one, or by the
weights and optimizer state a rung before it already held over the budget) until one fits; then,
when a model-state saving is what made it fit, the faster activation rungs tried with that saving."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...policy import MemoryPolicy
from ..estimate.result import MemoryEstimate
from .advice import optimizer_notes
from .estimates import Estimates, max_batch
from .result import Plan, PlanRow
from .rungs import Rung, savings_speed, sharding_speed
from .screen import SCREEN, SCREEN_BELOW, every_n_between

__all__ = ["choose", "walk_rungs"]


def walk_rungs(
    plan: Plan, est: Estimates, rungs: list[Rung], batch_size: int | Literal["max"], usable: float
) -> list[int]:
    """Add a row to ``plan`` for each rung until one fits (then ``plan`` holds it, its batch, its
    estimate and the notes on running it); each row's bytes over ``usable``."""
    shortfalls: list[int] = []
    traced_states: dict[str, int] = {}  # _states_key -> the fewest bytes its weights and optimizer held in a trace
    all_over_by_states = True  # every rung so far held more than usable in weights and moments alone
    for i, rung in enumerate(rungs):
        states_fit = _states_bytes(est, rung.policy, traced_states) <= usable
        if i and all_over_by_states and states_fit and _saves_states(rung.policy):
            # The first rung whose model states fit, and a saving of them is why: the lighter
            # activation rungs before it, with that saving, are searched at once (the rung itself the
            # last of them) - tracing it first would spend an estimate on the slowest candidate.
            found = _faster_with_its_states(plan, est, rungs[:i], rung, batch_size, usable, traced_states, traced=False)
            if found is not None:
                choose(plan, *found)
                break
            shortfalls += [int(r.peak_bytes - usable) for r in plan.rows[len(shortfalls) :]]
            all_over_by_states = False
            continue
        bound = _bounded_by_next(est, rung, rungs[i + 1 :], batch_size, usable) if states_fit else None
        if bound is not None:
            plan.rows.append(bound)
            shortfalls.append(int(bound.peak_bytes - usable))
            all_over_by_states = False
            continue
        row, fitted, estimate = _try_rung(est, rung, batch_size, usable, traced_states)
        plan.rows.append(row)
        shortfalls.append(int(row.peak_bytes - usable))
        all_over_by_states = all_over_by_states and not (row.traced or row.interpolated)
        if fitted >= 1 and estimate is not None:
            choose(
                plan,
                *(
                    _faster_with_its_states(plan, est, rungs[:i], rung, batch_size, usable, traced_states, traced=True)
                    or (rung.policy, fitted, estimate)
                ),
            )
            break
    return shortfalls


def choose(plan: Plan, policy: str, fitted: int, estimate: MemoryEstimate) -> None:
    plan.policy, plan.batch_size, plan.estimate = MemoryPolicy.coerce(policy), fitted, estimate
    plan.suggestions = [
        f"add compile ('{plan.policy.to_string()}+compile') for speed: it needs no more memory",
        *optimizer_notes(plan.policy),
    ]


def _saves_states(policy: str) -> bool:
    p = MemoryPolicy.coerce(policy)
    return (p.quant.mode, p.optimizer.state, p.optimizer.step, p.master_weights) != (
        "none",
        "fp32",
        "after_backward",
        "fp32",
    )


def _faster_with_its_states(
    plan: Plan,
    est: Estimates,
    before: list[Rung],
    fitting: Rung,
    batch_size: int | Literal["max"],
    usable: float,
    traced_states: dict[str, int],
    *,
    traced: bool,
) -> tuple[str, int, MemoryEstimate] | None:
    """A faster policy than ``fitting`` when a model-state saving of it (4-bit base weights, the
    optimizer rungs, pure bf16) is what lets it fit: the ladder reaches those only after its
    heaviest activation rung, yet with the states smaller a lighter one may fit too (a full
    fine-tune whose walk reaches ``ckpt+mlp:tiled+weights:bf16`` may fit ``ckpt:4+weights:bf16``).
    The earlier rungs, faster than it, with its state savings added are the candidates - and,
    when ``fitting`` was not ``traced`` (it is then not known to fit), ``fitting`` itself, last.
    The rows traced are appended to ``plan``'s; the fastest that fits is returned (policy, batch,
    estimate)."""
    target = MemoryPolicy.coerce(fitting.policy)
    # Sharding saves states too: a target sharded without offload lends its sharding to the faster
    # rungs (ckpt:4+fsdp where the walk reached ckpt+fsdp); an offloading one lends none (it is the
    # slowest rung), and the plain FSDP rung before it is a candidate of its own.
    # sp:N lends its degree too (ckpt+sp:2 fits: ckpt:4+sp:2 may), to a rung without one (sp:2 with 4-bit weights may fit).
    lent = ("quant", "optimizer", "master_weights", "sequence_parallel") + (
        ("fsdp",) if target.fsdp.mode != "none" and not target.fsdp.cpu_offload else ()
    )
    tried_before = {row.policy for row in plan.rows}  # traced, or over by its states or its bounds already: did not fit
    rows = {row.policy: row for row in plan.rows}
    seen: set[str] = set()
    candidates = []
    for rung in before:
        p = MemoryPolicy.coerce(rung.policy)
        if p.checkpointing.mode == "offload" or p.fsdp.cpu_offload:
            continue
        try:
            own = {"sequence_parallel"} if p.sequence_parallel.size > 1 else set()
            merged = MemoryPolicy.from_dict({**p.to_dict(), **{k: target.to_dict()[k] for k in lent if k not in own}})
        except ValueError:  # a combination the policy refuses is no candidate
            continue
        if merged == p or merged.to_string() in tried_before:
            continue
        # The savings it takes on (the merged policy's), not the target's: an offloading target lends no sharding.
        speed = rung.relative_speed * _states_speed(merged) / _states_speed(p)
        if speed > fitting.relative_speed and merged.to_string() not in seen:
            seen.add(merged.to_string())
            screened = _screened_4bit_row(
                rows.get(rung.policy), merged.to_string(), speed, traced_states, batch_size, usable
            )
            if screened is not None:
                plan.rows.append(screened)  # far over the budget by the rung's own peak: not traced
            else:
                candidates.append(_Candidate(merged.to_string(), speed))
    if not traced:
        candidates.append(_Candidate(fitting.policy, fitting.relative_speed))
    tried = _search(est, candidates, batch_size, usable, traced_states)
    plan.rows += [tried[k][0] for k in sorted(tried)]
    fits = [k for k, (_, fitted, estimate) in tried.items() if fitted >= 1 and estimate is not None]
    if not fits:
        return None
    best = max(fits, key=lambda k: candidates[k].relative_speed)
    _, fitted, estimate = tried[best]
    assert estimate is not None  # in fits
    return candidates[best].policy, fitted, estimate


def _screened_4bit_row(
    row: PlanRow | None,
    policy: str,
    speed: float,
    traced_states: dict[str, int],
    batch_size: int | Literal["max"],
    usable: float,
) -> PlanRow | None:
    """A candidate's row without a trace, when the walk's row of its rung (``row``: traced, read
    between its neighbours or bounded) less the weights its 4-bit base removes (the difference of
    the bytes the two states held in their traces) is far over the budget (``SCREEN``): the activations do not
    depend on how the frozen weights are stored, so every phase's peak shifts by that difference (a
    large LoRA base at a small budget: its ``ckpt:4`` row less the 4-bit saving is still far over,
    so ``ckpt:4+quant:nf4`` is not traced). None: traced as usual."""
    if row is None or batch_size == "max" or not (row.traced or row.interpolated or row.bound_by):
        return None
    traced, candidate = MemoryPolicy.coerce(row.policy).to_dict(), MemoryPolicy.coerce(policy).to_dict()
    if {k for k in traced if traced[k] != candidate[k]} != {"quant"}:
        # Only 4-bit base weights shift every phase by their bytes alone: they are frozen (no
        # gradient, no moments). Pure bf16 or 8-bit moments also shrink gradients or the step's
        # scratch, which the traced states' bytes do not hold.
        return None
    before, after = traced_states.get(_states_key(row.policy)), traced_states.get(_states_key(policy))
    if before is None or after is None or after > before:
        return None
    guess = row.peak_bytes - (before - after)
    if guess <= SCREEN * usable:
        return None
    return PlanRow(policy, guess, False, speed, None, traced=False, shifted_from=row.policy)


def _states_speed(policy: MemoryPolicy) -> float:
    """The speed factor of a policy's state savings, its sharding (FSDP's, sp:N's) included (``MEASURED_SPEED``)."""
    return savings_speed(policy) * sharding_speed(policy)


def _search(
    est: Estimates,
    candidates: list[_Candidate],
    batch_size: int | Literal["max"],
    usable: float,
    traced_states: dict[str, int],
) -> dict[int, tuple[PlanRow, int, MemoryEstimate | None]]:
    """The candidates traced to find the fastest that fits, each ``_try_rung``'s answer by index.

    The fastest candidate is traced first. A candidate that misses rules out every one that saves
    no more activation memory than it (:func:`_saves_no_more`); one that fits rules out every slower
    one (the rows of those ruled out by a miss read its peak, ``bound_by``). A state saving usually
    frees enough for a light rung, and then one or two traces answer (the chunked loss alone misses,
    ckpt:4 fits). When the fastest misses by more than a third of what it
    holds above its weights and optimizer state (:data:`DEEP`), the light rungs seldom fit, and the
    rest are traced slowest first: the slowest (full checkpointing) then lets a ``ckpt:N`` rung be
    read between two traces, and a strong rung that misses rules out the weaker ones of its kind
    (ckpt:2 rules out ckpt:3 and ckpt:4, the alternate-matmul selective rung the plain one). Either order
    ends at the same answer - the fastest candidate that fits, of those not screened - and only a
    traced candidate that fits is chosen: a wrong screen costs speed, never a fit.
    """
    tried: dict[int, tuple[PlanRow, int, MemoryEstimate | None]] = {}
    left = list(range(len(candidates)))
    policies = [MemoryPolicy.coerce(c.policy) for c in candidates]
    slowest_first = False
    while left:
        pick = min if slowest_first else max
        k = pick(left, key=lambda j: (candidates[j].relative_speed, -j))
        first = not tried
        row, fitted, estimate = tried[k] = _try_rung(
            est, candidates[k], batch_size, usable, traced_states, trace_full=False
        )
        if fitted >= 1:
            left = [j for j in left if candidates[j].relative_speed > candidates[k].relative_speed]
            continue
        ruled_out = [j for j in left if j != k and _saves_no_more(policies[j], policies[k])]
        for j in ruled_out:  # their rows read the stronger rung's peak, a lower bound of theirs
            tried[j] = (
                PlanRow(
                    candidates[j].policy,
                    row.peak_bytes,
                    False,
                    candidates[j].relative_speed,
                    0 if batch_size == "max" else None,
                    traced=False,
                    bound_by=candidates[k].policy,
                ),
                0,
                None,
            )
        left = [j for j in left if j != k and j not in ruled_out]
        if first and estimate is not None:
            above_states = estimate.peak_bytes - (estimate.parameters + estimate.optimizer)
            slowest_first = above_states > 0 and estimate.peak_bytes - usable > DEEP * above_states
    return tried


# The share of the fastest candidate's bytes above its weights and optimizer state that must go for
# the search to trace slowest first. A ckpt:N rung checkpoints one block in N, so it removes at most
# 1/N of them: past a third, ckpt:3 and ckpt:4 cannot fit, and the light rungs left (selective
# checkpointing keeps every matmul's output; ckpt:2) seldom do. In bench/estimate_speed.py's plans the
# deep misses (the 7B and 70B LoRA with 4-bit weights at 12 and 80 GiB) were about half of those bytes,
# the near one (the Qwen2-1.5B shape at 16 GiB with pure bf16) a few percent.
DEEP = 1 / 3


def _saves_no_more(a: MemoryPolicy, b: MemoryPolicy) -> bool:
    """Whether ``a`` saves no more activation memory than ``b``, both the same policy but for how
    they checkpoint, tile and compute the loss (else False: not known), by what each recomputes
    (and the model's own loss saves no more than the chunked one): no checkpointing saves least, every block
    checkpointed most; ckpt:N checkpoints fewer blocks the larger N; selective's alternate variant
    recomputes what the plain one keeps; tiling saves more. Selective against ckpt:N is not known
    (it depends on the model), and neither rules out the other."""
    rest_a, rest_b = a.to_dict(), b.to_dict()
    for field in ("checkpointing", "mlp", "loss"):
        rest_a.pop(field), rest_b.pop(field)
    if rest_a != rest_b:  # other savings (sharding, 4-bit weights, ...): not comparable this way
        return False
    if a.mlp.mode == "tiled" and b.mlp.mode != "tiled":
        return False
    if a.loss != b.loss and not (a.loss.mode == "default" and b.loss.mode == "chunked"):
        return False  # the chunked loss only removes the logits and their fp32 copy
    ca, cb = a.checkpointing, b.checkpointing
    if ca == cb or ca.mode == "none" or cb.mode == "full":
        return True
    if ca.mode == cb.mode == "every_n":
        return ca.every_n >= cb.every_n
    if ca.mode == cb.mode == "selective":
        return ca.selective_matmuls == "save_all"
    return False


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A lighter rung with a fitting rung's state savings: what :func:`_try_rung` reads of a rung."""

    policy: str
    relative_speed: float


def _states_bytes(est: Estimates, policy: str, traced_states: dict[str, int]) -> int:
    """The bytes a rung's weights and optimizer moments hold at every moment of its step: those a
    traced rung with the same states held (``traced_states``), or the count of the parameters without a
    trace (:meth:`Estimates.states_floor`, a lower bound), whichever is more."""
    counted = est.states_floor(policy)
    return max(traced_states.get(_states_key(policy), 0), counted or 0)


def _try_rung(
    est: Estimates,
    rung: Rung | _Candidate,
    batch_size: int | Literal["max"],
    usable: float,
    traced_states: dict[str, int],
    *,
    trace_full: bool = True,
) -> tuple[PlanRow, int, MemoryEstimate | None]:
    """Estimate one rung (its largest batch, or the plan's), unless its weights and optimizer state
    alone hold more than ``usable`` (:func:`_states_bytes`): what only saves activations (the loss head,
    checkpointing) cannot bring the peak below them. Big models then trace a handful of rungs
    instead of every one (a 7B LoRA base in fp32 holds 7e9 x 4 bytes of weights on each). A ``ckpt:N`` rung is read
    between its neighbours first (:func:`every_n_between`) and not traced when that reading is far
    over the budget. ``trace_full``: when its states' bytes do not rule it out, trace full
    checkpointing for a closer reading - on the walk that rung comes later anyway, and its 5-block
    traces cost less than the ``3N`` blocks of the ``ckpt:N`` ones it may screen out; a search
    (:func:`_search`) traces the ``ckpt:N`` rung instead, as it would stop at full checkpointing
    only when every faster candidate missed."""
    key = _states_key(rung.policy)
    states_bytes = _states_bytes(est, rung.policy, traced_states)
    if states_bytes > usable:
        return (
            PlanRow(
                rung.policy, states_bytes, False, rung.relative_speed, 0 if batch_size == "max" else None, traced=False
            ),
            0,
            None,
        )
    if batch_size != "max":
        for full in (False, True) if trace_full else (False,):
            guess = every_n_between(est, rung.policy, int(batch_size), states_bytes, trace_full=full)
            if guess is not None and guess[0] > (SCREEN_BELOW if guess[1] else SCREEN) * usable:
                return (
                    PlanRow(
                        rung.policy,
                        guess[0],
                        False,
                        rung.relative_speed,
                        None,
                        traced=False,
                        interpolated=True,
                        below=guess[1],
                    ),
                    0,
                    None,
                )
    if batch_size == "max":
        fitted, estimate = max_batch(est, rung.policy, usable)
    else:
        estimate = est(rung.policy, int(batch_size))
        fitted = int(batch_size) if estimate.peak_bytes <= usable else 0
    # Parameters and optimizer state are alive at every moment of a step, whatever saves activations.
    traced_states[key] = min(
        traced_states.get(key, estimate.parameters + estimate.optimizer), estimate.parameters + estimate.optimizer
    )
    return (
        PlanRow(
            rung.policy, estimate.peak_bytes, fitted >= 1, rung.relative_speed, fitted if batch_size == "max" else None
        ),
        fitted,
        estimate,
    )


def _bounded_by_next(
    est: Estimates, rung: Rung, later: list[Rung], batch_size: int | Literal["max"], usable: float
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
    estimate = est(bound.policy, int(batch_size))
    if estimate.peak_bytes <= usable:
        return None  # the stronger rung fits: this one is traced, as it comes first
    return PlanRow(
        rung.policy, estimate.peak_bytes, False, rung.relative_speed, None, traced=False, bound_by=bound.policy
    )


def _states_key(policy: str) -> str:
    """What fixes the weights' and the optimizer's bytes: 4-bit base weights, the optimizer's state
    (fp32 or 8-bit moments), sharding, the master weights' dtype, and when the optimizer steps: the
    same moments either way, but a traced step's optimizer bytes hold its scratch too, and PyTorch's
    foreach step on CUDA (after the backward) holds a copy of every second moment, where a step in
    the backward updates one parameter at a time."""
    p = MemoryPolicy.coerce(policy)
    return repr((p.quant, p.optimizer.state, p.optimizer.step, p.fsdp, p.master_weights))
