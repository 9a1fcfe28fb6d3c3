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

Nothing here patches Trainer: the model is prepared before the Trainer sees it (as TRL and Liger
do), and what happens during training goes through Trainer's own callback events.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from .._device import device_of, module_mode, preserved_rng
from ..accounting import optimizer_state_bytes
from ..checkpointing import CheckpointingGuard
from ..memory import StepMemory, measure_step
from ..optim import OptimizerInBackward, optimizer_in_backward_of
from ..record import MemstackRecord, record_of
from ..verify import VerifyReport, verify

__all__ = ["MemstackCallback", "add_memstack_callback", "check_optimizer", "check_training_arguments", "training_arguments"]

logger = logging.getLogger("hf_memstack")

# transformers >= 5.20 names it activation_checkpointing (gradient_checkpointing is a deprecated alias).
_CHECKPOINTING_FIELD = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient_checkpointing"


def check_training_arguments(model: nn.Module, args: TrainingArguments) -> list[str]:
    """Compare ``args`` with the policy ``model`` was prepared with.

    Returns:
        Warnings for settings that repeat what the policy already does (harmless, but to drop).

    Raises:
        ValueError: every setting that contradicts the policy or would apply part of it a second
            time in a way that changes training (listed together, each with its fix).
    """
    record = _record(model)
    problems: list[str] = []
    repeats: list[str] = []
    _check_checkpointing_args(model, args, record, problems, repeats)
    _check_precision_args(args, record, problems, repeats)
    _check_optimizer_args(args, record, problems)
    if getattr(args, "torch_compile", False):
        if record.policy.compile.mode != "none":
            problems.append(f"TrainingArguments.torch_compile=True would compile the model a second time; the policy "
                            f"{record.policy.to_string()!r} already compiles it ({record.policy.compile.mode}): set torch_compile=False")
        else:
            repeats.append("TrainingArguments.torch_compile=True compiles the model outside its hf_memstack policy, which "
                           "model.memstack does not record; prefer adding compile to the policy (e.g. "
                           f"'{record.policy.to_string()}+compile:regional') and torch_compile=False")
    if getattr(args, "fsdp", None):
        problems.append(f"TrainingArguments.fsdp={args.fsdp!r}: Trainer's FSDP would shard a model hf_memstack already "
                        "checkpointed (and maybe sharded) without knowing where its checkpoints are; set fsdp='' and put "
                        "fsdp in the policy, launched with torchrun or the recipe (recipes/finetune.py)")
    if problems:
        raise ValueError("TrainingArguments contradict the model's hf_memstack policy "
                         f"{record.policy.to_string()!r}:\n  - " + "\n  - ".join(problems))
    return repeats


def _record(model: nn.Module | None) -> MemstackRecord:
    record = record_of(model) if isinstance(model, nn.Module) else None
    if record is None:
        raise ValueError(f"the model ({type(model).__name__}) was not prepared by hf_memstack: call "
                         "hf_memstack.prepare_model(model, policy) before building the Trainer")
    return record


def _check_checkpointing_args(model: nn.Module, args: Any, record: MemstackRecord, problems: list[str], repeats: list[str]) -> None:
    enabled = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not enabled:
        return
    flag = f"TrainingArguments({_CHECKPOINTING_FIELD}=True)"
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    every_n, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    guard = getattr(model, "activation_checkpointing_enable", None)
    if not isinstance(guard, CheckpointingGuard):
        problems.append(f"{flag}, but {type(model).__name__} has no Transformers checkpointing API for Trainer to call; "
                        f"checkpointing comes from the policy ({record.policy.to_string()!r}): set {_CHECKPOINTING_FIELD}=False")
        return
    conflict = guard.conflict(kwargs or None, every_n_layers=every_n, offload=offload, caller=flag)
    if conflict:
        problems.append(conflict)
    else:
        repeats.append(f"{flag} repeats the policy's checkpointing (nothing changes); set {_CHECKPOINTING_FIELD}=False")


def _check_optimizer_args(args: Any, record: MemstackRecord, problems: list[str]) -> None:
    """optim:in_backward updates each parameter inside the backward: what Trainer would do after it
    (clip by the global norm, accumulate micro-batches) cannot happen."""
    if record.policy.optimizer.step != "in_backward":
        return
    if (args.max_grad_norm or 0) > 0:
        problems.append(f"TrainingArguments.max_grad_norm={args.max_grad_norm}: the policy's optim:in_backward updates each "
                        "parameter inside the backward, before a global gradient norm exists; set max_grad_norm=0")
    if args.gradient_accumulation_steps != 1:
        problems.append(f"TrainingArguments.gradient_accumulation_steps={args.gradient_accumulation_steps}: with optim:in_backward "
                        "every backward updates the weights, so gradients cannot be accumulated; set gradient_accumulation_steps=1 "
                        "(a larger per_device_train_batch_size instead)")


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Raise when the policy has an optimizer rung (optim:8bit, optim:in_backward) and ``optimizer``
    was not built for it: Trainer builds plain AdamW unless given one."""
    record = _record(model)
    cfg = record.policy.optimizer
    if cfg.state == "fp32" and cfg.step == "after_backward" or optimizer is None:
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    built = isinstance(inner, OptimizerInBackward) if cfg.step == "in_backward" else "8bit" in type(inner).__name__.lower()
    if not built:
        raise ValueError(f"the policy {record.policy.to_string()!r} asks for an optimizer rung, but Trainer's optimizer is "
                         f"{type(inner).__name__}; build it with the policy: Trainer(..., optimizers=(hf_memstack.make_optimizer("
                         "model, lr=args.learning_rate, weight_decay=args.weight_decay), None))")


def _check_precision_args(args: Any, record: MemstackRecord, problems: list[str], repeats: list[str]) -> None:
    asked = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    policy = record.precision.name
    if asked == "no":
        if policy == "fp16":
            problems.append("the policy computes in fp16, which needs a loss scaler, and Trainer only creates one with "
                            "fp16=True: set TrainingArguments(fp16=True)")
        elif record.autocast_by == "accelerator.prepare":
            problems.append(f"the model was prepared for an Accelerator with mixed_precision={policy!r}; set "
                            f"TrainingArguments({policy}=True) so Trainer's Accelerator applies it")
        return
    if policy == "fp32":
        problems.append(f"TrainingArguments.{asked}=True autocasts a model whose policy is fp32; set {asked}=False, or "
                        f"prepare the model with precision {asked!r} (e.g. '{asked}+ckpt')")
    elif asked != policy:
        problems.append(f"TrainingArguments.{asked}=True contradicts the policy's precision {policy!r}; set {asked}=False"
                        + (" and fp16=True" if policy == "fp16" else ""))
    # The same precision in both is consistent: Trainer's autocast around the prepared model's own is
    # the same dtype twice, and it also covers code that bypasses model.forward (TRL's fused LM head).


def training_arguments(
    model: nn.Module,
    *,
    output_dir: str,
    train_dataset: Any = None,
    data_collator: Any = None,
    budget: int | str | None = None,
    global_batch_size: int | None = None,
    **kwargs: Any,
) -> TrainingArguments:
    """``TrainingArguments`` consistent with the prepared ``model``'s policy.

    Precision flags follow the policy (``bf16=True`` / ``fp16=True``: Trainer's autocast around the
    model's own is the same dtype twice, covers code that bypasses ``model.forward`` such as TRL's
    fused LM head, and gives fp16 Trainer's loss scaler), checkpointing and compile are left to the policy
    (``gradient_checkpointing=False``, ``torch_compile=False``). The per-device batch size comes
    from ``per_device_train_batch_size`` when given, else from :func:`hf_memstack.find_batch_size`
    under ``budget`` (measured steps on the longest sample of ``train_dataset``, padded by
    ``data_collator``); ``gradient_accumulation_steps`` keeps ``global_batch_size`` (rounded up,
    as the finder does). Any other ``TrainingArguments`` field passes through ``kwargs``.

    Raises:
        ValueError: the model is not prepared; ``kwargs`` contradict the policy; a budget without
            a dataset to measure; a bad ``global_batch_size``.
    """
    record = _record(model)
    # The deprecated name is what most scripts still pass: it means the same field.
    for old, new in (("gradient_checkpointing", _CHECKPOINTING_FIELD), ("gradient_checkpointing_kwargs", f"{_CHECKPOINTING_FIELD}_kwargs")):
        if old != new and old in kwargs:
            kwargs.setdefault(new, kwargs.pop(old))
    precision = {} if {"bf16", "fp16"} & set(kwargs) else {"bf16": record.precision.name == "bf16", "fp16": record.precision.name == "fp16"}
    # optim:in_backward steps inside the backward: no global-norm clipping there (Trainer's default is 1.0).
    no_clip = {"max_grad_norm": 0.0} if record.policy.optimizer.step == "in_backward" else {}
    fields = {**precision, "torch_compile": False, _CHECKPOINTING_FIELD: False, **no_clip, **kwargs}
    # Without a GPU, Trainer accepts bf16 only when told it trains on the CPU.
    fields.setdefault("use_cpu", not torch.cuda.is_available())
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0):
        raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive integer (samples per optimizer step)")
    world = _world_size()
    if "per_device_train_batch_size" not in fields and budget is not None:
        result = _find_batch_size(model, train_dataset, data_collator, budget, global_batch_size,
                                  remove_unused_columns=fields.get("remove_unused_columns", True))
        fields["per_device_train_batch_size"] = result.batch_size
        fields.setdefault("per_device_eval_batch_size", result.batch_size)
        _report_batch_size(result)
    if global_batch_size is not None and "gradient_accumulation_steps" not in kwargs:
        per_step = fields.get("per_device_train_batch_size", 8) * world
        fields["gradient_accumulation_steps"] = max(1, math.ceil(global_batch_size / per_step))
    args = TrainingArguments(output_dir=output_dir, **fields)
    for note in check_training_arguments(model, args):
        warnings.warn(note, stacklevel=2)
    return args


def _report_batch_size(result: Any) -> None:
    """Say once, on the main process, what the finder chose: the batch size is the answer the
    caller asked for, and a logger at INFO level is silent unless logging was configured."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    logger.info("hf_memstack: %s", result.summary())
    if rank == 0:
        print(f"hf_memstack training_arguments: per_device_train_batch_size={result.batch_size} from the batch-size finder: "
              f"{result.summary()}", flush=True)


def _world_size() -> int:
    """Processes in the run: the process group's size, or the launcher's WORLD_SIZE before Trainer
    creates the group (torchrun and accelerate launch set it)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _find_batch_size(model: nn.Module, dataset: Any, collator: Any, budget: int | str, global_batch_size: int | None, *,
                     remove_unused_columns: bool = True) -> Any:
    """The finder on the batches Trainer's loader will build: the longest samples of ``dataset``,
    with the columns Trainer removes removed (``remove_unused_columns``), through ``collator``,
    so each probe has the padding and the length of the widest training batch."""
    from ..batch_size import find_batch_size

    if dataset is None or collator is None or not isinstance(dataset, Sized) or len(dataset) == 0:
        raise ValueError("budget= needs train_dataset (a non-empty, indexable dataset) and data_collator to measure steps "
                         "with; pass both, or per_device_train_batch_size instead of budget")
    order = _longest_first(dataset)
    keep = _signature_columns(model) if remove_unused_columns else None
    device = device_of(model)

    def make_batch(n: int) -> Any:
        rows = [_trainer_columns(dataset[order[i % len(order)]], keep) for i in range(n)]
        batch = collator(rows)
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    # Under a launcher, before Trainer creates the process group, the finder sees one process:
    # cap the per-device batch by the launcher's count instead.
    cap = max(1, global_batch_size // _world_size()) if global_batch_size else 65536
    return find_batch_size(model, make_batch, optimizer, budget=budget, global_batch_size=global_batch_size, max_batch_size=cap)


def _longest_first(dataset: Any) -> list[int]:
    """The dataset's indices, longest sample first (ties in dataset order)."""
    column = getattr(dataset, "column_names", None)
    if isinstance(column, list) and "input_ids" in column:  # a datasets.Dataset: one column read, not every row
        lengths = [len(ids) for ids in dataset["input_ids"]]
    else:
        lengths = [_length(dataset[i]) for i in range(len(dataset))]
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def _length(sample: Any) -> int:
    """A sample's length: its ``input_ids``, else its longest sequence field (a collator pads to those)."""
    if not isinstance(sample, dict):
        return 0
    if sample.get("input_ids") is not None:
        return len(sample["input_ids"])
    return max((len(v) if not torch.is_tensor(v) else v.numel() for v in sample.values() if isinstance(v, (list, tuple)) or torch.is_tensor(v)),
               default=0)


def _signature_columns(model: nn.Module) -> set[str]:
    """The columns Trainer keeps (``Trainer._set_signature_columns_if_needed``): the forward's
    arguments (a PEFT model's base model's), plus the label names."""
    import inspect

    from transformers.utils import find_labels

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(inner.forward).parameters) | {"label", "label_ids"} | set(find_labels(type(inner)))


def _trainer_columns(sample: Any, keep: set[str] | None) -> Any:
    return {k: v for k, v in sample.items() if k in keep} if keep is not None and isinstance(sample, dict) else sample


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstStepReport:
    """What the callback saw before the first optimizer step."""

    verify: VerifyReport | None
    """``hf_memstack.verify`` on the first batch (None when verification is off or no batch could be built)."""
    memory: StepMemory | None
    """The meter's forward + backward on the first batch (None when measuring is off)."""


class MemstackCallback(TrainerCallback):
    """Watches a Trainer run of a model prepared by hf_memstack.

    * at ``Trainer(...)`` construction: refuses ``TrainingArguments`` that contradict the policy
      (:func:`check_training_arguments`) and warns about those that repeat it;
    * before the first step: runs :func:`hf_memstack.verify` on the first training batch (logged;
      with ``raise_on_failure`` a failed check stops training) and measures the forward + backward
      with the memory meter (weights, gradients and RNG are left as they were);
    * at every log: adds ``memory/peak_mib`` (CUDA: the allocator's peak since the last log; CPU:
      the meter's first-step peak plus the optimizer state) and ``memstack/verify_ok`` (numbers, as
      trackers want them) to the logs. Reporting callbacks (TensorBoard, W&B, trackio) that
      come *after* this one see them: use :func:`add_memstack_callback` to put it first.
    """

    def __init__(self, *, verify: bool = True, measure: bool = True, raise_on_failure: bool = False) -> None:
        self.run_verify = verify
        self.measure = measure
        self.raise_on_failure = raise_on_failure
        self.first_step: FirstStepReport | None = None
        self._optimizer_bytes = 0

    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        for note in check_training_arguments(model, args):
            warnings.warn(note, stacklevel=2)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None,
                       train_dataloader: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        check_training_arguments(model, args)
        check_optimizer(model, optimizer)
        batch = _first_batch(train_dataloader, model)
        report = memory = None
        if batch is not None:
            with module_mode(model, training=True):  # as Trainer's steps will run (from_pretrained leaves models in eval mode)
                report, memory = self._first_step(model, batch)
        self.first_step = FirstStepReport(verify=report, memory=memory)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def _first_step(self, model: nn.Module, batch: Any) -> tuple[VerifyReport | None, StepMemory | None]:
        report = memory = None
        if self.run_verify:
            report = verify(model, batch)
            (logger.info if report.ok else logger.warning)("hf_memstack.verify on the first batch:\n%s", report)
            if self.raise_on_failure and not report.ok:
                raise RuntimeError(f"hf_memstack.verify found problems on the first batch:\n{report}")
        if self.measure:
            memory = _measure_forward_backward(model, batch)
            logger.info("hf_memstack memory meter, first batch (forward + backward): %s", memory.summary())
        return report, memory

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not self._optimizer_bytes and optimizer is not None:
            self._optimizer_bytes = optimizer_state_bytes(getattr(optimizer, "optimizer", optimizer))

    def on_log(self, args: TrainingArguments, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None or self.first_step is None:
            return
        memory = self.first_step.memory
        if torch.cuda.is_available():
            logs["memory/peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        elif memory is not None:
            logs["memory/peak_mib"] = (memory.peak_bytes + self._optimizer_bytes) / 2**20
        if self.first_step.verify is not None:
            logs["memstack/verify_ok"] = float(self.first_step.verify.ok)
        # Trainer appended its copy of these logs to log_history (trainer_state.json) before the
        # callbacks ran: add the figures there too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update({k: v for k, v in logs.items() if k.startswith(("memory/", "memstack/"))})


def add_memstack_callback(trainer: Any, callback: MemstackCallback | None = None) -> MemstackCallback:
    """Put a :class:`MemstackCallback` first among ``trainer``'s callbacks, so that the reporting
    callbacks (TensorBoard, W&B, trackio) log its memory figures too. Returns the callback."""
    callback = callback or MemstackCallback()
    check_training_arguments(trainer.model, trainer.args)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def _first_batch(dataloader: Any, model: nn.Module | None) -> Any:
    """The first training batch, built from the dataset and collator directly (iterating the
    Trainer's dataloader would consume its sampler's randomness and Accelerate's state)."""
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    if model is None or collate is None or not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__") or len(dataset) == 0:
        logger.info("hf_memstack: no indexable training dataset; skipping verify and the memory meter")
        return None
    size = getattr(dataloader, "batch_size", None) or getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None) or 1
    device = device_of(model)
    with preserved_rng(device):  # a collator may draw random numbers (masking)
        batch = collate([dataset[i] for i in range(min(size, len(dataset)))])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()} if isinstance(batch, dict) else batch


def _measure_forward_backward(model: nn.Module, batch: Any) -> StepMemory:
    """The meter on one forward + backward; the gradients it leaves are removed again."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    stepping = optimizer_in_backward_of(model)  # it would update the weights in this backward: pause it
    with preserved_rng(device_of(model)), stepping.paused() if stepping is not None else contextlib.nullcontext():
        memory = measure_step(model, batch, None, timed=False)
    for p, g in zip(params, grads):
        p.grad = g
    return memory

