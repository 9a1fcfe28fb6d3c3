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
policy's autocast back around it. Nothing here patches Trainer: the model is prepared before the
Trainer sees it (as TRL and Liger do), and what happens during training goes through Trainer's
own callback events.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from .._device import device_of, module_mode, preserved_rng, synchronize
from ..data import PackedCollator
from ..data.guard import settle_packing_guard
from ..measure.accounting import optimizer_state_bytes
from ..measure.memory import StepMemory, measure_step
from ..measure.verify import VerifyReport, verify
from ..record import MemstackRecord, record_of, unwrap_model
from ..sizes import parse_bytes
from ..transforms._wrappers import fused_lm_head_installed
from ..transforms.bf16_adamw import rounds_stochastically
from ..transforms.checkpointing import CheckpointingGuard
from ..transforms.optim import OptimizerInBackward, optimizer_in_backward_of
from ..transforms.precision import AutocastBypassGuard, restore_autocast, trl_replaces_chunked_loss
from ._columns import _longest_first, _signature_columns, _trainer_columns
from .trainer_eval import check_eval_logits

__all__ = [
    "MemstackCallback",
    "add_memstack_callback",
    "check_eval_logits",
    "check_optimizer",
    "check_training_arguments",
    "training_arguments",
]

logger = logging.getLogger("hf_memstack")

# transformers >= 5.20 names it activation_checkpointing (gradient_checkpointing is a deprecated alias).
_CHECKPOINTING_FIELD = (
    "activation_checkpointing"
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def check_training_arguments(model: nn.Module, args: TrainingArguments) -> list[str]:
    """Compare ``args`` (``TrainingArguments`` or a subclass such as TRL's ``SFTConfig``) with the
    policy ``model`` was prepared with.

    ``gradient_checkpointing=True`` without keyword arguments (TRL's default) over a policy that
    already checkpoints is accepted: the policy's checkpointing is kept, and Trainer's call to
    ``activation_checkpointing_enable`` changes nothing and says so once.

    Returns:
        Warnings for settings that repeat what the policy already does (harmless, but to drop).

    Raises:
        ValueError: every setting that contradicts the policy or would apply part of it a second
            time in a way that changes training (listed together, each with its fix, naming the
            arguments' class).
    """
    record = _record(model)
    cls = type(args).__name__
    problems: list[str] = []
    repeats: list[str] = []
    _check_checkpointing_args(model, args, record, problems)
    _check_precision_args(args, record, problems)
    _check_optimizer_args(args, record, problems)
    if getattr(args, "torch_compile", False):
        if record.policy.compile.mode != "none":
            problems.append(
                f"{cls}.torch_compile=True would compile the model a second time; the policy "
                f"{record.policy.to_string()!r} already compiles it ({record.policy.compile.mode}): set torch_compile=False"
            )
        else:
            repeats.append(
                f"{cls}.torch_compile=True compiles the model outside its hf_memstack policy, which "
                "model.memstack does not record; prefer adding compile to the policy (e.g. "
                f"'{record.policy.to_string()}+compile:regional') and torch_compile=False"
            )
    if getattr(args, "fsdp", None):
        problems.append(
            f"{cls}.fsdp={args.fsdp!r}: Trainer's FSDP would shard a model hf_memstack already "
            "checkpointed (and maybe sharded) without knowing where its checkpoints are; set fsdp='' and put "
            "fsdp in the policy, launched with torchrun or the recipe (recipes/finetune.py)"
        )
    if problems:
        raise ValueError(
            f"{cls} contradicts the model's hf_memstack policy "
            f"{record.policy.to_string()!r}:\n  - " + "\n  - ".join(problems)
        )
    return repeats


def _record(model: nn.Module | None) -> MemstackRecord:
    record = record_of(model) if isinstance(model, nn.Module) else None
    if record is None:
        raise ValueError(
            f"the model ({type(model).__name__}) was not prepared by hf_memstack: call "
            "hf_memstack.prepare_model(model, policy) before building the Trainer"
        )
    return record


def _checkpointing_field(args: Any) -> str:
    """The field to name in a fix: TRL's configs document ``gradient_checkpointing`` (default True);
    Transformers >= 5.20 names it ``activation_checkpointing``."""
    return "gradient_checkpointing" if _is_trl(args) else _CHECKPOINTING_FIELD


def _is_trl(args: Any) -> bool:
    return type(args).__module__.startswith("trl.")


def _check_checkpointing_args(model: nn.Module, args: Any, record: MemstackRecord, problems: list[str]) -> None:
    enabled = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
    if not enabled:
        return
    field = _checkpointing_field(args)
    setting = f"{type(args).__name__}({field}=True)"
    kwargs = dict(
        getattr(args, "activation_checkpointing_kwargs", None)
        or getattr(args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    every_n, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    guard = getattr(model, "activation_checkpointing_enable", None)
    if not isinstance(guard, CheckpointingGuard):
        problems.append(
            f"{setting}, but {type(model).__name__} has no Transformers checkpointing API for Trainer to call; "
            f"checkpointing comes from the policy ({record.policy.to_string()!r}): set {field}=False"
        )
        return
    conflict = guard.conflict(
        kwargs or None,
        every_n_layers=every_n,
        offload=offload,
        caller=setting,
        fix=f"set {type(args).__name__}({field}=False)" + (" (TRL's configs default to True)" if _is_trl(args) else ""),
    )
    if conflict:
        problems.append(conflict)
    # Otherwise Trainer's call repeats the policy or asks for the default checkpointing over the
    # policy's own: the guard keeps the policy's and says so once, when Trainer calls it.


def _check_optimizer_args(args: Any, record: MemstackRecord, problems: list[str]) -> None:
    """optim:in_backward updates each parameter inside the backward: what Trainer would do after it
    (clip by the global norm, accumulate micro-batches) cannot happen."""
    if record.policy.optimizer.step != "in_backward":
        return
    if (args.max_grad_norm or 0) > 0:
        problems.append(
            f"TrainingArguments.max_grad_norm={args.max_grad_norm}: the policy's optim:in_backward updates each "
            "parameter inside the backward, before a global gradient norm exists; set max_grad_norm=0"
        )
    if args.gradient_accumulation_steps != 1:
        problems.append(
            f"TrainingArguments.gradient_accumulation_steps={args.gradient_accumulation_steps}: with optim:in_backward "
            "every backward updates the weights, so gradients cannot be accumulated; set gradient_accumulation_steps=1 "
            "(a larger per_device_train_batch_size instead)"
        )


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Raise when the policy has an optimizer rung (optim:8bit, optim:in_backward, weights:bf16's
    stochastic rounding) and ``optimizer`` was not built for it: Trainer builds plain AdamW unless
    given one. Warn when a plain AdamW updates 16-bit weights (its small updates round away)."""
    record = _record(model)
    if optimizer is None:
        return
    cfg = record.policy.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
    _check_holds_the_trainable(model, inner)
    fix = (
        "build it with the policy: Trainer(..., optimizers=(hf_memstack.make_optimizer(model, lr=args.learning_rate, "
        "weight_decay=args.weight_decay), None))"
    )
    if (cfg.state, cfg.step) != ("fp32", "after_backward"):
        built = (
            isinstance(inner, OptimizerInBackward)
            if cfg.step == "in_backward"
            else "8bit" in type(inner).__name__.lower()
        )
        if not built:
            raise ValueError(
                f"the policy {record.policy.to_string()!r} asks for an optimizer rung, but Trainer's optimizer is "
                f"{type(inner).__name__}; {fix}"
            )
    rounds = rounds_stochastically(inner)
    if record.policy.master_weights == "bf16" and not rounds:
        raise ValueError(
            f"the policy {record.policy.to_string()!r} trains pure bf16, which needs AdamW with bf16 stochastic "
            f"rounding, but Trainer's optimizer is {type(inner).__name__} (its updates below bf16's resolution "
            f"would round away); {fix}"
        )
    sixteen = [p for g in inner.param_groups for p in g["params"] if p.dtype in (torch.bfloat16, torch.float16)]
    if sixteen and not rounds:
        warnings.warn(
            f"Trainer's optimizer {type(inner).__name__} updates {len(sixteen)} {sixteen[0].dtype} parameter(s) without "
            "stochastic rounding: updates smaller than their resolution are lost. Prepare the model with a mixed "
            "precision policy (fp32 master weights), or 'bf16+weights:bf16' and " + fix,
            stacklevel=3,
        )


def _check_holds_the_trainable(model: nn.Module, optimizer: Any) -> None:
    """An optimizer built before PEFT added the adapters (TRL's ``peft_config``) holds the frozen base
    and none of what trains: the run would "succeed" and change nothing."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if trainable and len(missing) == len(trainable):
        raise ValueError(
            f"the optimizer given to Trainer holds none of the model's {len(trainable)} trainable parameters (e.g. {missing[0]!r}): "
            "it was built before they existed or trained - with TRL's peft_config, PEFT adds the adapters inside SFTTrainer, after "
            "make_optimizer saw the base. Add the adapters first (model = get_peft_model(model, config); prepare_model(model, "
            "policy); make_optimizer(model, ...)) and pass that model without peft_config"
        )


def _check_precision_args(args: Any, record: MemstackRecord, problems: list[str]) -> None:
    cls = type(args).__name__
    asked = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    policy = record.precision.name
    if policy == "fp16" and record.precision.device_type == "cpu":
        # Accelerate creates neither an autocast nor a GradScaler for fp16 on the CPU
        # (accelerator.scaler is None): Trainer would run hf_memstack's fp16 autocast unscaled.
        problems.append(
            "the policy computes in fp16 on the CPU, where Accelerate (and so Trainer) creates no loss scaler "
            "(trainer.accelerator.scaler is None): fp16 gradients would underflow unscaled. Use a bf16 or fp32 "
            "policy on the CPU, train fp16 on a GPU (there fp16=True gives Trainer's GradScaler), or use your own "
            "loop with model.memstack.grad_scaler"
        )
        return
    if asked == "no":
        if policy == "fp16":
            problems.append(
                "the policy computes in fp16, which needs a loss scaler, and Trainer only creates one with "
                f"fp16=True: set {cls}(fp16=True)"
            )
        elif record.autocast_by == "accelerator.prepare":
            problems.append(
                f"the model was prepared for an Accelerator with mixed_precision={policy!r}; set "
                f"{cls}({policy}=True) so Trainer's Accelerator applies it"
            )
        return
    if policy == "fp32":
        problems.append(
            f"{cls}.{asked}=True autocasts a model whose policy is fp32; set {asked}=False, or "
            f"prepare the model with precision {asked!r} (e.g. '{asked}+ckpt')"
        )
    elif asked != policy:
        problems.append(
            f"{cls}.{asked}=True contradicts the policy's precision {policy!r}; set {asked}=False"
            + (" and fp16=True" if policy == "fp16" else "")
        )
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
    fused LM head, and on a GPU gives fp16 Trainer's loss scaler; on the CPU Accelerate creates no
    scaler, so an fp16 policy is refused there), checkpointing and compile are left to the policy
    (``gradient_checkpointing=False``, ``torch_compile=False``). The per-device batch size comes
    from ``per_device_train_batch_size`` when given, else from :func:`hf_memstack.find_batch_size`
    under ``budget`` (measured steps on the longest sample of ``train_dataset``, padded by
    ``data_collator``); ``gradient_accumulation_steps`` keeps ``global_batch_size`` (rounded up,
    as the finder does). Any other ``TrainingArguments`` field passes through ``kwargs``.

    Raises:
        ValueError: the model is not prepared; ``kwargs`` contradict the policy; an fp16 policy on
            the CPU; a budget without a dataset to measure; a bad ``global_batch_size``, or one
            that an explicit ``gradient_accumulation_steps`` contradicts (they must agree exactly).
    """
    record = _record(model)
    # The deprecated name is what most scripts still pass: it means the same field.
    for old, new in (
        ("gradient_checkpointing", _CHECKPOINTING_FIELD),
        ("gradient_checkpointing_kwargs", f"{_CHECKPOINTING_FIELD}_kwargs"),
    ):
        if old != new and old in kwargs:
            kwargs.setdefault(new, kwargs.pop(old))
    precision = (
        {}
        if {"bf16", "fp16"} & set(kwargs)
        else {"bf16": record.precision.name == "bf16", "fp16": record.precision.name == "fp16"}
    )
    # optim:in_backward steps inside the backward: no global-norm clipping there (Trainer's default is 1.0).
    no_clip = {"max_grad_norm": 0.0} if record.policy.optimizer.step == "in_backward" else {}
    fields = {**precision, "torch_compile": False, _CHECKPOINTING_FIELD: False, **no_clip, **kwargs}
    _keep_packed_rows(train_dataset, data_collator, fields, "position_ids" in _signature_columns(model))
    # Without a GPU, Trainer accepts bf16 only when told it trains on the CPU.
    fields.setdefault("use_cpu", not torch.cuda.is_available())
    if global_batch_size is not None and (
        not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size <= 0
    ):
        raise ValueError(
            f"global_batch_size={global_batch_size!r} must be a positive integer (samples per optimizer step)"
        )
    world = _world_size()
    accumulation = kwargs.get("gradient_accumulation_steps")
    if global_batch_size is not None and accumulation is not None and global_batch_size % (accumulation * world):
        # Refused before the finder measures anything: no per-device size can make them agree.
        _refuse_accumulation(global_batch_size, accumulation, None, world)
    if "per_device_train_batch_size" not in fields and budget is not None:
        result = _find_batch_size(
            model,
            train_dataset,
            data_collator,
            budget,
            global_batch_size,
            remove_unused_columns=fields.get("remove_unused_columns", True),
        )
        fields["per_device_train_batch_size"] = result.batch_size
        fields.setdefault("per_device_eval_batch_size", result.batch_size)
        _report_batch_size(result)
    per_device = fields.get("per_device_train_batch_size", 8)
    if global_batch_size is not None and accumulation is None:
        fields["gradient_accumulation_steps"] = max(1, math.ceil(global_batch_size / (per_device * world)))
    elif global_batch_size is not None and per_device * world * accumulation != global_batch_size:
        _refuse_accumulation(global_batch_size, accumulation, per_device, world)
    args = TrainingArguments(output_dir=output_dir, **fields)
    for note in check_training_arguments(model, args):
        warnings.warn(note, stacklevel=2)
    return args


def _keep_packed_rows(dataset: Any, collator: Any, fields: dict[str, Any], model_takes_position_ids: bool) -> None:
    """Packed rows (``pack_dataset``'s ``seq_lengths`` column) reach a collator that reads them.

    Trainer removes the columns the model's forward does not take before collating, and
    ``seq_lengths`` is one of them: without it (and without the rows' ``position_ids``, which
    ``pack_dataset`` also writes and Trainer keeps for a forward that takes them) every row is
    collated as one sample, the samples in it attend to each other, and the loss still falls
    (silently wrong, transformers#46634's symptom). So a packed dataset keeps its columns
    (``remove_unused_columns=False``; the collator builds the batch from ``input_ids``,
    ``labels`` and ``seq_lengths`` alone), ``remove_unused_columns=True`` is refused for rows whose
    boundaries would not survive it, and a collator that ignores ``seq_lengths`` is refused.
    """
    columns = _columns_of(dataset) if dataset is not None else set()
    if "seq_lengths" not in columns:
        return
    if not _reads_seq_lengths(collator):
        raise ValueError(
            f"train_dataset holds packed rows (a 'seq_lengths' column, from hf_memstack.data.pack_dataset) but "
            f"data_collator={type(collator).__name__ if collator is not None else None} collates each row as one "
            "sample: the samples in a row would attend to each other; pass "
            "data_collator=hf_memstack.data.PackedCollator(pad_token_id=tokenizer.pad_token_id)"
        )
    # TRL's trainers keep seq_lengths among their signature columns; Trainer does not.
    kept = "position_ids" in columns and model_takes_position_ids
    if fields.setdefault("remove_unused_columns", False) and isinstance(collator, PackedCollator) and not kept:
        raise ValueError(
            "remove_unused_columns=True: Trainer would drop the packed rows' 'seq_lengths' column (the model's "
            "forward does not take it) before the collator sees it, and each row would train as one sample "
            "whose parts attend to each other; leave remove_unused_columns unset (False for packed rows)"
        )


def _columns_of(dataset: Any) -> set[str]:
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return set(names)
    if isinstance(dataset, Sized) and hasattr(dataset, "__getitem__") and len(dataset) and isinstance(dataset[0], dict):
        return set(dataset[0])
    return set()


def _reads_seq_lengths(collator: Any) -> bool:
    """The collators that split a packed row at its ``seq_lengths``: the library's, and TRL's
    padding-free one (``DataCollatorForLanguageModeling(padding_free=True)``)."""
    return isinstance(collator, PackedCollator) or (
        type(collator).__module__.startswith("trl.") and getattr(collator, "padding_free", False)
    )


def _refuse_accumulation(global_batch_size: int, accumulation: int, per_device: int | None, world: int) -> None:
    """A ``global_batch_size`` that an explicit ``gradient_accumulation_steps`` contradicts: the
    run would silently step on another number of samples than the one asked for."""
    per_step = (
        f"per_device_train_batch_size={per_device} x {world} process(es) x gradient_accumulation_steps={accumulation} "
        f"= {per_device * world * accumulation} samples per optimizer step"
        if per_device is not None
        else f"gradient_accumulation_steps={accumulation} x {world} process(es) does not divide it"
    )
    raise ValueError(
        f"global_batch_size={global_batch_size} contradicts gradient_accumulation_steps={accumulation}: {per_step}; "
        "pass one of them: global_batch_size (the accumulation is derived from the per-device batch size) "
        "or gradient_accumulation_steps"
    )


def _report_batch_size(result: Any) -> None:
    """Say once, on the main process, what the finder chose: the batch size is the answer the
    caller asked for, and a logger at INFO level is silent unless logging was configured."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    logger.info("hf_memstack: %s", result.summary())
    if rank == 0:
        print(
            f"hf_memstack training_arguments: per_device_train_batch_size={result.batch_size} from the batch-size finder: "
            f"{result.summary()}",
            flush=True,
        )


def _world_size() -> int:
    """Processes in the run: the process group's size, or the launcher's WORLD_SIZE before Trainer
    creates the group (torchrun and accelerate launch set it)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _find_batch_size(
    model: nn.Module,
    dataset: Any,
    collator: Any,
    budget: int | str,
    global_batch_size: int | None,
    *,
    remove_unused_columns: bool = True,
) -> Any:
    """The finder on the batches Trainer's loader will build: the longest samples of ``dataset``,
    with the columns Trainer removes removed (``remove_unused_columns``), through ``collator``,
    so each probe has the padding and the length of the widest training batch."""
    from ..batch_size import find_batch_size

    if dataset is None or collator is None or not isinstance(dataset, Sized) or len(dataset) == 0:
        raise ValueError(
            "budget= needs train_dataset (a non-empty, indexable dataset) and data_collator to measure steps "
            "with; pass both, or per_device_train_batch_size instead of budget"
        )
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
    cap = min(cap, len(dataset))  # a batch larger than the dataset is never built
    return find_batch_size(
        model, make_batch, optimizer, budget=budget, global_batch_size=global_batch_size, max_batch_size=cap
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstStepReport:
    """What the callback saw before the first optimizer step."""

    verify: VerifyReport | None
    """``hf_memstack.measure.verify`` on the first batch (None when verification is off or no batch could be built)."""
    memory: StepMemory | None
    """The meter on the same forward + backward (None when measuring is off)."""
    seconds: float | None = None
    """Wall time of that extra forward + backward (verify and the meter together)."""


class MemstackCallback(TrainerCallback):
    """Watches a Trainer (or TRL trainer) run of a model prepared by hf_memstack.

    * when the Trainer is built: puts itself first among the callbacks, so that the reporting
      callbacks (TensorBoard, W&B, trackio) log its figures; refuses arguments that contradict
      the policy (:func:`check_training_arguments`) and warns about those that repeat it;
    * before the first step: puts the policy's autocast back around a forward that replaced the
      prepared one (TRL's fused LM head: :func:`hf_memstack.transforms.precision.restore_autocast`), then
      runs :func:`hf_memstack.measure.verify` on the first training batch through the forward that
      trains (``fused_lm_head=True`` under TRL), with the memory meter tracking that same
      forward + backward: one extra pass, its time in the log (weights, gradients and RNG are
      left as they were); with ``raise_on_failure`` a failed check stops training;
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
        self, args: TrainingArguments, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any
    ) -> None:
        _put_first(self)
        for note in check_training_arguments(model, args):
            warnings.warn(note, stacklevel=2)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: Any,
        control: Any,
        model: nn.Module | None = None,
        train_dataloader: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
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
        batch = _first_batch(train_dataloader, model)
        if fused and isinstance(batch, dict):
            batch = {**batch, "fused_lm_head": True, "use_cache": False}  # the forward TRL's compute_loss runs
        report = memory = seconds = None
        if batch is not None and (self.run_verify or self.measure):
            start = time.perf_counter()
            with module_mode(
                model, training=True
            ):  # as Trainer's steps will run (from_pretrained leaves models in eval mode)
                report, memory = _verify_and_measure(model, batch, run_verify=self.run_verify, measure=self.measure)
            seconds = time.perf_counter() - start
            self._log_first_batch(report, memory, seconds)
        self.first_step = FirstStepReport(verify=report, memory=memory, seconds=seconds)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

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

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_started = time.perf_counter()

    def on_step_end(
        self, args: TrainingArguments, state: Any, control: Any, optimizer: Any = None, **kwargs: Any
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
        self, args: TrainingArguments, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
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


def add_memstack_callback(trainer: Any, callback: MemstackCallback | None = None) -> MemstackCallback:
    """Put a :class:`MemstackCallback` first among ``trainer``'s callbacks (the one it has, when
    ``callback`` is None and it has one), so that the reporting callbacks (TensorBoard, W&B,
    trackio) log its memory figures too. Returns the callback."""
    callbacks = trainer.callback_handler.callbacks
    if callback is None:
        callback = next((c for c in callbacks if isinstance(c, MemstackCallback)), None) or MemstackCallback()
    check_training_arguments(trainer.model, trainer.args)
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


def _dispatching_trainer() -> Any:
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


def _verify_and_measure(
    model: nn.Module, batch: Any, *, run_verify: bool, measure: bool
) -> tuple[VerifyReport | None, StepMemory | None]:
    """``verify`` on ``batch`` with the memory meter's tracker (PyTorch's MemTracker) around it:
    one forward + backward gives both. verify's later passes (the chunked-loss check's forwards
    without gradients, the compile check's compiled step) call the model again, which MemTracker
    takes for a new iteration: its per-module figures restart there, and the figures reported
    are those at the end of the observed training step (under compile, the eager step verify
    observes). Without verify, the meter runs its own forward + backward."""
    if not measure:
        return verify(model, batch), None
    if not run_verify:
        return None, _measure_forward_backward(model, batch)
    from ..measure.tracker import _frozen_aware_tracker

    settle_packing_guard(model, batch)  # the packed-batch guard's one-time probe runs outside the tracked step

    tracker = _frozen_aware_tracker()
    if tracker is None:  # private API: it may move; verify alone, the meter on its own step
        return verify(model, batch), _measure_forward_backward(model, batch)
    at_step_end: dict[str, Any] = {}

    def new_iteration(module: nn.Module, args: Any) -> None:
        # A global hook registered before MemTracker's runs first: restart its module figures
        # before it would refuse a second call of the model it tracks.
        if module is model and module in tracker.memory_tracking:
            at_step_end.setdefault("peak", tracker.get_tracker_snapshot("peak"))
            tracker.reset_mod_stats()

    handle = torch.nn.modules.module.register_module_forward_pre_hook(new_iteration)
    try:
        tracker.track_external(model)
        with tracker, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
            report = verify(model, batch)
    finally:
        handle.remove()
    peak = at_step_end.get("peak") or tracker.get_tracker_snapshot("peak")
    return report, _step_memory(peak, device_of(model))


def _step_memory(peak: dict[Any, dict[Any, int]], device: torch.device) -> StepMemory:
    from ..measure.tracker import _category

    cat = {name: _category(peak, name) for name in ("total", "param", "buffer", "grad", "opt", "act", "temp", "oth")}
    total, method = cat["total"], "memtracker"
    if device.type == "cuda":
        synchronize(device)
        total, method = max(total, torch.cuda.max_memory_allocated(device)), "memtracker+cuda-allocator"
    return StepMemory(
        peak_bytes=total,
        parameters=cat["param"] + cat["buffer"],
        gradients=cat["grad"],
        optimizer=cat["opt"],
        activations=cat["act"],
        temporaries=cat["temp"],
        other=cat["oth"],
        step_seconds=None,
        device=str(device),
        method=method,
    )


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


def _first_batch(dataloader: Any, model: nn.Module | None) -> Any:
    """The first training batch, built from the dataset and collator directly (iterating the
    Trainer's dataloader would consume its sampler's randomness and Accelerate's state)."""
    dataset = getattr(dataloader, "dataset", None)
    collate = getattr(dataloader, "collate_fn", None)
    if (
        model is None
        or collate is None
        or not isinstance(dataset, Sized)
        or not hasattr(dataset, "__getitem__")
        or len(dataset) == 0
    ):
        logger.info("hf_memstack: no indexable training dataset; skipping verify and the memory meter")
        return None
    size = (
        getattr(dataloader, "batch_size", None)
        or getattr(getattr(dataloader, "batch_sampler", None), "batch_size", None)
        or 1
    )
    device = device_of(model)
    with preserved_rng(device):  # a collator may draw random numbers (masking)
        batch = collate([dataset[i] for i in range(min(size, len(dataset)))])
    return (
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()} if isinstance(batch, dict) else batch
    )
