"""plan_policy: walk the ladder, cheapest rung first, and return the first policy whose estimated
peak fits the budget with a margin - with the table of every rung considered."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..policy import MemoryPolicy
from ..sizes import parse_bytes
from .estimate_checks import chunked_loss_problem
from .memory_estimate import MemoryEstimate
from .model_config import infer_task, load_config
from .plan import Plan, PlanRow
from .plan_advice import optimizer_notes, suggestions
from .plan_estimates import Estimates, max_batch
from .rungs import MEASURED_SPEED, Requirement, RungContext, rungs_for
from .weights_dtype import parse_dtype, resolve_weights_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Plan", "PlanRow", "plan_policy"]


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
    :data:`hf_memstack.planning.rungs.STEPS`).

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
    budget_bytes = _check_plan_args(budget, margin, batch_size)
    usable = budget_bytes * (1 - margin)
    parse_dtype(dtype)  # a bad dtype= is refused before any work
    config = load_config(model)
    task = task or infer_task(model, config)
    # Resolved once from what was given (the estimates below get its config, which no longer says
    # where its weights are): every rung counts the same weights.
    weights = resolve_weights_dtype(model, config, dtype)
    precision = _planned_precision(device, weights.dtype, trainable)
    est = Estimates(
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
    rungs = _ladder(config, task, precision, seq_len, batch_size, world_size, trainable, step_in_backward)
    shortfalls = _walk_rungs(plan, est, rungs, batch_size, usable)
    if plan.fits:
        return plan
    plan.shortfall_bytes = max(0, min(shortfalls))
    closest = min(plan.rows, key=lambda r: r.peak_bytes).policy if plan.rows else f"{precision}+ckpt"
    plan.suggestions = suggestions(est, closest, batch_size, seq_len, world_size, usable)
    return plan


def _check_plan_args(budget: int | str, margin: float, batch_size: Any) -> int:
    """The budget in bytes, once ``margin`` and ``batch_size`` are known to be usable."""
    budget_bytes = parse_bytes(budget, field="budget")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be a number in [0, 1), e.g. 0.1 (10% of the budget kept free)")
    if batch_size != "max" and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer or 'max'")
    return budget_bytes


def _planned_precision(device: str | None, weights_dtype: Any, trainable: Any) -> str:
    """The mixed precision the run would get on ``device`` (default: this machine)."""
    import torch

    from ..transforms.precision import resolve_precision

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Planning a GPU run on a machine without one (a laptop, a CPU login node): bf16, as every GPU since Ampere runs.
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "bf16"
    name = resolve_precision("auto", device).name
    # fp32 (a CPU without native bf16) over a 16-bit full fine-tune is plain AdamW over the 16-bit
    # weights - prepare_model leaves them as loaded without autocast - and updates below their
    # resolution are lost. bf16 makes fp32 master weights (or pure bf16 with stochastic rounding):
    # slower on such a CPU, but it trains.
    if name == "fp32" and trainable == "all" and weights_dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return name


def _ladder(
    config: PretrainedConfig,
    task: str,
    precision: str,
    seq_len: int,
    batch_size: int | Literal["max"],
    world_size: int,
    trainable: Any,
    step_in_backward: bool,
) -> list[Any]:
    """The memory rungs this model and job can take, cheapest first."""
    # The chunked-loss rungs only where prepare_model would accept loss:chunked (not BERT's LM head).
    chunked = task == "causal-lm" and chunked_loss_problem(config, task) is None
    torchao = importlib.util.find_spec("torchao") is not None
    tokens = seq_len * (1 if batch_size == "max" else int(batch_size))
    facts = {
        Requirement.CAUSAL_LM: chunked,
        Requirement.TORCHAO: torchao,
        Requirement.LORA_WITH_TORCHAO: torchao and not _trains_all(trainable),
        Requirement.STEP_IN_BACKWARD: step_in_backward,
        Requirement.TOKENS_OVER_ONE_TILE: _tiles_help(config, tokens),
        Requirement.FULL_FINETUNE: _trains_all(trainable),
        Requirement.SEVERAL_DEVICES: world_size > 1,
    }
    satisfied = frozenset(r for r, holds in facts.items() if holds)
    return rungs_for(RungContext(precision, _num_blocks(config), satisfied))


def _walk_rungs(
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
    # candidate. A candidate is chosen only once traced and fitting: a wrong guess costs speed, never a fit.
    lo, hi, best = 0, len(candidates) - 1, None
    tried: dict[int, PlanRow] = {}
    while lo <= hi:
        mid = (lo + hi) // 2
        row, fitted, e = _try_rung(est, candidates[mid], batch_size, usable, floors)
        tried[mid] = row
        if fitted >= 1 and e is not None:
            best, hi = (candidates[mid].policy, fitted, e), mid - 1
        else:
            lo = mid + 1
    plan.rows += [tried[k] for k in sorted(tried)]
    return best


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


def _trains_all(trainable: Any) -> bool:
    return isinstance(trainable, str) and trainable == "all"


def _tiles_help(config: PretrainedConfig, tokens: int) -> bool:
    """A step's tokens span more than one MLP tile (the mlp:tiled rung then saves memory)."""
    from ..transforms.tiled_mlp import auto_tile_tokens

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    experts = any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return bool(hidden) and not experts and tokens > auto_tile_tokens(hidden)


def _num_blocks(config: PretrainedConfig) -> int:
    return int(
        getattr(config, "num_hidden_layers", 0)  # 0 and None alike: not set, try the next name
        or getattr(config, "n_layer", 0)
        or getattr(config, "num_layers", 4)
    )
