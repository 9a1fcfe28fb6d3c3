"""MemoryPolicy: what prepare_model applies, built from keyword arguments, a policy string, a dict
or a YAML file - each validated the same way (validate.py), the string through one token table
(tokens.py)."""

from __future__ import annotations

import dataclasses
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from ..errors import PolicyError
from . import tokens
from .config import (
    SUBCONFIGS,
    CheckpointingConfig,
    CompileConfig,
    FSDPConfig,
    LossConfig,
    MasterWeights,
    MLPConfig,
    OptimizerConfig,
    Precision,
    QuantConfig,
    SequenceParallelConfig,
)
from .policy_file import read_policy_file
from .presets import LADDER
from .validate import (
    DTYPE_FIELDS,
    check_choice,
    coerce_subconfig,
    dtype_name,
    validate_checkpointing,
    validate_compile,
    validate_fsdp,
    validate_loss,
    validate_mlp,
    validate_optimizer,
    validate_quant,
    validate_sequence_parallel,
)

__all__ = ["MemoryPolicy"]

# A policy as a nested dict of its fields (``to_dict``'s layout, or read from YAML): its values
# are of every field's type, and are checked when the policy is built from it.
PolicyDict: TypeAlias = dict[str, Any]


@dataclass(kw_only=True, slots=True)
class MemoryPolicy:
    """What :func:`hf_memstack.prepare_model` applies to a model.

    Example: ``MemoryPolicy(precision="bf16", checkpointing="full", compile="regional")``.
    """

    precision: Precision = "fp32"
    """``fp32``; ``bf16`` (autocast, no GradScaler); ``fp16`` (autocast + GradScaler, for GPUs
    without bf16); ``auto`` (bf16 where the device supports it, else fp16 on CUDA, else fp32)."""

    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Activation checkpointing; a mode string or a dict is accepted too."""

    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile; a mode string or a dict is accepted too."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding; a mode string or a dict is accepted too."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The causal-LM loss head; a mode string (``"chunked"``) or a dict is accepted too."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    """4-bit base weights; a mode string (``"nf4"``) or a dict is accepted too."""
    mlp: MLPConfig = field(default_factory=MLPConfig)
    """The blocks' MLPs (``"tiled"``: over tiles of tokens); a mode string or a dict is accepted too."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer's state and step (built by :func:`hf_memstack.make_optimizer`); a dict, or a
    string such as ``"8bit"``, ``"in_backward"`` or ``"8bit+in_backward"``, is accepted too."""

    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    """Sequence parallelism (Ulysses, token ``sp:N``): over how many ranks each row's tokens are
    sharded; an integer size or a dict is accepted too."""

    master_weights: MasterWeights = "fp32"
    """The dtype the trainable parameters are kept and updated in. ``fp32`` (mixed precision's
    master weights): under a mixed precision, ``prepare_model`` casts 16-bit trainable parameters
    (a bf16 checkpoint loaded the default way) to fp32, and autocast computes in 16 bits from them:
    4 (weight) + 4 (gradient) + 8 (AdamW's moments) = 16 bytes per trainable parameter. ``bf16``
    (pure bf16, token ``weights:bf16``; needs ``precision="bf16"``): the trainable parameters are
    kept (or cast) in bf16 and :func:`hf_memstack.make_optimizer` builds
    :class:`hf_memstack.transforms.optim.bf16_adamw.BF16AdamW` (AdamW with stochastic rounding; torchao's 8-bit
    AdamW with its ``bf16_stochastic_round`` under ``optim:8bit``), whose updates below bf16's resolution are kept in expectation
    instead of rounding away: 2 + 2 + 4 = 8 bytes (6 with ``optim:8bit``). Frozen parameters are
    never cast."""

    def __setattr__(self, name: str, value: object) -> None:
        """Setting a field of a built policy validates it (a policy is never left invalid: a refused
        value is not set); the fields of a sub-config are validated when the policy is next used
        (``validate``, ``to_string``, ``to_dict``, ``prepare_model``)."""
        try:
            old = getattr(self, name)
        except AttributeError:  # the first assignment, by __init__ (or copy, or unpickling): validated in __post_init__
            object.__setattr__(self, name, value)
            return
        problems: list[str] = []
        value = dtype_name(value) if name in DTYPE_FIELDS else value
        cls = SUBCONFIGS.get(name)
        coerced = coerce_subconfig(name, cls, value, problems) if cls is not None else None
        if problems:
            raise PolicyError(problems)
        object.__setattr__(self, name, value if coerced is None else coerced)
        try:
            self.validate()
        except PolicyError:
            object.__setattr__(self, name, old)
            raise

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in DTYPE_FIELDS:  # precision=torch.bfloat16, as Transformers' dtype= is written
            object.__setattr__(self, name, dtype_name(getattr(self, name)))
        for name, cls in SUBCONFIGS.items():
            value = getattr(self, name)
            coerced = coerce_subconfig(name, cls, value, problems)
            if coerced is not None:
                object.__setattr__(self, name, coerced)
        if problems:
            raise PolicyError(problems)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> MemoryPolicy:
        """Check every field; raise one :class:`PolicyError` listing all problems. Returns self."""
        problems = _problems(self)
        if problems:
            raise PolicyError(problems)
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def coerce(cls, policy: MemoryPolicy | str | PolicyDict | None) -> MemoryPolicy:
        """Accept a policy, a preset/feature string, a dict, a path to a YAML file, or None (fp32)."""
        if policy is None:
            return cls()
        if isinstance(policy, MemoryPolicy):
            return policy.validate()
        if isinstance(policy, dict):
            return cls.from_dict(policy)
        if isinstance(policy, Path) or (isinstance(policy, str) and policy.endswith((".yaml", ".yml"))):
            return cls.from_yaml(policy)
        if isinstance(policy, str):
            return cls.from_string(policy)
        raise TypeError(
            f"policy={policy!r} has type {type(policy).__name__}; pass a MemoryPolicy, a string such as "
            f"'bf16+ckpt' (presets: {', '.join(LADDER)}), a dict, or a path to a YAML file"
        )

    @classmethod
    def from_string(cls, spec: str) -> MemoryPolicy:
        """Parse ``"precision+feature+feature"``; order does not matter and the precision may be omitted (fp32).

        Tokens (the grammar is one table, :data:`hf_memstack.policy.tokens.TOKENS`; a test keeps this
        list equal to it):

        * precision: ``fp32``, ``bf16``, ``fp16``, ``auto``;
        * ``ckpt`` (full), ``ckpt:N`` (every N-th block), ``ckpt:offload`` (full + saved inputs to host),
          ``ckpt:selective`` (op level: matmul and attention outputs kept, the rest recomputed),
          ``ckpt:selective:alternate`` (every second matmul recomputed too);
        * ``compile`` (whole model), ``compile:regional`` (per block), ``compile:full``;
        * ``fsdp`` (full_shard), ``fsdp:shard_grad_op``, ``fsdp:hybrid_shard``, ``fsdp:offload``
          (full_shard with CPU offload);
        * ``loss:chunked`` (the causal-LM head and loss a chunk of tokens at a time),
          ``loss:chunked:compiled`` (the per-chunk work between the matmuls compiled);
        * ``quant:nf4`` (the blocks' linear layers in 4 bits, for LoRA), ``quant:nf4:upcast`` (and
          the other 16-bit parameters in fp32, as PEFT's ``prepare_model_for_kbit_training``);
        * ``mlp:tiled`` (each block's MLP over tiles of tokens);
        * ``optim:8bit`` (8-bit AdamW moments), ``optim:in_backward`` (step each parameter as its
          gradient is ready); both may be given;
        * ``weights:bf16`` (pure bf16: trainable weights kept in bf16, AdamW with stochastic
          rounding), ``weights:fp32`` (fp32 master weights, the default);
        * ``sp:N`` (sequence parallelism: each row's tokens sharded over N ranks, attention
          head-sharded after an all-to-all (Ulysses); 2 <= N <= 1024).

        A ladder preset name (``fp32``, ``bf16``, ``bf16+compile``, ``bf16+compile+ckpt``, ``fsdp``)
        is such a string. ``fsdp`` is the one whose name is not its tokens: alone it is the preset
        ``bf16+ckpt+fsdp``; joined with other tokens it is the FSDP token only, read with the
        precision the string names (``bf16+fsdp``, ``fp32+ckpt+fsdp``). A string joining it that
        names no precision (``fsdp+loss:chunked``) is refused, naming both readings
        (``bf16+ckpt+fsdp+loss:chunked``, the preset with the addition; ``fp32+fsdp+loss:chunked``,
        the tokens as written): read either way silently, it trains in fp32 without the preset's
        checkpointing, or with settings the string does not name.
        """
        if not isinstance(spec, str):
            raise TypeError(f"policy string must be a str, got {type(spec).__name__}")
        kwargs, problems = tokens.parse(spec)
        if problems:
            raise PolicyError(problems)
        return cls(**kwargs)

    @classmethod
    def from_dict(cls, data: PolicyDict) -> MemoryPolicy:
        """Build from a nested dict such as ``to_dict()`` returns; unknown keys are errors."""
        if not isinstance(data, dict):
            raise TypeError(f"policy dict must be a dict, got {type(data).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise PolicyError(
                [f"policy.{k} is not a policy field; allowed fields: {', '.join(allowed)}" for k in unknown]
            )
        return cls(**data)

    def to_dict(self) -> PolicyDict:
        """A plain nested dict (YAML/JSON friendly) that ``from_dict`` turns back into an equal policy.

        Raises:
            PolicyError: a field was changed to an invalid value since the policy was built.
        """
        self.validate()
        out = dataclasses.asdict(self)
        ck = out["checkpointing"]
        if ck["block_classes"] is not None:
            ck["block_classes"] = list(ck["block_classes"])
        if out["quant"]["targets"] is not None:
            out["quant"]["targets"] = list(out["quant"]["targets"])
        return out

    @classmethod
    def from_yaml(cls, path: str | Path) -> MemoryPolicy:
        """Read a policy from a YAML file (the ``to_dict`` layout, optionally under a ``policy:`` key)."""
        path = Path(path).expanduser()
        data = read_policy_file(path)
        if data is None:
            raise PolicyError(
                [
                    f"policy file {str(path)!r} is empty; write policy fields (precision: bf16, checkpointing: full, ...) "
                    "or a policy string"
                ]
            )
        if isinstance(data, dict) and set(data) == {"policy"}:
            data = data["policy"]
        if isinstance(data, str):
            return cls.from_string(data)
        if not isinstance(data, dict):
            raise PolicyError(
                [
                    f"policy file {str(path)!r} holds {type(data).__name__} {reprlib.repr(data)}, not a mapping; write a mapping of policy "
                    "fields (precision: bf16, checkpointing: full, ...) or a policy string"
                ]
            )
        return cls.from_dict(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The policy as YAML text; also written to ``path`` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_string(self) -> str:
        """The shortest ``+`` string for this policy, when one exists (options without a token are dropped).

        Raises:
            PolicyError: a field was changed to an invalid value since the policy was built (an
                invalid policy is never printed as if it were one).
        """
        self.validate()
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return tokens.to_string(values, {f.name: getattr(_DEFAULT, f.name) for f in dataclasses.fields(self)})


def _problems(policy: MemoryPolicy) -> list[str]:
    """Every problem of a policy: each field's, then those between fields."""
    problems: list[str] = []
    check_choice(problems, "policy.precision", policy.precision, Precision)
    validate_checkpointing(policy.checkpointing, problems)
    validate_compile(policy.compile, problems)
    validate_fsdp(policy.fsdp, problems)
    validate_loss(policy.loss, problems)
    validate_quant(policy.quant, problems)
    validate_mlp(policy.mlp, problems)
    validate_optimizer(policy.optimizer, problems)
    validate_sequence_parallel(policy.sequence_parallel, problems)
    check_choice(problems, "policy.master_weights", policy.master_weights, MasterWeights)
    if policy.master_weights == "bf16" and policy.precision != "bf16":
        problems.append(
            f"policy.master_weights='bf16' (pure bf16 training) with policy.precision={policy.precision!r}: pure bf16 computes "
            "and updates in bf16, so the precision must be 'bf16' ('auto' may resolve to fp16 or fp32); use "
            "'bf16+weights:bf16', or master_weights='fp32'"
        )
    if policy.fsdp.mode != "none" and policy.checkpointing.mode == "offload":
        problems.append(
            "policy.checkpointing.mode='offload' with policy.fsdp.mode="
            f"{policy.fsdp.mode!r}: use fsdp.cpu_offload=True to move state to host memory under FSDP, "
            "and checkpointing.mode='full'"
        )
    if policy.optimizer.step == "in_backward" and policy.precision == "fp16":
        problems.append(
            "policy.optimizer.step='in_backward' with policy.precision='fp16': fp16's GradScaler must see every "
            "gradient (to unscale and skip steps on overflow) before any parameter is updated; use precision='bf16' "
            "(or 'fp32'), or step='after_backward'"
        )
    return problems


_DEFAULT = MemoryPolicy()  # to_string leaves out the fields at these values (built last: it validates)
