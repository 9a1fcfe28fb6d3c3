"""The ladder, in one place: the presets users pick from (speed first, then memory), and the
memory rungs the planner walks and the finder points to when a budget is too small.

Speed rung by rung: 1. eager fp32 (correctness); 2. mixed precision; 3. torch.compile;
memory rung by rung: 4. activation checkpointing (every 4th, 3rd, 2nd block, then every block,
then with offload); 5. FSDP over several devices (then with CPU offload).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .policy import MemoryPolicy

__all__ = ["LADDER", "MEASURED_SPEED", "Rung", "memory_rungs", "next_rung"]

# The presets, cheapest first: each adds a tool only when the one before is not enough.
LADDER: dict[str, str] = {
    "fp32": "fp32",
    "bf16": "bf16",
    "bf16+compile": "bf16+compile",
    "bf16+compile+ckpt": "bf16+compile+ckpt",
    "fsdp": "bf16+ckpt+fsdp",
}

# Step speed relative to eager fp32 (mixed precision) or to the same rung without the feature.
# bf16 (1.52x) and full checkpointing (x0.86) were measured by bench/ladder.py (4-layer Llama
# h=1024, batch 4, seq 256, 2-core Xeon with AMX-BF16; see the README). Offload and FSDP factors
# are assumptions, not measured here; they only order rungs that fit, so they need only be rough.
MEASURED_SPEED = {"bf16": 1.52, "ckpt": 0.86, "offload": 0.8, "fsdp": 0.8, "fsdp_offload": 0.2}


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One memory rung: a policy string and its speed relative to eager fp32."""

    policy: str
    relative_speed: float


def memory_rungs(precision: str, *, num_blocks: int, world_size: int = 1) -> list[Rung]:
    """The memory rungs from the device's mixed ``precision``, least memory saving (and fastest)
    first. fp32 is the correctness rung and compile changes speed rather than memory: neither
    is a memory rung. FSDP rungs need more than one device."""
    mixed = MEASURED_SPEED["bf16"] if precision != "fp32" else 1.0
    ckpt = MEASURED_SPEED["ckpt"]
    rungs = [Rung(policy=precision, relative_speed=mixed)]
    # The least checkpointing that fits first: every 4th block, 3rd, 2nd, then every block.
    rungs += [Rung(policy=f"{precision}+ckpt:{n}", relative_speed=mixed * (1 - (1 - ckpt) / n)) for n in (4, 3, 2) if n < num_blocks]
    rungs.append(Rung(policy=f"{precision}+ckpt", relative_speed=mixed * ckpt))
    rungs.append(Rung(policy=f"{precision}+ckpt:offload", relative_speed=mixed * MEASURED_SPEED["offload"]))
    if world_size > 1:
        rungs.append(Rung(policy=f"{precision}+ckpt+fsdp", relative_speed=mixed * ckpt * MEASURED_SPEED["fsdp"]))
        rungs.append(Rung(policy=f"{precision}+ckpt+fsdp:offload", relative_speed=mixed * ckpt * MEASURED_SPEED["fsdp_offload"]))
    return rungs


def next_rung(policy: MemoryPolicy, *, num_blocks: int, weights_dominate: bool = False) -> str:
    """What to try when ``policy`` does not fit, as a sentence: the first memory rung that saves
    more than ``policy`` does. ``weights_dominate``: the model states alone do not fit, so
    activation checkpointing cannot help and only sharding (or a larger budget) can."""
    from .policy import MemoryPolicy

    if not weights_dominate:
        for rung in memory_rungs(policy.precision, num_blocks=num_blocks):
            candidate = MemoryPolicy.from_string(rung.policy)
            if _saves_more(candidate, policy):
                return f"Next rung of the ladder: '{_with_features_of(policy, candidate)}' (less activation memory)."
    if policy.fsdp.mode == "none":
        return "Next rung of the ladder: shard the model with FSDP over several devices (policy 'fsdp'), or a larger budget."
    if not policy.fsdp.cpu_offload:
        return f"Next rung of the ladder: FSDP with CPU offload ('{policy.precision}+ckpt+fsdp:offload'), or more ranks."
    return "Nothing left on the ladder: more ranks, a shorter sequence or a smaller model."


def _checkpointed_fraction(policy: MemoryPolicy) -> float:
    ck = policy.checkpointing
    return {"none": 0.0, "every_n": 1 / ck.every_n, "full": 1.0, "offload": 1.1}[ck.mode]


def _saves_more(candidate: MemoryPolicy, policy: MemoryPolicy) -> bool:
    return _checkpointed_fraction(candidate) > _checkpointed_fraction(policy)


def _with_features_of(policy: MemoryPolicy, candidate: MemoryPolicy) -> str:
    """``candidate``'s checkpointing on top of the rest of ``policy`` (its compile, its precision)."""
    from .policy import MemoryPolicy

    merged = MemoryPolicy.from_dict({**policy.to_dict(), "checkpointing": candidate.to_dict()["checkpointing"]})
    return merged.to_string()
