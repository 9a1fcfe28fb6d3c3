"""The memory policy: which of mixed precision, activation checkpointing (block or op level),
torch.compile, FSDP, a chunked loss head, 4-bit base weights and a low-memory optimizer to use, as
a tree of typed dataclasses; and over how many ranks to shard each row's sequence (``sp:N``).

A policy can be built four ways, all validated the same way:

* keyword arguments: ``MemoryPolicy(precision="bf16", checkpointing="full")``
  (a sub-config accepts its dataclass, its mode as a string, or a dict of its fields);
* a string joining a precision and features with ``+``: ``"bf16+compile+ckpt"``
  (see :func:`MemoryPolicy.from_string` for the grammar; the ladder presets are such strings);
* a dict (``from_dict`` / ``to_dict``) or a YAML file (``from_yaml`` / ``to_yaml``).

Validation collects every problem and raises one :class:`PolicyError` naming each field,
the bad value, the allowed values and the fix.

    config.py         the dataclass tree (the sub-configs and their allowed values)
    memory_policy.py  MemoryPolicy: construction, coercion, dict / YAML / string round trips
    tokens.py         the policy string's grammar: one table of token -> config fragment
    validate.py       every field's check and the combinations refused
    presets.py        the ladder's preset names
"""

from __future__ import annotations

from ..errors import PolicyError
from .config import (
    MAX_EVERY_N,
    MAX_SEQUENCE_PARALLEL,
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
from .memory_policy import MemoryPolicy
from .presets import LADDER

__all__ = [
    "LADDER",
    "MAX_EVERY_N",
    "MAX_SEQUENCE_PARALLEL",
    "CheckpointingConfig",
    "CompileConfig",
    "FSDPConfig",
    "LossConfig",
    "MLPConfig",
    "MasterWeights",
    "MemoryPolicy",
    "OptimizerConfig",
    "PolicyError",
    "Precision",
    "QuantConfig",
    "SequenceParallelConfig",
]
