"""transformers.Trainer integration: prepare the model before the Trainer is built, fill its
TrainingArguments from the policy and the batch-size finder, and watch training with a callback.

    from hf_memstack import prepare_model
    from hf_memstack.integrations.trainer import MemstackCallback, training_arguments

    model = prepare_model(model, "bf16+ckpt")                      # 1. the policy, before the Trainer
    args = training_arguments(model, output_dir="out", train_dataset=ds, data_collator=collator,
                              budget="20GiB", global_batch_size=64)  # 2. batch size, accumulation, flags
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator,
                      callbacks=[MemstackCallback()])              # 3. verify + memory in the logs
    trainer.train()

TRL's trainers (``SFTTrainer(..., callbacks=[MemstackCallback()])``) work the same way; their
fused LM head replaces ``model.forward`` after the model was prepared, and the callback puts the
policy's autocast back around it. Under trainers that compute the loss themselves (TRL's DPO, KTO and
reward trainers) the first-batch check runs their ``compute_loss``; under those that generate their
batches (GRPO) it steps aside, saying so (:mod:`.trainer_loss`). Nothing here patches Trainer: the model is prepared before the
Trainer sees it (as TRL and Liger do), and what happens during training goes through Trainer's
own callback events.

This module holds the callback; the arguments live in :mod:`.trainer_args`, their checks against
the policy in :mod:`.trainer_checks`, the first-batch pass in :mod:`.trainer_first_step` and the
evaluation check in :mod:`.trainer_eval` (all re-exported here, the public import path).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .._device import module_mode
from ..measure.accounting import optimizer_state_bytes
from ..measure.memory import StepMemory
from ..measure.verify import VerifyReport
from ..record import MemstackRecord, unwrap_model
from ..sizes import parse_bytes
from ..transforms._wrappers import fused_lm_head_installed
from ..transforms.precision.apply import AutocastBypassGuard, restore_autocast, trl_replaces_chunked_loss
from ..transforms.precision.master_reconcile import reconcile_master_weights
from ..transforms.sequence_parallel.reduce import sequence_parallel_size
from ..transforms.sequence_parallel.verify import shard_for_rank
from .trainer_args import training_arguments
from .trainer_checks import _given_model, _record, check_optimizer, check_training_arguments
from .trainer_eval import check_eval_logits
from .trainer_first_step import FirstStepReport, _first_batch, _verify_and_measure
from .trainer_loss import loss_target, tell_reference_model
from .trainer_sequence import install_sequence_parallel, refuse_uninstalled

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from transformers import Trainer

__all__ = [
    "MemstackCallback",
    "add_memstack_callback",
    "check_eval_logits",
    "check_optimizer",
    "check_training_arguments",
    "training_arguments",
]

logger = logging.getLogger("hf_memstack")


class MemstackCallback(TrainerCallback):
    """Watches a Trainer (or TRL trainer) run of a model prepared by hf_memstack.

    * when the Trainer is built: puts itself first among the callbacks, so that the reporting
      callbacks (TensorBoard, W&B, trackio) log its figures; refuses arguments that contradict
      the policy (:func:`check_training_arguments`) and warns about those that repeat it; for an
      ``sp:N`` model, installs the sequence-parallel hooks on that Trainer (found as the dispatcher of
      ``on_init_end``; :mod:`.trainer_sequence`), or refuses naming ``add_memstack_callback(trainer)``;
    * before the first step: puts the policy's autocast back around a forward that replaced the
      prepared one (TRL's fused LM head: :func:`hf_memstack.transforms.precision.apply.restore_autocast`), then
      runs :func:`hf_memstack.measure.verify` on the first training batch through the forward that
      trains (``fused_lm_head=True`` under TRL), with the memory meter tracking that same
      forward + backward: one extra pass, its time in the log (weights, gradients and RNG are
      left as they were); with ``raise_on_failure`` a failed check stops training, without it a
      pass that cannot run is logged and skipped (``first_step.skipped`` says why);
    * before training that evaluates (``eval_strategy`` not ``"no"``): warns when the logits
      ``Trainer.evaluate()`` will keep on the device exceed ``eval_budget`` (default: the CUDA device's
      total memory; on the CPU only a given budget is checked), with the bytes and the fixes
      (:func:`check_eval_logits`: one no-grad forward of the longest eval sample);
    * at every log: adds ``memory/peak_mib`` (CUDA: the allocator's peak since the last log; CPU:
      the meter's first-batch peak plus the optimizer state, in training logs only: evaluation's is
      not measured there) and ``memstack/verify_ok`` (numbers,
      as trackers want them).
    """

    def __init__(
        self,
        *,
        verify: bool = True,
        measure: bool = True,
        raise_on_failure: bool = False,
        eval_budget: int | str | None = None,
    ) -> None:
        if eval_budget is not None:
            parse_bytes(eval_budget, field="eval_budget")  # a bad size is refused here, not when training starts
        self.eval_budget = eval_budget
        self.run_verify = verify
        self.measure = measure
        self.raise_on_failure = raise_on_failure
        self.first_step: FirstStepReport | None = None
        self._optimizer_bytes = 0
        self._step_started = 0.0

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: object,
    ) -> None:
        _put_first(self)
        model = _given_model(model)
        for note in check_training_arguments(model, args):
            warnings.warn(note, stacklevel=2)
        if sequence_parallel_size(model) > 1:  # sp:N: the loader must be re-keyed before train() builds it
            trainer = _dispatching_trainer()
            if trainer is None:
                refuse_uninstalled(trainer, model)
            else:
                install_sequence_parallel(trainer)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        train_dataloader: DataLoader | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: object,
    ) -> None:
        model = _given_model(model)
        reconcile_master_weights(
            model
        )  # what trains is known now (PEFT or TRL's peft_config may come after prepare_model)
        check_training_arguments(model, args)
        check_optimizer(model, optimizer)
        record = _record(model)
        if restore_autocast(model):
            logger.info(
                "hf_memstack: the model's forward was replaced after prepare_model (TRL's fused LM head); "
                "the policy's %s autocast is put back around it",
                record.precision.name,
            )
        self._check_eval_logits(args)
        fused = fused_lm_head_installed(unwrap_model(model))
        if fused and record.loss.mode == "chunked":
            _tell_chunked_once(model, record)
        trainer = _dispatching_trainer()
        refuse_uninstalled(trainer, model)  # sp:N whose loader was built without the hooks
        tell_reference_model(trainer, record)
        self.first_step = (
            self._first_step(trainer, model, train_dataloader, fused)
            if self.run_verify or self.measure
            else FirstStepReport(verify=None, memory=None)
        )
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def _first_step(
        self, trainer: Trainer | None, model: nn.Module, dataloader: DataLoader | None, fused: bool
    ) -> FirstStepReport:
        """verify and the meter on the first batch, through the loss the trainer computes
        (:func:`.trainer_loss.loss_target`), or skipped with one log line saying why: the callback
        never stops a run that would train (unless ``raise_on_failure`` asks it to)."""
        batch = _first_batch(dataloader, model)
        if batch is None:
            return FirstStepReport(verify=None, memory=None, skipped="no indexable training dataset")
        try:
            target = loss_target(trainer, model, batch)
            if isinstance(target, str):
                logger.info("hf_memstack: verify and the memory meter on the first batch are skipped: %s", target)
                return FirstStepReport(verify=None, memory=None, skipped=target)
            module, batch = target
            if not self.run_verify and isinstance(batch, dict) and sequence_parallel_size(model) > 1:
                batch = shard_for_rank(model, dict(batch))  # the meter alone measures this rank's slice
            if fused and module is model and isinstance(batch, dict):
                batch = {**batch, "fused_lm_head": True, "use_cache": False}  # the forward TRL's compute_loss runs
            start = time.perf_counter()
            # In training mode, as Trainer's steps will run (from_pretrained leaves models in eval mode).
            with module_mode(module, training=True):
                report, memory = _verify_and_measure(module, batch, run_verify=self.run_verify, measure=self.measure)
        except Exception as e:
            if self.raise_on_failure:
                raise
            reason = f"the pass raised {type(e).__name__}: {e}"
            logger.warning(
                "hf_memstack: verify and the memory meter on the first batch are skipped (%s); training goes on "
                "without them",
                reason,
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            return FirstStepReport(verify=None, memory=None, skipped=reason)
        seconds = time.perf_counter() - start
        self._log_first_batch(report, memory, seconds)
        return FirstStepReport(verify=report, memory=memory, seconds=seconds)

    def _check_eval_logits(self, args: TrainingArguments) -> None:
        """Before hours of training, whether its evaluations will keep more logits than the budget."""
        strategy = getattr(args, "eval_strategy", "no")
        if getattr(strategy, "value", strategy) == "no":
            return
        trainer = _dispatching_trainer()
        if trainer is None:
            logger.info(
                "hf_memstack: MemstackCallback could not find the Trainer; call "
                "hf_memstack.integrations.trainer.check_eval_logits(trainer) to check the logits evaluate() keeps"
            )
            return
        problem = check_eval_logits(trainer, self.eval_budget)
        if problem is not None:
            warnings.warn(problem, stacklevel=3)

    def _log_first_batch(self, report: VerifyReport | None, memory: StepMemory | None, seconds: float) -> None:
        what = " and ".join(
            x for x, on in (("verify", report is not None), ("the memory meter", memory is not None)) if on
        )
        logger.info(
            "hf_memstack: %s on the first batch: one extra forward + backward before the first step, %.2f s",
            what,
            seconds,
        )
        if memory is not None:
            logger.info("hf_memstack memory meter, first batch (forward + backward): %s", memory.summary())
        if report is not None:
            (logger.info if report.ok else logger.warning)("hf_memstack.measure.verify on the first batch:\n%s", report)
            if self.raise_on_failure and not report.ok:
                raise RuntimeError(f"hf_memstack.measure.verify found problems on the first batch:\n{report}")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self._step_started = time.perf_counter()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: object,
    ) -> None:
        if not self._optimizer_bytes and optimizer is not None:
            self._optimizer_bytes = optimizer_state_bytes(getattr(optimizer, "optimizer", optimizer))
        if state.global_step == 1 and self.first_step is not None and self.first_step.seconds is not None:
            logger.info(
                "hf_memstack: the first training step took %.2f s; the callback's pass on the first batch added %.2f s "
                "before it",
                time.perf_counter() - self._step_started,
                self.first_step.seconds,
            )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: object,
    ) -> None:
        if logs is None or self.first_step is None:
            return
        memory = self.first_step.memory
        # evaluate()/predict() log "{prefix}_runtime"; the training step's figure is not theirs.
        evaluating = any(k.endswith("_runtime") and not k.startswith("train_") for k in logs)
        if torch.cuda.is_available():
            logs["memory/peak_mib"] = (
                torch.cuda.max_memory_allocated() / 2**20
            )  # since the last log: evaluation's own peak
            torch.cuda.reset_peak_memory_stats()
        elif memory is not None and not evaluating:
            logs["memory/peak_mib"] = (memory.peak_bytes + self._optimizer_bytes) / 2**20
        if self.first_step.verify is not None:
            logs["memstack/verify_ok"] = float(self.first_step.verify.ok)
        # Trainer appended its copy of these logs to log_history (trainer_state.json) before the
        # callbacks ran: add the figures there too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update({k: v for k, v in logs.items() if k.startswith(("memory/", "memstack/"))})


def add_memstack_callback(trainer: Trainer, callback: MemstackCallback | None = None) -> MemstackCallback:
    """Put a :class:`MemstackCallback` first among ``trainer``'s callbacks (the one it has, when
    ``callback`` is None and it has one), so that the reporting callbacks (TensorBoard, W&B,
    trackio) log its memory figures too. For an ``sp:N`` model, install the sequence-parallel hooks
    (:func:`.trainer_sequence.install_sequence_parallel`: each group's ranks read the same rows, each
    its slice). Returns the callback."""
    callbacks = trainer.callback_handler.callbacks
    if callback is None:
        callback = next((c for c in callbacks if isinstance(c, MemstackCallback)), None) or MemstackCallback()
    check_training_arguments(_given_model(trainer.model), trainer.args)
    install_sequence_parallel(trainer)  # sp:N: the group's ranks read the same rows, each its slice
    if callback in callbacks:
        callbacks.remove(callback)
    callbacks.insert(0, callback)
    return callback


def _put_first(callback: MemstackCallback) -> None:
    """Move ``callback`` to the front of the Trainer's callback list, ahead of the reporting
    callbacks Trainer placed before the user's. Trainer gives callbacks no handle on its
    CallbackHandler, so it is found as the ``self`` of the frame dispatching this event
    (``CallbackHandler.call_event``); without one (a direct call), nothing moves."""
    import inspect

    from transformers.trainer_callback import CallbackHandler

    frame = inspect.currentframe()
    for _ in range(4):
        frame = frame.f_back if frame is not None else None
        handler = frame.f_locals.get("self") if frame is not None else None
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            handler.callbacks.remove(callback)
            handler.callbacks.insert(0, callback)
            return
    logger.info(
        "hf_memstack: MemstackCallback could not find the Trainer's callback list; use add_memstack_callback(trainer) "
        "to put it before the reporting callbacks"
    )


def _dispatching_trainer() -> Trainer | None:
    """The Trainer whose event is being dispatched: the ``self`` of the frame that called its
    CallbackHandler (Trainer hands callbacks no handle on itself); None without one (a direct call)."""
    import inspect

    from transformers import Trainer

    frame = inspect.currentframe()
    for _ in range(8):
        frame = frame.f_back if frame is not None else None
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, Trainer):
            return owner
    return None


def _tell_chunked_once(model: nn.Module, record: MemstackRecord) -> None:
    """Warn that TRL's fused head replaces loss:chunked, unless the backbone's guard already did."""
    inner = unwrap_model(model)
    backbone = getattr(inner, "base_model", None)
    hooks = backbone._forward_pre_hooks.values() if isinstance(backbone, nn.Module) else ()
    guard = next((h for h in hooks if isinstance(h, AutocastBypassGuard)), None)
    if guard is not None:
        if guard.told_chunked:
            return
        guard.told_chunked = True
    warnings.warn(trl_replaces_chunked_loss(record.policy.to_string()), stacklevel=3)
