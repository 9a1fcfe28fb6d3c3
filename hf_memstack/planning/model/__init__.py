"""The model an estimate is of: its config (from a config, a dict, a folder or a model), checked, and
the model built from it on the meta device and on fake tensors, with the inputs its step reads.

config.py           load_config, infer_task and build_model
config_file.py      a model folder's ``config.json``, read and checked before Transformers reads it
fake.py             the model on fake tensors and the meter's step traced on it
fake_experts.py     mixture-of-experts layers on fake tensors
vision_families.py  each vision-language family's images as its processor makes them
vision_inputs.py    a vision-language model's pixel inputs for the estimator
synthetic_batch.py  the random batches ``hf-memstack find-batch-size`` measures with

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here is listed, and each ``name`` below is in the file named):

- ``hf_memstack/cli/main.py``: ``synthetic_batches`` and ``load_config`` for ``_find`` (the `hf-memstack find-batch-size` command)
- ``hf_memstack/planning/estimate/__init__.py``: ``build_model`` and ``load_config`` (the old ``planning/estimate.py``'s names)
- ``hf_memstack/planning/estimate/estimator.py``: ``load_config``, ``infer_task`` and ``images_for``
- ``hf_memstack/planning/estimate/checks.py``: ``build_model``
- ``hf_memstack/planning/estimate/trace.py``: ``build_fake_model`` and ``traced_step``
- ``hf_memstack/planning/estimate/fsdp_shards.py``: ``blocks_or_empty``
- ``hf_memstack/planning/estimate/fsdp_dtypes.py``: ``blocks_or_empty``
- ``hf_memstack/planning/plan/planner.py``: ``load_config``, ``meta_model`` and ``images_for``
- ``hf_memstack/planning/plan/states_floor.py``: ``build_model``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .config import build_model, infer_task, load_config
    from .fake import build_fake_model, meta_model
    from .synthetic_batch import synthetic_batches
    from .vision_inputs import ImageSpec, images_for, is_vision_language

# public name -> the module of this folder that defines it
_EXPORTS = {
    "build_model": ".config",
    "infer_task": ".config",
    "load_config": ".config",
    "build_fake_model": ".fake",
    "meta_model": ".fake",
    "ImageSpec": ".vision_inputs",
    "images_for": ".vision_inputs",
    "is_vision_language": ".vision_inputs",
    "synthetic_batches": ".synthetic_batch",
}

__all__ = [
    "ImageSpec",
    "build_fake_model",
    "build_model",
    "images_for",
    "infer_task",
    "is_vision_language",
    "load_config",
    "meta_model",
    "synthetic_batches",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
