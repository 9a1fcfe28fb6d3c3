"""Validation of a policy: every field checked against what it allows, then the combinations that
cannot work together, each problem naming the field, the value, what is allowed and the fix;
and the coercion of a sub-config given as a mode string or a dict."""

from __future__ import annotations

import dataclasses
from typing import cast, get_args

from .config import (
    MAX_EVERY_N,
    MAX_SEQUENCE_PARALLEL,
    CheckpointingConfig,
    CheckpointingMode,
    CompileConfig,
    CompileInductorMode,
    CompileMode,
    FSDPConfig,
    FSDPMode,
    LossConfig,
    LossMode,
    MLPConfig,
    MLPMode,
    OptimizerConfig,
    OptimizerState,
    OptimizerStep,
    QuantConfig,
    QuantMode,
    SelectiveMatmuls,
    SequenceParallelConfig,
)

__all__ = [
    "DTYPE_FIELDS",
    "check_choice",
    "coerce_subconfig",
    "dtype_name",
    "optimizer_from_string",
    "validate_checkpointing",
    "validate_compile",
    "validate_fsdp",
    "validate_loss",
    "validate_mlp",
    "validate_optimizer",
    "validate_quant",
    "validate_sequence_parallel",
]


def optimizer_from_string(value: str) -> OptimizerConfig | None:
    """``"8bit"``, ``"in_backward"``, ``"8bit+in_backward"``, ``"fp32"``, ``"after_backward"`` (None: not one of those)."""
    config: OptimizerConfig | None = OptimizerConfig()
    for part in value.split("+"):
        part = part.strip()
        # The casts hold: each branch has just checked ``part`` against the Literal's values.
        if part in get_args(OptimizerState):
            config = OptimizerConfig(state=cast(OptimizerState, part), step=config.step) if config else None
        elif part in get_args(OptimizerStep):
            config = OptimizerConfig(state=config.state, step=cast(OptimizerStep, part)) if config else None
        else:
            return None
    return config


def validate_checkpointing(ck: CheckpointingConfig, problems: list[str]) -> None:
    if ck.mode == "selective:alternate":  # the string token's spelling, given as a mode
        problems.append(
            "policy.checkpointing.mode='selective:alternate' is not a mode; use mode='selective' with "
            "selective_matmuls='save_alternate' (the policy string's token is 'ckpt:selective:alternate')"
        )
    else:
        check_choice(problems, "policy.checkpointing.mode", ck.mode, CheckpointingMode)
    if not isinstance(ck.every_n, int) or isinstance(ck.every_n, bool) or ck.every_n < 2:
        problems.append(
            f"policy.checkpointing.every_n={ck.every_n!r} must be an integer >= 2 "
            "(use mode='full' to checkpoint every block)"
        )
    elif ck.every_n > MAX_EVERY_N:
        problems.append(
            f"policy.checkpointing.every_n={ck.every_n} must be at most {MAX_EVERY_N} (one block in N is "
            "checkpointed; no model has that many blocks); use a number of blocks, or mode='full'"
        )
    elif ck.every_n != 2 and ck.mode != "every_n":
        # 2 is the default, written by to_dict for every mode: it cannot be told from an explicit 2.
        problems.append(
            f"policy.checkpointing.every_n={ck.every_n} only applies to mode='every_n' (mode is {ck.mode!r}, "
            "which would ignore it); set mode='every_n' or drop every_n"
        )
    check_bool(problems, "policy.checkpointing.use_reentrant", ck.use_reentrant)
    check_choice(problems, "policy.checkpointing.selective_matmuls", ck.selective_matmuls, SelectiveMatmuls)
    if ck.selective_matmuls != "save_all" and ck.mode != "selective":
        problems.append(
            f"policy.checkpointing.selective_matmuls={ck.selective_matmuls!r} only applies to mode='selective' "
            f"(mode is {ck.mode!r}); set mode='selective' or drop selective_matmuls"
        )
    if ck.mode == "selective" and ck.use_reentrant is True:
        problems.append(
            "policy.checkpointing.use_reentrant=True with mode='selective': op-level checkpointing runs through the "
            "non-reentrant implementation only (its context_fn); set use_reentrant=False"
        )
    if ck.block_classes is not None:
        if isinstance(ck.block_classes, str):
            object.__setattr__(ck, "block_classes", (ck.block_classes,))
        elif isinstance(ck.block_classes, list):
            object.__setattr__(ck, "block_classes", tuple(ck.block_classes))
        if (
            not isinstance(ck.block_classes, tuple)
            or not ck.block_classes
            or not all(isinstance(c, str) and c for c in ck.block_classes)
        ):
            problems.append(
                f"policy.checkpointing.block_classes={ck.block_classes!r} must be a non-empty list of "
                "class names, e.g. ['LlamaDecoderLayer'], or None to detect the blocks"
            )


def validate_compile(co: CompileConfig, problems: list[str]) -> None:
    check_choice(problems, "policy.compile.mode", co.mode, CompileMode)
    if not isinstance(co.backend, str) or not co.backend:
        problems.append(f"policy.compile.backend={co.backend!r} must be a backend name such as 'inductor'")
    if co.inductor_mode is not None:
        check_choice(problems, "policy.compile.inductor_mode", co.inductor_mode, CompileInductorMode)
        if co.backend != "inductor":
            problems.append(
                f"policy.compile.inductor_mode={co.inductor_mode!r} only applies to backend='inductor' "
                f"(backend is {co.backend!r}); set inductor_mode=None or backend='inductor'"
            )
    if co.dynamic not in (None, True, False):
        problems.append(f"policy.compile.dynamic={co.dynamic!r} must be None, True or False")
    check_bool(problems, "policy.compile.fullgraph", co.fullgraph)


def validate_fsdp(fs: FSDPConfig, problems: list[str]) -> None:
    check_choice(problems, "policy.fsdp.mode", fs.mode, FSDPMode)
    check_bool(problems, "policy.fsdp.cpu_offload", fs.cpu_offload)
    if fs.reshard_after_forward not in (None, True, False):
        problems.append(f"policy.fsdp.reshard_after_forward={fs.reshard_after_forward!r} must be None, True or False")
    if fs.mode == "none" and (fs.cpu_offload or fs.reshard_after_forward is not None):
        problems.append(
            "policy.fsdp.cpu_offload / reshard_after_forward are set but policy.fsdp.mode='none'; "
            "set fsdp.mode='full_shard' (or another mode) or drop those options"
        )


def validate_loss(lo: LossConfig, problems: list[str]) -> None:
    check_choice(problems, "policy.loss.mode", lo.mode, LossMode)
    n = lo.chunk_tokens
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        problems.append(
            f"policy.loss.chunk_tokens={n!r} must be a positive integer (tokens per chunk) or None (sized to the vocabulary)"
        )
    elif n is not None and lo.mode != "chunked":
        problems.append(
            f"policy.loss.chunk_tokens={n!r} only applies to mode='chunked' (mode is {lo.mode!r}); set "
            "mode='chunked' or drop chunk_tokens"
        )
    check_bool(problems, "policy.loss.compiled", lo.compiled)
    if lo.compiled is True and lo.mode != "chunked":
        problems.append(
            f"policy.loss.compiled=True only applies to mode='chunked' (mode is {lo.mode!r}); set "
            "mode='chunked' (token 'loss:chunked:compiled') or drop compiled"
        )


def validate_quant(qu: QuantConfig, problems: list[str]) -> None:
    check_choice(problems, "policy.quant.mode", qu.mode, QuantMode)
    check_bool(problems, "policy.quant.upcast", qu.upcast)
    n = qu.block_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 16 or n > 4096 or n & (n - 1):
        problems.append(f"policy.quant.block_size={n!r} must be a power of two from 16 to 4096 (QLoRA's is 64)")
    if isinstance(qu.targets, (list, str)):
        object.__setattr__(qu, "targets", (qu.targets,) if isinstance(qu.targets, str) else tuple(qu.targets))
    if qu.targets is not None and (
        not isinstance(qu.targets, tuple)
        or not qu.targets
        or not all(isinstance(t, str) and t.strip() for t in qu.targets)
    ):
        problems.append(
            f"policy.quant.targets={qu.targets!r} must be a non-empty list of module names (e.g. ['q_proj', "
            "'v_proj']), or None for every linear layer of the blocks"
        )
    if qu.mode == "none" and (qu.upcast or qu.targets is not None):
        problems.append(
            "policy.quant.upcast / targets are set but policy.quant.mode='none'; set quant.mode='nf4' or drop them"
        )


def validate_mlp(ml: MLPConfig, problems: list[str]) -> None:
    check_choice(problems, "policy.mlp.mode", ml.mode, MLPMode)
    n = ml.tile_tokens
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        problems.append(
            f"policy.mlp.tile_tokens={n!r} must be a positive integer (tokens per tile) or None (the hidden size)"
        )
    if ml.module_name is not None and (not isinstance(ml.module_name, str) or not ml.module_name):
        problems.append(
            f"policy.mlp.module_name={ml.module_name!r} must be the MLP's name inside a block (e.g. 'mlp') or None"
        )
    if ml.mode != "tiled" and (n is not None or ml.module_name is not None):
        problems.append(
            f"policy.mlp.tile_tokens / module_name only apply to mode='tiled' (mode is {ml.mode!r}); set "
            "mode='tiled' or drop them"
        )


def validate_optimizer(op: OptimizerConfig, problems: list[str]) -> None:
    check_choice(problems, "policy.optimizer.state", op.state, OptimizerState)
    check_choice(problems, "policy.optimizer.step", op.step, OptimizerStep)


def validate_sequence_parallel(sp: SequenceParallelConfig, problems: list[str]) -> None:
    n = sp.size
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SEQUENCE_PARALLEL:
        problems.append(
            f"policy.sequence_parallel.size={n!r} must be an integer from 1 (off) to {MAX_SEQUENCE_PARALLEL}: the "
            "ranks each row's sequence is sharded over (token 'sp:N'); use a divisor of the world size and of "
            "the model's attention heads, or 1 to turn sequence parallelism off"
        )


def coerce_subconfig(name: str, cls: type, value: object, problems: list[str]) -> object:
    if isinstance(value, cls):
        return None
    if isinstance(value, str) and cls is OptimizerConfig:
        parsed = optimizer_from_string(value)
        if parsed is None:
            problems.append(
                f"policy.{name}={value!r} is not an optimizer setting; allowed: 'fp32' or '8bit' (state), "
                "'after_backward' or 'in_backward' (step), joined with '+', e.g. '8bit+in_backward'"
            )
        return parsed
    if cls is SequenceParallelConfig and isinstance(value, int) and not isinstance(value, bool):
        return SequenceParallelConfig(size=value)  # sequence_parallel=2, as the token sp:2
    if isinstance(value, str) and cls is SequenceParallelConfig:
        problems.append(
            f"policy.{name}={value!r} is not a sequence-parallel setting; pass the size as an integer "
            "(sequence_parallel=2), a dict ({'size': 2}) or the policy string's token 'sp:2'"
        )
        return None
    if isinstance(value, str):
        return cls(mode=value)
    if isinstance(value, dict):
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in allowed]
        if unknown:
            problems.extend(
                f"policy.{name}.{k} is not a field of {cls.__name__}; allowed: {', '.join(allowed)}" for k in unknown
            )
            return None
        return cls(**value)
    if value is None:
        return cls()
    as_string = (
        "a string such as '8bit+in_backward'"
        if cls is OptimizerConfig
        else "an integer size"
        if cls is SequenceParallelConfig
        else "a mode string"
    )
    problems.append(
        f"policy.{name}={value!r} has type {type(value).__name__}; pass {cls.__name__}(...), {as_string} or a dict"
    )
    return None


# The fields that name a dtype, and the torch dtypes they take for their names.
DTYPE_FIELDS = ("precision", "master_weights")
_TORCH_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def dtype_name(value: object) -> object:
    """``torch.bfloat16`` -> ``"bf16"`` (and fp16, fp32); anything else as given, for validation to judge."""
    return _TORCH_DTYPE_NAMES.get(str(value), value) if type(value).__name__ == "dtype" else value


def check_choice(problems: list[str], where: str, value: object, literal: object) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        problems.append(f"{where}={value!r} is not one of {', '.join(repr(a) for a in allowed)}; pick one of those")


def check_bool(problems: list[str], where: str, value: object) -> None:
    if not isinstance(value, bool):
        problems.append(f"{where}={value!r} must be True or False")
