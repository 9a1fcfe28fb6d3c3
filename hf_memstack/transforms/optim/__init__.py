"""The optimizer rungs (``optim:8bit``, ``optim:in_backward``, and BF16AdamW under ``weights:bf16``):
make_optimizer builds AdamW as the policy says.

optimizer.py    make_optimizer, and the checks of a policy's optimizer and training settings
groups.py       the parameter groups and hyperparameters, read once and checked
in_backward.py  OptimizerInBackward: each parameter stepped by a hook as soon as its gradient is ready
eight_bit.py    torchao's AdamW8bit, loaded on demand
bf16_adamw.py   BF16AdamW: bf16 weights and moments with stochastic rounding (pure bf16 training)
verify.py       what verify needs: an in-backward optimizer paused during its checks

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here or reads the policy field this folder implements is listed, and each
``name`` below is in the file named):

- ``hf_memstack/policy/tokens.py``: the ``Token("optim:8bit"`` and ``Token("optim:in_backward"`` rows
- ``hf_memstack/policy/config.py``: ``OptimizerConfig``, the policy's fields
- ``hf_memstack/prepare.py``: ``check_optimizer_policy`` before anything is applied
- ``hf_memstack/_model_checks.py``: ``optimizer_in_backward_of``: a model that steps itself
- ``hf_memstack/measure/verify.py``: ``optimizer_paused`` around verify's steps
- ``hf_memstack/integrations/trainer_args.py``: ``BF16AdamW`` as the Trainer's optimizer
- ``hf_memstack/integrations/trainer_checks.py``: ``rounds_stochastically`` and ``OptimizerInBackward`` under the Trainer
- ``hf_memstack/integrations/trainer_first_step.py``: ``optimizer_in_backward_of`` on the first step
- ``hf_memstack/planning/estimate/trace.py``: ``make_optimizer`` on fake tensors
- ``hf_memstack/planning/plan/rungs.py``: the ``Step("in_backward"`` and ``Step("8bit"`` rungs
- ``hf_memstack/planning/plan/states_floor.py``: the moments' bytes by ``policy.optimizer.state``
- ``hf_memstack/planning/plan/next_rung.py``: the finder's advice copies ``rung.optimizer.state``
- ``hf_memstack/planning/plan/advice.py``: each rung's caveat by ``policy.optimizer.state``
- ``hf_memstack/planning/estimate/estimator.py``: ``optimizer == "sgd"`` refused with an optimizer rung
- ``hf_memstack/transforms/precision/master_weights.py``: ``warn_on_plain_steps_over_pure_bf16``
- ``hf_memstack/transforms/precision/master_reconcile.py``: ``warn_on_plain_steps_over_pure_bf16``
- ``hf_memstack/__init__.py``: ``make_optimizer`` in the public API; ``OptimizerInBackward`` in ``_MOVED`` (the old import warns)
- ``recipes/finetune_support/checks.py``: ``check_optimizer_policy`` on the recipe's flags
- ``hf_memstack/planning/plan/walk.py``: reads ``p.optimizer.state``, ``p.optimizer.step``
- ``hf_memstack/record.py``: reads ``policy.optimizer``
- ``recipes/finetune.py``: reads ``policy.optimizer.state``, ``policy.optimizer.step``
- ``recipes/trainer.py``: reads ``policy.optimizer.state``, ``policy.optimizer.step``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .bf16_adamw import BF16AdamW, rounds_stochastically
    from .in_backward import OptimizerInBackward, optimizer_in_backward_of
    from .optimizer import check_optimizer_policy, check_training_settings, make_optimizer
    from .verify import optimizer_paused

# public name -> the module of this folder that defines it
_EXPORTS = {
    "check_optimizer_policy": ".optimizer",
    "check_training_settings": ".optimizer",
    "make_optimizer": ".optimizer",
    "OptimizerInBackward": ".in_backward",
    "optimizer_in_backward_of": ".in_backward",
    "BF16AdamW": ".bf16_adamw",
    "rounds_stochastically": ".bf16_adamw",
    "optimizer_paused": ".verify",
}

__all__ = [
    "BF16AdamW",
    "OptimizerInBackward",
    "check_optimizer_policy",
    "check_training_settings",
    "make_optimizer",
    "optimizer_in_backward_of",
    "optimizer_paused",
    "rounds_stochastically",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
