"""The estimator: ``estimate_memory`` runs the real ``prepare_model`` and training step on fake tensors
(shapes and dtypes, no storage) and reads one step's peak per rank, by category and phase.

estimator.py      estimate_memory: the arguments, the trace, the estimate
result.py         MemoryEstimate: the estimate's record and its summary line
checks.py         what it refuses before tracing (arguments, a model without blocks, the loss head)
trace.py          one job traced on fake tensors (a train step or an eval forward)
depth.py          a deep stack traced at two shallow depths and extrapolated
build_cache.py    the fake model and depth plan, built once per config and job
accounting.py     the trace as one rank's numbers: eval's kept logits, the dtype note
fsdp_shards.py    one FSDP rank's bytes from the single-device trace
fsdp_dtypes.py    an FSDP job traced in the dtypes a rank computes in (FSDP2's param_dtype)
sequence_shards.py  one sequence-parallel (sp:N) rank traced at S/N tokens through Ulysses on fake exchanges
trainable.py      what trains: everything, LoRA, a PEFT config, or what a PEFT model says
weights_dtype.py  the dtype from_pretrained would give the weights (``dtype="auto"``)
eval_logits.py    the outputs ``Trainer.evaluate()`` keeps

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here is listed, and each ``name`` below is in the file named):

- ``hf_memstack/__init__.py``: ``estimate_memory`` and ``MemoryEstimate`` in the public API
- ``hf_memstack/planning/__init__.py``: ``estimate_memory``
- ``hf_memstack/cli/main.py``: ``estimate_memory`` behind ``_estimate`` (the `hf-memstack estimate` command)
- ``hf_memstack/integrations/trainer_eval.py``: ``kept_outputs``: what evaluation keeps
- ``hf_memstack/planning/model/config.py``: ``apply_peft`` and ``cast_like_from_pretrained``
- ``hf_memstack/planning/model/fake.py``: ``build_cache``, ``apply_peft`` and ``set_dtypes``
- ``hf_memstack/planning/model/fake_experts.py``: ``text_config``
- ``hf_memstack/planning/plan/planner.py``: ``with_depth``, ``peft_config_from`` and ``resolve_weights_dtype``
- ``hf_memstack/planning/plan/estimates.py``: ``estimate_memory`` for each rung
- ``hf_memstack/planning/plan/advice.py``: ``MemoryEstimate``
- ``hf_memstack/planning/plan/result.py``: ``MemoryEstimate``
- ``hf_memstack/planning/plan/walk.py``: ``MemoryEstimate``
- ``hf_memstack/planning/plan/states_floor.py``: ``build_cache``
- ``hf_memstack/planning/plan/head_speed.py``: ``num_layers`` and ``text_config``: the head's share of a step
- ``hf_memstack/planning/plan/sequence_rungs.py``: ``heads_of``: the degrees sp:N can take
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from ..model.config import build_model, check_seq_len, infer_task, load_config, task_note
    from .checks import chunked_loss_problem
    from .estimator import estimate_memory
    from .result import MemoryEstimate
    from .trainable import DEFAULT_LORA, peft_config_from

# public name -> the module that defines it. Besides the estimator's own two, the names the module
# planning/estimate.py exported before the layout step (its __all__), so code that imported them still does.
_EXPORTS = {
    "build_model": "..model.config",
    "check_seq_len": "..model.config",
    "infer_task": "..model.config",
    "load_config": "..model.config",
    "task_note": "..model.config",
    "chunked_loss_problem": ".checks",
    "estimate_memory": ".estimator",
    "MemoryEstimate": ".result",
    "DEFAULT_LORA": ".trainable",
    "peft_config_from": ".trainable",
}

__all__ = [
    "DEFAULT_LORA",
    "MemoryEstimate",
    "build_model",
    "check_seq_len",
    "chunked_loss_problem",
    "estimate_memory",
    "infer_task",
    "load_config",
    "peft_config_from",
    "task_note",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
