"""The ladder, in one place: the presets users pick from (speed first, then memory), and the
memory rungs the planner walks and the finder points to when a budget is too small.

Speed rung by rung: 1. eager fp32 (correctness); 2. mixed precision; 3. torch.compile.
Memory rung by rung, least memory saved (and fastest) first, as measured by ``bench/ladder.py``:
4. the chunked loss head (causal LMs: the logits and their fp32 copy go, at no cost in speed);
5. selective (op-level) checkpointing (the cheap ops are recomputed, the matmuls kept); 6. block
checkpointing (every 4th, 3rd, 2nd block, torchtitan's alternate-matmul selective policy, then
every block, then - when a step holds more tokens than one tile - the blocks' MLPs over tiles of
tokens, kept by every rung after it); 7. for LoRA runs, 4-bit base weights (the frozen linear layers of the blocks in NF4:
a quarter of their 16-bit bytes); 8. the optimizer: stepped in the backward (no full set of
gradients), then - for a bf16 full fine-tune - pure bf16 (weights, gradients and moments in bf16,
stochastic rounding), then 8-bit moments, then both; 9. offloading the checkpoints to host memory; 10. FSDP
over several devices (then with CPU offload). Activation rungs come before the 4-bit and optimizer
rungs: they change no arithmetic, while those round the frozen weights or the moments, or forbid
accumulation and global clipping. Each rung keeps the savings of the rungs before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy import MemoryPolicy
from ..policy.presets import LADDER

__all__ = ["LADDER", "MEASURED_SPEED", "Rung", "memory_rungs", "next_rung"]

# Step speed relative to eager fp32 (mixed precision) or to the same rung without the feature.
# Measured by bench/ladder.py on the ladder model (4-layer Llama h=1024, vocabulary 32k, batch 4,
# seq 256, 2-core CPUs; see the README): bf16 and full checkpointing on a Xeon; the chunked loss
# (1.07x), selective (0.95x, its alternate variant read 1.00x: within noise of it, kept below it
# since it recomputes more), in-backward (0.99x) and 8-bit (0.57x: torchao's step on a CPU; on a GPU
# torchao reports it at par) on an EPYC. Offload and FSDP factors are assumptions; they only order
# rungs that fit, so they need only be rough. 4-bit base weights: bench/qlora.py (LoRA r=16 on its
# Llama, bf16 + full checkpointing, against the same run with 16-bit frozen weights).
MEASURED_SPEED = {
    "bf16": 1.52,
    "ckpt": 0.86,
    "loss_chunked": 1.07,
    "selective": 0.95,
    "selective_alternate": 0.93,
    "in_backward": 0.99,
    "8bit": 0.57,
    "offload": 0.8,
    "fsdp": 0.8,
    "fsdp_offload": 0.2,
    "quant": 0.8,
    "mlp_tiled": 0.9,
    "pure_bf16": 1.0,
}
# pure_bf16 (weights:bf16) is an assumption: the same bf16 matmuls, a step that reads half the bytes.
# mlp_tiled: one more MLP forward on top of full checkpointing (bench/tiled_mlp.py, the README).

# How much of the activations each checkpointing mode drops (ordering only; measured on the ladder
# model, of all activations alive after the forward: selective 40%, selective:alternate 47%, every
# block 56% - the rest being the logits, which only the chunked loss removes).
_CHECKPOINTED = {"none": 0.0, "selective": 0.4, "every_n": 0.5, "full": 1.0, "offload": 1.1}


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One memory rung: a policy string and its speed relative to eager fp32."""

    policy: str
    relative_speed: float


def memory_rungs(
    precision: str,
    *,
    num_blocks: int,
    world_size: int = 1,
    causal_lm: bool = False,
    eightbit: bool = True,
    step_in_backward: bool = True,
    quantize: bool = False,
    tiled_mlp: bool = False,
    pure_bf16: bool = False,
) -> list[Rung]:
    """The memory rungs from the device's mixed ``precision``, least memory saving (and fastest)
    first. fp32 is the correctness rung and compile changes speed rather than memory: neither is a
    memory rung. ``causal_lm``: the chunked loss head applies (from the second rung on);
    ``eightbit``: torchao is installed (the 8-bit optimizer rungs); ``quantize``: a LoRA run with
    torchao installed (4-bit base weights, after full checkpointing and kept on every rung after
    it); FSDP rungs need several devices; ``tiled_mlp``: a step holds more tokens than one MLP
    tile, so tiling the MLPs saves memory (an activation rung placed by its measured speed, kept by
    the rungs after it); ``pure_bf16``: a full fine-tune in bf16 (the
    trainable weights, gradients and moments in bf16 with stochastic rounding: 16 -> 8 bytes per
    trainable parameter, 6 with 8-bit moments; after the in-backward rung and kept by the rungs after
    it)."""
    s = MEASURED_SPEED
    speed = s["bf16"] if precision != "fp32" else 1.0
    base = f"{precision}+loss:chunked" if causal_lm else precision
    rungs = [Rung(policy=precision, relative_speed=speed)]
    if causal_lm:
        speed *= s["loss_chunked"]
        rungs.append(Rung(policy=base, relative_speed=speed))
    rungs.append(Rung(policy=f"{base}+ckpt:selective", relative_speed=speed * s["selective"]))
    # The least block checkpointing that fits first: every 4th block, 3rd, 2nd, then every block.
    rungs += [
        Rung(policy=f"{base}+ckpt:{n}", relative_speed=speed * (1 - (1 - s["ckpt"]) / n))
        for n in (4, 3, 2)
        if n < num_blocks
    ]
    rungs.append(Rung(policy=f"{base}+ckpt:selective:alternate", relative_speed=speed * s["selective_alternate"]))
    full = speed * s["ckpt"]
    rungs.append(Rung(policy=f"{base}+ckpt", relative_speed=full))
    if tiled_mlp:
        # Activation rungs change no arithmetic and go before the 4-bit and optimizer rungs, fastest
        # first; the rungs after this one keep the tiles (their other savings come on top of it).
        tiled = Rung(policy=f"{base}+ckpt+mlp:tiled", relative_speed=full * s["mlp_tiled"])
        at = next(
            (i for i, r in enumerate(rungs) if i > causal_lm and r.relative_speed < tiled.relative_speed), len(rungs)
        )
        rungs.insert(at, tiled)
        full *= s["mlp_tiled"]
    tiles = "+mlp:tiled" * tiled_mlp
    # From here on the frozen weights may be 4-bit (LoRA runs): every later rung keeps them so.
    quant = "+quant:nf4" * quantize
    if quantize:
        full *= s["quant"]
        rungs.append(Rung(policy=f"{base}+ckpt{quant}{tiles}", relative_speed=full))
    keep = quant + tiles  # in to_string's order
    # fp16's GradScaler needs every gradient before the step: no stepping in the backward there.
    in_backward = step_in_backward and precision != "fp16"
    if in_backward:
        rungs.append(Rung(policy=f"{base}+ckpt{keep}+optim:in_backward", relative_speed=full * s["in_backward"]))
    # From here on a bf16 full fine-tune may train pure bf16: every later rung keeps it (last, as to_string writes it).
    weights = "+weights:bf16" * (pure_bf16 and precision == "bf16")
    if weights:
        full *= s["pure_bf16"]
        rungs.append(Rung(policy=f"{base}+ckpt{keep}{weights}", relative_speed=full))
    if eightbit:
        rungs.append(Rung(policy=f"{base}+ckpt{keep}+optim:8bit{weights}", relative_speed=full * s["8bit"]))
    optim = "+optim:8bit" * eightbit + "+optim:in_backward" * in_backward
    if eightbit and in_backward:
        rungs.append(
            Rung(policy=f"{base}+ckpt{keep}{optim}{weights}", relative_speed=full * s["8bit"] * s["in_backward"])
        )
    rungs.append(Rung(policy=f"{base}+ckpt:offload{keep}{optim}{weights}", relative_speed=full * s["offload"]))
    if world_size > 1:
        rungs.append(Rung(policy=f"{base}+ckpt{keep}+fsdp{weights}", relative_speed=full * s["fsdp"]))
        rungs.append(Rung(policy=f"{base}+ckpt{keep}+fsdp:offload{weights}", relative_speed=full * s["fsdp_offload"]))
    return rungs


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
        candidate = _merged(policy, MemoryPolicy.from_string(f"{policy.precision}+quant:nf4"))
        return f"Next rung of the ladder: '{candidate.to_string()}' ({_what_it_saves(policy, candidate)})."
    if not weights_dominate:
        for rung in memory_rungs(policy.precision, num_blocks=num_blocks, causal_lm=causal_lm, quantize=quantize):
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
