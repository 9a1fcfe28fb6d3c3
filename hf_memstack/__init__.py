"""hf_memstack: activation checkpointing (block or op level), mixed precision, torch.compile, FSDP,
a chunked loss head, 4-bit base weights and low-memory optimizers for any Hugging Face model,
applied in the order the field recommends, verified and measured.

    from hf_memstack import prepare_model
    model = prepare_model(model, "bf16+ckpt")
"""

from ._version import __version__
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
from .planning.estimate import MemoryEstimate, estimate_memory
from .planning.planner import Plan, plan_policy
from .planning.rungs import LADDER
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
from .transforms.chunked_loss import chunked_lm_loss
from .transforms.loss_result import LossHeadResult
from .transforms.optim import make_optimizer
from .transforms.optim_in_backward import OptimizerInBackward
from .transforms.quant import QuantResult

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
