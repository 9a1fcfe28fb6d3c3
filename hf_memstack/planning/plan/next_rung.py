"""What the batch-size finder says when a policy does not fit: the next rung of the ladder that
adds a saving to it (the rungs of :mod:`hf_memstack.planning.plan.rungs`, merged into the user's
policy: its precision, compile and sharding kept), or sharding, or a larger budget."""

from __future__ import annotations

from ...policy import MemoryPolicy
from .rungs import Requirement, RungContext, _compose, rungs_for

__all__ = ["next_rung"]

# How much of the activations each checkpointing mode drops (ordering only; measured on bench/ladder.py's
# model, of all activations alive after the forward: selective 40%, selective:alternate 47%, every
# block 56% - the rest being the logits, which only the chunked loss removes).
_CHECKPOINTED = {"none": 0.0, "selective": 0.4, "every_n": 0.5, "full": 1.0, "offload": 1.1}


def next_rung(
    policy: MemoryPolicy,
    *,
    num_blocks: int,
    weights_dominate: bool = False,
    causal_lm: bool = False,
    quantize: bool = False,
) -> str:
    """What to try when ``policy`` does not fit, as a sentence: the first memory rung that adds a
    saving to ``policy`` (its features kept: compile, precision, what it already saves).
    ``weights_dominate``: the parameters alone do not fit, so neither activation nor optimizer
    rungs can help; only 4-bit base weights (``quantize``: frozen linear layers that are not 4-bit
    yet, and torchao), sharding or a larger budget can."""
    if weights_dominate and quantize and policy.quant.mode == "none":
        candidate = _merged(policy, _compose(policy.precision, ["quant:nf4"])[0])
        return f"Next rung of the ladder: '{candidate.to_string()}' ({_what_it_saves(policy, candidate)})."
    if not weights_dominate:
        # What is known not to hold here; every other requirement is taken to hold (a new one too),
        # and the optimizer rungs are named whether or not this loop could take them (one device).
        absent = {Requirement.TOKENS_OVER_ONE_TILE, Requirement.FULL_FINETUNE, Requirement.SEVERAL_DEVICES}
        absent |= set() if causal_lm else {Requirement.CAUSAL_LM}
        absent |= set() if quantize else {Requirement.LORA_WITH_TORCHAO}
        facts = frozenset(Requirement) - absent
        for rung in rungs_for(RungContext(policy.precision, num_blocks, facts)):
            candidate = _merged(policy, MemoryPolicy.from_string(rung.policy))
            if candidate != policy:
                return f"Next rung of the ladder: '{candidate.to_string()}' ({_what_it_saves(policy, candidate)})."
    if policy.fsdp.mode == "none":
        return "Next rung of the ladder: shard the model with FSDP over several devices (policy 'fsdp'), or a larger budget."
    if not policy.fsdp.cpu_offload:
        return (
            f"Next rung of the ladder: FSDP with CPU offload ('{policy.precision}+ckpt+fsdp:offload'), or more ranks."
        )
    return "Nothing left on the ladder: more ranks, a shorter sequence or a smaller model."


def _merged(policy: MemoryPolicy, rung: MemoryPolicy) -> MemoryPolicy:
    """``policy`` with every saving of ``rung`` added: the stronger checkpointing, the chunked loss,
    4-bit base weights, the optimizer rung; its own precision, compile and sharding kept."""
    merged = policy.to_dict()
    if _strength(rung) > _strength(policy):
        merged["checkpointing"] = rung.to_dict()["checkpointing"]
    if rung.loss.mode == "chunked":
        merged["loss"] = rung.to_dict()["loss"]
    if rung.quant.mode != "none" and policy.quant.mode == "none":
        merged["quant"] = rung.to_dict()["quant"]
    op = dict(merged["optimizer"])
    if rung.optimizer.state == "8bit":
        op["state"] = "8bit"
    if rung.optimizer.step == "in_backward" and policy.precision != "fp16":
        op["step"] = "in_backward"
    merged["optimizer"] = op
    return MemoryPolicy.from_dict(merged)


def _strength(policy: MemoryPolicy) -> float:
    ck = policy.checkpointing
    if ck.mode == "every_n":
        return 1 / ck.every_n
    if ck.mode == "selective" and ck.selective_matmuls == "save_alternate":
        return 0.55
    return _CHECKPOINTED[ck.mode]


def _what_it_saves(policy: MemoryPolicy, candidate: MemoryPolicy) -> str:
    parts = []
    if candidate.loss != policy.loss:
        parts.append("no full logits")
    if candidate.checkpointing != policy.checkpointing:
        parts.append("less activation memory")
    if candidate.quant != policy.quant:
        parts.append("the frozen linear weights in 4 bits")
    if candidate.optimizer != policy.optimizer:
        parts.append("smaller optimizer state and gradients")
    return ", ".join(parts)
