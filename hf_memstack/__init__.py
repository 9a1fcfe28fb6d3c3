"""hf_memstack: activation checkpointing (block or op level), mixed precision, torch.compile, FSDP,
a chunked loss head, 4-bit base weights and low-memory optimizers for any Hugging Face model,
applied in the order the field recommends, verified and measured.

    from hf_memstack import prepare_model
    model = prepare_model(model, "bf16+ckpt")
"""

# Nothing heavy is imported here: each public name below loads its module on first use (PEP 562), so
# `import hf_memstack` and `hf-memstack --help` stay quiet and fast, and torch, Transformers and the
# optional backends (torchao, bitsandbytes, PEFT, TRL, matplotlib) load only when a function needs them.

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from ._quiet import quiet_imports
from ._version import __version__

if TYPE_CHECKING:
    from .batch_size import BatchSizeResult, Fit, Probe, find_batch_size, find_executable_batch_size
    from .distributed.accelerate import accelerate_fsdp_plugin
    from .distributed.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from .distributed.weights import from_pretrained_for_fsdp, save_pretrained_full
    from .errors import BudgetTooSmallError, DistributedMismatchError, PolicyError
    from .measure.accounting import ModelStateBytes, model_state_bytes, tensor_bytes
    from .measure.memory import StepMemory, measure_step
    from .measure.simulated import SimulatedMemory, simulated_memory_limit
    from .measure.step import forward_loss, train_step
    from .measure.verify import VerifyReport, verify
    from .merge import dequantize, merge_adapters
    from .planning.estimate.estimator import MemoryEstimate, estimate_memory
    from .planning.plan.planner import Plan, plan_policy
    from .planning.plan.rungs import LADDER
    from .policy import (
        CheckpointingConfig,
        CompileConfig,
        FSDPConfig,
        LossConfig,
        MemoryPolicy,
        MLPConfig,
        OptimizerConfig,
        QuantConfig,
    )
    from .prepare import describe, prepare_model
    from .record import MemstackRecord, record_of, unwrap_model
    from .sizes import format_bytes, parse_bytes
    from .transforms.blocks import Blocks, find_blocks
    from .transforms.loss_head.chunked import chunked_lm_loss
    from .transforms.loss_head.result import LossHeadResult
    from .transforms.optim.in_backward import OptimizerInBackward
    from .transforms.optim.optimizer import make_optimizer
    from .transforms.quant.apply import QuantResult

# public name -> the module that defines it
_LAZY = {
    "BatchSizeResult": ".batch_size",
    "Fit": ".batch_size",
    "Probe": ".batch_size",
    "find_batch_size": ".batch_size",
    "find_executable_batch_size": ".batch_size",
    "accelerate_fsdp_plugin": ".distributed.accelerate",
    "load_sharded_checkpoint": ".distributed.checkpoint",
    "save_sharded_checkpoint": ".distributed.checkpoint",
    "from_pretrained_for_fsdp": ".distributed.weights",
    "save_pretrained_full": ".distributed.weights",
    "BudgetTooSmallError": ".errors",
    "DistributedMismatchError": ".errors",
    "PolicyError": ".errors",
    "ModelStateBytes": ".measure.accounting",
    "model_state_bytes": ".measure.accounting",
    "tensor_bytes": ".measure.accounting",
    "StepMemory": ".measure.memory",
    "measure_step": ".measure.memory",
    "SimulatedMemory": ".measure.simulated",
    "simulated_memory_limit": ".measure.simulated",
    "forward_loss": ".measure.step",
    "train_step": ".measure.step",
    "VerifyReport": ".measure.verify",
    "verify": ".measure.verify",
    "dequantize": ".merge",
    "merge_adapters": ".merge",
    "MemoryEstimate": ".planning.estimate.estimator",
    "estimate_memory": ".planning.estimate.estimator",
    "Plan": ".planning.plan.planner",
    "plan_policy": ".planning.plan.planner",
    "LADDER": ".planning.plan.rungs",
    "CheckpointingConfig": ".policy",
    "CompileConfig": ".policy",
    "FSDPConfig": ".policy",
    "LossConfig": ".policy",
    "MemoryPolicy": ".policy",
    "MLPConfig": ".policy",
    "OptimizerConfig": ".policy",
    "QuantConfig": ".policy",
    "describe": ".prepare",
    "prepare_model": ".prepare",
    "MemstackRecord": ".record",
    "record_of": ".record",
    "unwrap_model": ".record",
    "format_bytes": ".sizes",
    "parse_bytes": ".sizes",
    "Blocks": ".transforms.blocks",
    "find_blocks": ".transforms.blocks",
    "chunked_lm_loss": ".transforms.loss_head.chunked",
    "LossHeadResult": ".transforms.loss_head.result",
    "make_optimizer": ".transforms.optim.optimizer",
    "OptimizerInBackward": ".transforms.optim.in_backward",
    "QuantResult": ".transforms.quant.apply",
}

__all__ = [
    "LADDER",
    "BatchSizeResult",
    "Blocks",
    "BudgetTooSmallError",
    "CheckpointingConfig",
    "CompileConfig",
    "DistributedMismatchError",
    "FSDPConfig",
    "Fit",
    "LossConfig",
    "LossHeadResult",
    "MLPConfig",
    "MemoryEstimate",
    "MemoryPolicy",
    "MemstackRecord",
    "ModelStateBytes",
    "OptimizerConfig",
    "OptimizerInBackward",
    "Plan",
    "PolicyError",
    "Probe",
    "QuantConfig",
    "QuantResult",
    "SimulatedMemory",
    "StepMemory",
    "VerifyReport",
    "__version__",
    "accelerate_fsdp_plugin",
    "describe",
    "estimate_memory",
    "find_batch_size",
    "chunked_lm_loss",
    "dequantize",
    "find_blocks",
    "find_executable_batch_size",
    "format_bytes",
    "forward_loss",
    "from_pretrained_for_fsdp",
    "load_sharded_checkpoint",
    "make_optimizer",
    "merge_adapters",
    "measure_step",
    "model_state_bytes",
    "parse_bytes",
    "plan_policy",
    "prepare_model",
    "record_of",
    "save_pretrained_full",
    "save_sharded_checkpoint",
    "simulated_memory_limit",
    "tensor_bytes",
    "train_step",
    "unwrap_model",
    "verify",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        # A subpackage or module (hf_memstack.transforms, ...) reached as an attribute, as the eager
        # package made possible; anything else is a real AttributeError.
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        with quiet_imports():
            return importlib.import_module(f"{__name__}.{name}")
    with quiet_imports():  # Transformers imports torchao here when it is installed: drop its noise
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
