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

The ladder is data: :data:`STEPS`, one row a rung, in that order. A row names the policy tokens
it adds (spellings of :data:`hf_memstack.policy.tokens.TOKENS`, composed through their config
fragments), its speed factors (keys of :data:`MEASURED_SPEED`), what it requires (a set of
:class:`Requirement`) and whether the rungs after it keep its saving. The caller states the facts
it knows as a :class:`RungContext`; :func:`rungs_for` drops the rows whose requirements are not
among them. A new precondition is a :class:`Requirement` member and the rows that need it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ...policy import MemoryPolicy
from ...policy.presets import LADDER
from ...policy.tokens import TOKENS, Token

__all__ = [
    "LADDER",
    "MEASURED_SPEED",
    "STEPS",
    "Requirement",
    "Rung",
    "RungContext",
    "Step",
    "memory_rungs",
    "rungs_for",
    "savings_speed",
    "sharding_speed",
]

# Step speed relative to eager fp32 (mixed precision) or to the same rung without the feature.
# Measured by bench/ladder.py on the ladder model (4-layer Llama h=1024, vocabulary 32k, batch 4,
# seq 256, 2-core CPUs; see docs/benchmarks.md): bf16 and full checkpointing on a Xeon; the chunked loss
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
    "sp": 0.9,
}
# pure_bf16 (weights:bf16) is an assumption: the same bf16 matmuls, a step that reads half the bytes.
# mlp_tiled: one more MLP forward on top of full checkpointing (bench/tiled_mlp.py, docs/packing.md).
# sp (sequence parallelism) is an assumption, per doubling of its degree: four all-to-alls a block
# each way; it only orders the degrees (the smallest that fits first) against the rungs after them.
# Measured on CPU (bench/results/sequence_parallel.json: 2 gloo ranks on 2 cores, a tiny Llama under
# bf16+ckpt+loss:chunked, one global batch of 2 rows of 2,016 tokens): sp:2 at 0.94x sp:1's tokens/s
# (median of 9 paired runs, 0.81-1.19). It stays assumed: there the exchange is gloo's through shared
# memory beside slow CPU matmuls; on GPUs the all-to-all runs over NVLink (or the network, across
# nodes) beside far faster kernels, so its share of the step is another number - to measure there.


class Requirement(Enum):
    """A fact a rung needs before it is offered. The caller states the facts about the job
    (:attr:`RungContext.satisfied`); those marked Derived follow from the precision and the number of blocks."""

    CAUSAL_LM = "causal_lm"
    """The chunked loss head applies: a causal LM whose head prepare_model can chunk (not BERT's)."""
    TORCHAO = "torchao"
    """torchao is installed: it holds the 8-bit AdamW moments."""
    LORA_WITH_TORCHAO = "lora_with_torchao"
    """A LoRA run with torchao: frozen linear layers of the blocks, not 4-bit yet, that NF4 can hold."""
    STEP_IN_BACKWARD = "step_in_backward"
    """The loop lets the optimizer step inside the backward: it neither accumulates gradients, nor
    clips them by their global norm, nor averages them with DDP (that rung can do none of these)."""
    TOKENS_OVER_ONE_TILE = "tokens_over_one_tile"
    """A step holds more tokens than one MLP tile: only then does tiling the MLPs save memory."""
    FULL_FINETUNE = "full_finetune"
    """Every weight trains: pure bf16 keeps trainable weights, gradients and moments in bf16 (16 -> 8
    bytes per trainable parameter, 6 with 8-bit moments); a LoRA run has too few for it to matter."""
    SEVERAL_DEVICES = "several_devices"
    """More than one device: FSDP has something to shard over."""
    SEQUENCE_OVER_ONE_DEVICE = "sequence_over_one_device"
    """Stated by the planner: the activations at the wanted sequence length do not fit one device with
    every activation rung, even with the model states sharded over every rank, and some degree N >= 2
    divides both the world size and the attention heads (:attr:`RungContext.sp_degrees`): sequence
    parallelism (``sp:N``) is then offered, one rung per degree."""
    NOT_FP16 = "not_fp16"
    """Derived: the precision is not fp16, whose GradScaler needs every gradient before the step
    (to unscale, and skip it on overflow): no stepping in the backward there."""
    BF16 = "bf16"
    """Derived: the precision is bf16, which pure bf16 computes and updates in."""
    MORE_THAN_2_BLOCKS = "more_than_2_blocks"
    """Derived: ckpt:2 checkpoints blocks 0, 2, 4...; with 2 blocks or fewer that is block 0 alone,
    a saving too small for a rung of its own."""
    MORE_THAN_3_BLOCKS = "more_than_3_blocks"
    """Derived: as for ckpt:2, for ckpt:3."""
    MORE_THAN_4_BLOCKS = "more_than_4_blocks"
    """Derived: as for ckpt:2, for ckpt:4."""


# The facts RungContext works out itself (a stated one is replaced by the truth).
_DERIVED = frozenset(
    {Requirement.NOT_FP16, Requirement.BF16} | {Requirement(f"more_than_{n}_blocks") for n in (2, 3, 4)}
)


@dataclass(frozen=True, slots=True)
class RungContext:
    """What the caller knows about the model and the job, as the rungs need it."""

    precision: str
    """The device's mixed precision (``fp32``, ``bf16``, ``fp16``; ``auto`` from a policy)."""
    num_blocks: int
    """The model's repeated blocks (ckpt:N rungs need more than N)."""
    satisfied: frozenset[Requirement] = frozenset()
    """The stated facts (see :class:`Requirement`); derived ones are worked out from the fields above."""
    sp_degrees: tuple[int, ...] = ()
    """The sequence-parallel degrees the job can take (each divides the world size and the heads),
    ascending: a ``degrees`` row of :data:`STEPS` is one rung per degree."""
    chunked_loss_speed: float = MEASURED_SPEED["loss_chunked"]
    """The chunked loss rung's factor: measured at every position labelled; the planner's is scaled
    to the job's label fraction (:mod:`hf_memstack.planning.plan.head_speed`)."""

    def facts(self) -> frozenset[Requirement]:
        """Every requirement that holds: the stated ones and those the precision and depth give."""
        derived = {Requirement.NOT_FP16} if self.precision != "fp16" else set()
        derived |= {Requirement.BF16} if self.precision == "bf16" else set()
        derived |= {Requirement(f"more_than_{n}_blocks") for n in (2, 3, 4) if self.num_blocks > n}
        return (self.satisfied - _DERIVED) | derived


@dataclass(frozen=True, slots=True)
class Step:
    """One row of the ladder's table: the rung it offers over what the rows before it kept."""

    name: str
    tokens: tuple[str, ...]
    """The policy tokens it adds (spellings of ``TOKENS``; a later token of a field replaces an
    earlier one setting the same sub-fields: ``ckpt:offload`` over ``ckpt``)."""
    speed: tuple[str, ...] = ()
    """``MEASURED_SPEED`` keys, multiplied in order into the speed of what is kept."""
    requires: frozenset[Requirement] = frozenset()
    kept: bool = False
    """Every rung after it keeps its tokens and speed factors (the chunked loss, full
    checkpointing, the tiles, 4-bit base weights, pure bf16); else later rungs replace its saving."""
    per_blocks: int = 1
    """ckpt:N: the speed factor's recomputation falls on one block in N."""
    carries: tuple[str, ...] = ()
    """Earlier rows whose tokens (not their speed: its own factor is measured over the whole) it
    adds where they were offered: offloading keeps the optimizer rungs' savings."""
    degrees: bool = False
    """Sequence parallelism: one rung per degree N of :attr:`RungContext.sp_degrees`, smallest first,
    each adding ``sp:N`` and its speed factor once per doubling of N; only the largest is ``kept``
    (the rungs after it shard the sequence as far as the job can)."""


_R = Requirement
# Stepping in the backward: the loop allows it, and fp16's GradScaler is not in the way.
_OPTIM_IN_BACKWARD = frozenset({_R.STEP_IN_BACKWARD, _R.NOT_FP16})
STEPS: tuple[Step, ...] = (
    Step("mixed_precision", (), kept=True),
    Step("chunked_loss", ("loss:chunked",), ("loss_chunked",), frozenset({_R.CAUSAL_LM}), kept=True),
    Step("selective", ("ckpt:selective",), ("selective",)),
    # The least block checkpointing that fits first: every 4th block, 3rd, 2nd, then every block.
    Step("every_4th", ("ckpt:4",), ("ckpt",), frozenset({_R.MORE_THAN_4_BLOCKS}), per_blocks=4),
    Step("every_3rd", ("ckpt:3",), ("ckpt",), frozenset({_R.MORE_THAN_3_BLOCKS}), per_blocks=3),
    Step("every_2nd", ("ckpt:2",), ("ckpt",), frozenset({_R.MORE_THAN_2_BLOCKS}), per_blocks=2),
    Step("selective_alternate", ("ckpt:selective:alternate",), ("selective_alternate",)),
    Step("full", ("ckpt",), ("ckpt",), kept=True),
    # Full checkpointing's work and one more MLP forward: the slowest activation rung, still
    # before the 4-bit and optimizer rungs (it changes no arithmetic).
    Step("tiled_mlp", ("mlp:tiled",), ("mlp_tiled",), frozenset({_R.TOKENS_OVER_ONE_TILE}), kept=True),
    # Sequence parallelism after every activation rung of one device (it needs several and their
    # all-to-alls, and changes no arithmetic), before the 4-bit and optimizer rungs and FSDP, which
    # keep its largest degree.
    Step(
        "sequence_parallel",
        (),
        requires=frozenset({_R.SEVERAL_DEVICES, _R.SEQUENCE_OVER_ONE_DEVICE}),
        kept=True,
        degrees=True,
    ),
    Step("nf4", ("quant:nf4",), ("quant",), frozenset({_R.LORA_WITH_TORCHAO}), kept=True),
    Step("in_backward", ("optim:in_backward",), ("in_backward",), _OPTIM_IN_BACKWARD),
    Step("pure_bf16", ("weights:bf16",), ("pure_bf16",), frozenset({_R.FULL_FINETUNE, _R.BF16}), kept=True),
    Step("8bit", ("optim:8bit",), ("8bit",), frozenset({_R.TORCHAO})),
    Step(
        "8bit_in_backward",
        ("optim:8bit", "optim:in_backward"),
        ("8bit", "in_backward"),
        _OPTIM_IN_BACKWARD | {_R.TORCHAO},
    ),
    Step("offload", ("ckpt:offload",), ("offload",), carries=("in_backward", "8bit", "8bit_in_backward")),
    # FSDP shards the moments and gradients itself: over the rungs kept, without the optimizer's.
    Step("fsdp", ("fsdp",), ("fsdp",), frozenset({_R.SEVERAL_DEVICES})),
    Step("fsdp_offload", ("fsdp:offload",), ("fsdp_offload",), frozenset({_R.SEVERAL_DEVICES})),
)
"""The memory rungs, least memory saving (and fastest) first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One memory rung: a policy string and its speed relative to eager fp32."""

    policy: str
    """The policy string: the precision and the table's spellings, in the order the planner's table
    has always shown (``bf16+loss:chunked+ckpt``; ``MemoryPolicy.from_string`` reads it)."""
    relative_speed: float
    requires: frozenset[Requirement] = frozenset()
    """What its row of :data:`STEPS` requires."""
    step: str = ""
    """The name of that row."""


def rungs_for(context: RungContext) -> list[Rung]:
    """The memory rungs from the device's mixed precision, least memory saving (and fastest) first:
    every row of :data:`STEPS` whose requirements hold in ``context``. fp32 is the correctness rung
    and compile changes speed rather than memory: neither is a memory rung."""
    facts = context.facts()
    s = {**MEASURED_SPEED, "loss_chunked": context.chunked_loss_speed}
    speed = s["bf16"] if context.precision != "fp32" else 1.0  # of what is kept
    kept: list[str] = []
    offered: dict[str, tuple[str, ...]] = {}
    rungs = []
    for step in STEPS:
        if not step.requires <= facts:
            continue
        degrees = context.sp_degrees if step.degrees else (0,)
        for n in degrees:
            own = speed * (s["sp"] ** math.log2(n) if n else 1.0)
            for key in step.speed:
                own *= s[key] if step.per_blocks == 1 else 1 - (1 - s[key]) / step.per_blocks
            carried = [t for name in step.carries for t in offered.get(name, ())]
            added = (*step.tokens, *((f"sp:{n}",) if n else ()))
            policy = _written(context.precision, (*kept, *carried, *added))
            rungs.append(Rung(policy=policy, relative_speed=own, requires=step.requires, step=step.name))
            offered[step.name] = added
            if step.kept and n == degrees[-1]:
                speed, kept = own, [*kept, *added]
    return rungs


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
    """:func:`rungs_for` with the facts as keywords, one a :class:`Requirement`: ``causal_lm``
    (``CAUSAL_LM``), ``eightbit`` (``TORCHAO``), ``step_in_backward``, ``quantize``
    (``LORA_WITH_TORCHAO``), ``tiled_mlp`` (``TOKENS_OVER_ONE_TILE``), ``pure_bf16`` (a full
    fine-tune: ``FULL_FINETUNE``); ``world_size > 1`` is ``SEVERAL_DEVICES``. A requirement none of
    them names (one added after these keywords) is taken to hold: its rungs stay offered, and a new
    precondition needs no keyword here."""
    flags = {
        Requirement.CAUSAL_LM: causal_lm,
        Requirement.TORCHAO: eightbit,
        Requirement.STEP_IN_BACKWARD: step_in_backward,
        Requirement.LORA_WITH_TORCHAO: quantize,
        Requirement.TOKENS_OVER_ONE_TILE: tiled_mlp,
        Requirement.FULL_FINETUNE: pure_bf16,
        Requirement.SEVERAL_DEVICES: world_size > 1,
    }
    return rungs_for(RungContext(precision, num_blocks, frozenset(r for r in Requirement if flags.get(r, True))))


# The fields whose tokens save model states (the weights, the optimizer's moments), not activations.
_STATE_FIELDS = ("quant", "optimizer", "master_weights")


def savings_speed(policy: MemoryPolicy) -> float:
    """The speed factor of a policy's model-state savings (4-bit base weights, the optimizer rungs,
    pure bf16): the ``MEASURED_SPEED`` keys of the :data:`STEPS` rows that add only such tokens, all
    of them in the policy - each key once (``8bit_in_backward``'s keys are ``8bit``'s and
    ``in_backward``'s). 1.0 for a policy that saves only activations."""
    spellings = set(policy.to_string().split("+"))
    keys = {
        key
        for step in STEPS
        if step.tokens and all(_token(t).field in _STATE_FIELDS for t in step.tokens) and set(step.tokens) <= spellings
        for key in step.speed
    }
    return math.prod(MEASURED_SPEED[k] for k in keys)


def sharding_speed(policy: MemoryPolicy) -> float:
    """The speed factor of a policy's sharding: FSDP's (with or without offload) and sp:N's (per doubling of N)."""
    fsdp = policy.fsdp
    shard = 1.0 if fsdp.mode == "none" else MEASURED_SPEED["fsdp_offload" if fsdp.cpu_offload else "fsdp"]
    return shard * MEASURED_SPEED["sp"] ** math.log2(policy.sequence_parallel.size)


_BY_SPELLING = {t.spelling: t for t in TOKENS if t.number is None}
# The order a rung's string is written in, as the planner's table has always shown it: the chunked
# loss next to the precision ('bf16+loss:chunked+ckpt'), then to_string's order of the fields but
# FSDP after the optimizer; within a field, the token table's order (optim:8bit+optim:in_backward).
# The rung writes its own spellings ('fsdp', where to_string writes 'fsdp:full_shard').
_WRITTEN = (
    "loss",
    "checkpointing",
    "compile",
    "quant",
    "mlp",
    "optimizer",
    "sequence_parallel",
    "fsdp",
    "master_weights",
)


def _token(spelling: str) -> Token:
    """The row of the token table a spelling is (``ckpt:4``: ``ckpt:N``, its argument accepted)."""
    if spelling in _BY_SPELLING:
        return _BY_SPELLING[spelling]
    group, _, arg = spelling.partition(":")
    for t in TOKENS:
        if t.number is not None and t.spelling.partition(":")[0] == group and t.number(arg) is not None:
            return t
    raise ValueError(f"{spelling!r} is not a policy token (hf_memstack.policy.tokens.TOKENS)")


def _fragment(spelling: str) -> Any:
    """The config fragment a spelling sets (``ckpt:N``'s built from its argument)."""
    t = _token(spelling)
    return t.fragment if t.number is None else t.number(spelling.partition(":")[2])


def _compose(precision: str, spellings: Iterable[str]) -> tuple[MemoryPolicy, str]:
    """The policy of ``precision`` and these tokens, their config fragments merged in order - a
    token replaces the earlier ones of its field that set any of its sub-fields (``ckpt:offload``
    over ``ckpt``) and joins those that set others (``optim:8bit`` and ``optim:in_backward``) - and
    its string: the tokens left, in :data:`_WRITTEN`'s order. Building the policy validates it."""
    held: dict[str, dict[str, Any]] = {}  # field -> the spellings left -> their fragments
    for spelling in dict.fromkeys(spellings):
        field, fragment = _token(spelling).field, _fragment(spelling)
        keys = set(fragment) if isinstance(fragment, dict) else {None}
        others = {s: f for s, f in held.get(field, {}).items() if isinstance(f, dict) and not keys & set(f)}
        held[field] = {**others, spelling: fragment}
    fields = {field: _merge(list(by.values())) for field, by in held.items()}
    left = sorted((s for by in held.values() for s in by), key=_written_at)
    return MemoryPolicy.from_dict({"precision": precision, **fields}), "+".join([precision, *left])


@functools.lru_cache(maxsize=1024)
def _written(precision: str, spellings: tuple[str, ...]) -> str:
    """:func:`_compose`'s string (validated once per combination: the planner and the finder ask again)."""
    return _compose(precision, spellings)[1]


def _merge(fragments: list[Any]) -> Any:
    """One field's value from its tokens' fragments: the sub-fields of all (a plain field: its one)."""
    if not isinstance(fragments[-1], dict):
        return fragments[-1]
    return {k: v for f in fragments for k, v in f.items()}


def _written_at(spelling: str) -> tuple[int, int]:
    token = _token(spelling)
    return _WRITTEN.index(token.field), TOKENS.index(token)
