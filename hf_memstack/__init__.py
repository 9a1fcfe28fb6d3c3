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
import warnings
from typing import TYPE_CHECKING

from ._lazy import install_moved_modules
from ._quiet import quiet_imports
from ._version import __version__

install_moved_modules()  # old module paths (before the layout step) still import, with a DeprecationWarning

# The public API in three tiers, as Accelerate keeps ~30 names at its top: (a) core, what a user calls;
# (b) results, the records those calls return; (c) helpers. A feature's own names live in its
# submodule (hf_memstack.policy, .distributed, .measure, .transforms.<feature>, .batch_size); those
# that were once here still import from here, with a DeprecationWarning naming their new home (_MOVED).

if TYPE_CHECKING:  # (a) core: prepare, verify, measure, find, estimate, plan, the policy, the Trainer helpers
    from .batch_size import find_batch_size, find_executable_batch_size
    from .errors import BudgetTooSmallError, PolicyError
    from .integrations.trainer import MemstackCallback, add_memstack_callback, training_arguments
    from .measure.memory import measure_step
    from .measure.verify import verify
    from .merge import dequantize, merge_adapters
    from .planning.estimate.estimator import estimate_memory
    from .planning.plan.planner import plan_policy
    from .policy import MemoryPolicy
    from .policy.presets import LADDER
    from .prepare import describe, prepare_model
    from .transforms.optim.optimizer import make_optimizer

if TYPE_CHECKING:  # (b) results: what the core calls return
    from .batch_size import BatchSizeResult
    from .measure.memory import StepMemory
    from .measure.simulated import SimulatedMemory
    from .measure.verify import VerifyReport
    from .planning.estimate.result import MemoryEstimate
    from .planning.plan.planner import Plan
    from .record import MemstackRecord

if TYPE_CHECKING:  # (c) helpers: sizes, bytes, a CPU device of a given size, the record behind a wrapper
    from .measure.accounting import tensor_bytes
    from .measure.simulated import simulated_memory_limit
    from .record import record_of, unwrap_model
    from .sizes import format_bytes, parse_bytes

# (a) core: public name -> the module that defines it. The Trainer helpers import Transformers, on access only.
_CORE = {
    "find_batch_size": ".batch_size",
    "find_executable_batch_size": ".batch_size",
    "BudgetTooSmallError": ".errors",
    "PolicyError": ".errors",
    "MemstackCallback": ".integrations.trainer",
    "add_memstack_callback": ".integrations.trainer",
    "training_arguments": ".integrations.trainer",
    "measure_step": ".measure.memory",
    "verify": ".measure.verify",
    "dequantize": ".merge",
    "merge_adapters": ".merge",
    "estimate_memory": ".planning.estimate.estimator",
    "plan_policy": ".planning.plan.planner",
    "LADDER": ".policy.presets",
    "MemoryPolicy": ".policy",
    "describe": ".prepare",
    "prepare_model": ".prepare",
    "make_optimizer": ".transforms.optim.optimizer",
}
# (b) results
_RESULTS = {
    "BatchSizeResult": ".batch_size",
    "StepMemory": ".measure.memory",
    "SimulatedMemory": ".measure.simulated",
    "VerifyReport": ".measure.verify",
    "MemoryEstimate": ".planning.estimate.result",
    "Plan": ".planning.plan.planner",
    "MemstackRecord": ".record",
}
# (c) helpers
_HELPERS = {
    "tensor_bytes": ".measure.accounting",
    "simulated_memory_limit": ".measure.simulated",
    "record_of": ".record",
    "unwrap_model": ".record",
    "format_bytes": ".sizes",
    "parse_bytes": ".sizes",
}
_LAZY = {**_CORE, **_RESULTS, **_HELPERS}

# Names that moved to their feature's submodule: old top-level name -> the submodule users import it from now.
# Each still resolves here (the same object), warning once with its new import line; none is in __all__ or dir().
_MOVED = {
    "Fit": "hf_memstack.batch_size",
    "Probe": "hf_memstack.batch_size",
    "DistributedMismatchError": "hf_memstack.distributed",
    "accelerate_fsdp_plugin": "hf_memstack.distributed",
    "from_pretrained_for_fsdp": "hf_memstack.distributed",
    "load_sharded_checkpoint": "hf_memstack.distributed",
    "save_pretrained_full": "hf_memstack.distributed",
    "save_sharded_checkpoint": "hf_memstack.distributed",
    "ModelStateBytes": "hf_memstack.measure",
    "forward_loss": "hf_memstack.measure",
    "model_state_bytes": "hf_memstack.measure",
    "train_step": "hf_memstack.measure",
    "CheckpointingConfig": "hf_memstack.policy",
    "CompileConfig": "hf_memstack.policy",
    "FSDPConfig": "hf_memstack.policy",
    "LossConfig": "hf_memstack.policy",
    "MLPConfig": "hf_memstack.policy",
    "OptimizerConfig": "hf_memstack.policy",
    "QuantConfig": "hf_memstack.policy",
    "Blocks": "hf_memstack.transforms.blocks",
    "find_blocks": "hf_memstack.transforms.blocks",
    "LossHeadResult": "hf_memstack.transforms.loss_head",
    "chunked_lm_loss": "hf_memstack.transforms.loss_head",
    "OptimizerInBackward": "hf_memstack.transforms.optim",
    "QuantResult": "hf_memstack.transforms.quant",
}
_warned: set[str] = set()

__all__ = [
    # (a) core
    "BudgetTooSmallError",
    "LADDER",
    "MemoryPolicy",
    "MemstackCallback",
    "PolicyError",
    "add_memstack_callback",
    "dequantize",
    "describe",
    "estimate_memory",
    "find_batch_size",
    "find_executable_batch_size",
    "make_optimizer",
    "measure_step",
    "merge_adapters",
    "plan_policy",
    "prepare_model",
    "training_arguments",
    "verify",
    # (b) results
    "BatchSizeResult",
    "MemoryEstimate",
    "MemstackRecord",
    "Plan",
    "SimulatedMemory",
    "StepMemory",
    "VerifyReport",
    # (c) helpers
    "__version__",
    "format_bytes",
    "parse_bytes",
    "record_of",
    "simulated_memory_limit",
    "tensor_bytes",
    "unwrap_model",
]


def _moved(name: str) -> object:
    home = _MOVED[name]
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"hf_memstack.{name} moved to {home}: use `from {home} import {name}` "
            "(the top-level name will be removed in a later release)",
            DeprecationWarning,
            stacklevel=3,  # the line that imported or read the name
        )
    with quiet_imports():
        # Not cached in globals(): dir() leaves it out, and __getattr__ keeps answering for it.
        return getattr(importlib.import_module(home), name)


def __getattr__(name: str) -> object:
    if name in _MOVED:
        return _moved(name)
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
