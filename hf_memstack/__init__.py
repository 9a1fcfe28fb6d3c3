"""hf_memstack: activation checkpointing, mixed precision, torch.compile and FSDP for any
Hugging Face model, applied in the order the field recommends, verified and measured.

    from hf_memstack import prepare_model
    model = prepare_model(model, "bf16+ckpt")
"""

from .batch_size import BatchSizeResult, Probe, find_batch_size
from .blocks import Blocks, find_blocks
from .estimate import MemoryEstimate, estimate_memory
from .fsdp import accelerate_fsdp_plugin, from_pretrained_for_fsdp, save_pretrained_full
from .memory import StepMemory, format_bytes, measure_step, model_state_bytes, parse_bytes
from .planner import Plan, plan_policy
from .policy import LADDER, CheckpointingConfig, CompileConfig, FSDPConfig, MemoryPolicy, PolicyError
from .prepare import MemstackRecord, describe, prepare_model
from .step import forward_loss, train_step
from .verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "LADDER",
    "BatchSizeResult",
    "Blocks",
    "CheckpointingConfig",
    "CompileConfig",
    "FSDPConfig",
    "MemoryPolicy",
    "MemoryEstimate",
    "MemstackRecord",
    "Plan",
    "PolicyError",
    "Probe",
    "StepMemory",
    "VerifyReport",
    "accelerate_fsdp_plugin",
    "describe",
    "estimate_memory",
    "find_batch_size",
    "find_blocks",
    "format_bytes",
    "forward_loss",
    "from_pretrained_for_fsdp",
    "measure_step",
    "model_state_bytes",
    "parse_bytes",
    "plan_policy",
    "prepare_model",
    "save_pretrained_full",
    "train_step",
    "verify",
]
