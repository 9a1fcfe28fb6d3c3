"""Every problem a config can have without reading the data or the model, reported at once."""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from .common import FORMATS, RecipeError, is_alias, looks_local
from .flags import FinetuneConfig

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from hf_memstack.policy import MemoryPolicy


def check_config(cfg: FinetuneConfig) -> None:
    """Every problem a config can have without reading the data or the model, reported at once.

    Raises:
        RecipeError: the list of problems, each naming the field, the value, what is allowed and the fix.
    """
    problems = [
        *_number_problems(cfg),
        *_schedule_problems(cfg),
        *_policy_and_batch_problems(cfg),
        *_input_problems(cfg),
        *_lora_problems(cfg),
    ]
    if problems:
        raise RecipeError("invalid configuration (nothing was loaded or written):\n  - " + "\n  - ".join(problems))


def _number_problems(cfg: FinetuneConfig) -> list[str]:
    """The numbers: finite, in range, and the step counts that need each other."""
    problems: list[str] = []

    def bad(name: str, why: str) -> None:
        problems.append(f"{name}={cfg.value(name)!r} {why}")

    for name in ("lr", "weight_decay", "warmup_ratio", "grad_clip", "epochs", "validation_split", "dist_timeout"):
        if not math.isfinite(cfg.value(name)):
            bad(
                name,
                f"is not a finite number; give a real value (e.g. the default {FinetuneConfig.default(name)})",
            )
    finite = lambda name: math.isfinite(cfg.value(name))  # noqa: E731 - ranges only for finite values
    if finite("lr") and cfg.train.lr <= 0:
        bad("lr", "must be positive, e.g. 2e-4")
    if finite("weight_decay") and cfg.train.weight_decay < 0:
        bad("weight_decay", "must be >= 0 (0: no decay)")
    if finite("warmup_ratio") and not 0 <= cfg.train.warmup_ratio < 1:
        bad("warmup_ratio", "must be in [0, 1), e.g. 0.1")
    if finite("grad_clip") and cfg.train.grad_clip < 0:
        bad("grad_clip", "must be >= 0 (0 turns clipping off)")
    if finite("validation_split") and not 0 < cfg.data.validation_split < 1:
        bad("validation_split", "must be between 0 and 1 (exclusive), e.g. 0.1")
    if finite("dist_timeout") and cfg.train.dist_timeout <= 0:
        bad("dist_timeout", "must be a positive number of seconds, e.g. 900")
    if cfg.train.max_steps == 0 and finite("epochs") and cfg.train.epochs <= 0:
        bad("epochs", "must be positive (or set --max-steps)")
    for name in ("seq_len", "log_every", "keep_last"):
        if cfg.value(name) < 1:
            bad(name, "must be at least 1")
    for name in ("max_steps", "stop_after", "eval_every", "save_every", "num_workers"):
        if cfg.value(name) < 0:
            bad(name, "must not be negative (0 turns it off)")
    if not 0 <= cfg.train.seed < 2**32:
        bad("seed", "must be in [0, 2**32)")
    if cfg.memory.global_batch_size is not None and cfg.memory.global_batch_size < 1:
        bad("global_batch_size", "must be a positive number of samples (or leave it out)")
    if cfg.train.stop_after and not cfg.checkpoint.save_every:
        bad("stop_after", "needs --save-every: without checkpoints the stopped run could not be resumed")
    return problems


def _schedule_problems(cfg: FinetuneConfig) -> list[str]:
    """The learning-rate schedule: a Transformers scheduler this loop can drive."""
    problems: list[str] = []

    def bad(name: str, why: str) -> None:
        problems.append(f"{name}={cfg.value(name)!r} {why}")

    usable, refused = _scheduler_names()
    if cfg.train.lr_scheduler in refused:
        bad("lr_scheduler", f"cannot be used here: {refused[cfg.train.lr_scheduler]}; use one of {', '.join(usable)}")
    elif cfg.train.lr_scheduler not in usable:
        close = difflib.get_close_matches(cfg.train.lr_scheduler, usable, 1)
        bad(
            "lr_scheduler",
            "is not a transformers scheduler"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; use one of {', '.join(usable)}",
        )
    return problems


def _policy_and_batch_problems(cfg: FinetuneConfig) -> list[str]:
    """The memory policy (and its optimizer / 4-bit rungs), the batch size and the memory budget."""
    from hf_memstack import MemoryPolicy, PolicyError, parse_bytes

    problems: list[str] = []

    def bad(name: str, why: str) -> None:
        problems.append(f"{name}={cfg.value(name)!r} {why}")

    if cfg.memory.policy != "auto":
        try:
            policy = MemoryPolicy.coerce(cfg.memory.policy)
            problems += _policy_problems(policy, cfg.memory.policy)
            problems += _optimizer_problems(cfg, policy)
            problems += _quant_problems(cfg, policy)
        except (PolicyError, ValueError, TypeError, OSError, yaml.YAMLError) as e:
            problems.append(f"policy={cfg.memory.policy!r}: {str(e).strip()}")

    if cfg.memory.batch_size != "auto" and not (cfg.memory.batch_size.isdigit() and int(cfg.memory.batch_size) > 0):
        bad("batch_size", "must be a positive integer or 'auto'")
    if cfg.memory.memory_budget is not None:
        try:
            parse_bytes(cfg.memory.memory_budget, field="memory_budget")
        except (ValueError, TypeError, OverflowError) as e:
            problems.append(str(e) if "memory_budget" in str(e) else f"memory_budget={cfg.memory.memory_budget!r}: {e}")
        if cfg.memory.batch_size != "auto" and cfg.memory.policy != "auto":
            bad(
                "memory_budget",
                "has no effect: it is used by --batch-size auto and --policy auto; drop it or use one of those",
            )
    elif cfg.memory.batch_size == "auto" and not torch.cuda.is_available():
        bad("batch_size", "needs --memory-budget on CPU (e.g. '8GiB'): a CPU has no out-of-memory error to catch")
    return problems


def _input_problems(cfg: FinetuneConfig) -> list[str]:
    """The files and folders named (data, model, tokenizer), the data options, trackers and the output's flags."""
    problems: list[str] = []

    def bad(name: str, why: str) -> None:
        problems.append(f"{name}={cfg.value(name)!r} {why}")

    if looks_local(cfg.data.dataset):
        path = Path(cfg.data.dataset)
        if not path.is_file():
            bad("dataset", "is not a file; pass a .json/.jsonl/.csv/.parquet/.txt file or a hub id")
        elif path.suffix not in FORMATS:
            bad("dataset", f"has the unsupported type {path.suffix!r}; use one of {', '.join(sorted(FORMATS))}")
    if cfg.data.validation_file is not None:
        path = Path(cfg.data.validation_file)
        if not path.is_file() or path.suffix not in FORMATS:
            bad("validation_file", f"is not a {'/'.join(sorted(FORMATS))} file; pass an existing file or leave it out")
    if (cfg.data.prompt_field is None) != (cfg.data.response_field is None):
        problems.append("prompt_field and response_field go together; give both or neither")
    if cfg.data.packing != "off" and cfg.data.task == "classification":
        bad("packing", "only applies to causal-lm (a classification row is one sample with one label); drop --packing")
    elif cfg.data.packing == "wrapped" and cfg.data.prompt_field:
        bad(
            "packing",
            "cuts blocks across samples, which prompt/response data cannot be; use --packing on "
            "(whole samples per row, the prompt stays masked)",
        )
    if (
        not is_alias(cfg.model.model)
        and looks_local(cfg.model.model)
        and not (Path(cfg.model.model) / "config.json").is_file()
    ):
        bad("model", "is not a model directory (no config.json); pass a directory saved by save_pretrained or a hub id")
    if cfg.model.tokenizer is not None and looks_local(cfg.model.tokenizer) and not Path(cfg.model.tokenizer).is_dir():
        bad("tokenizer", "is not a directory; pass a tokenizer directory or a hub id")
    if cfg.output.report_to:
        problems += _tracker_problems(cfg.output.report_to)
    if cfg.output.memory_plot and importlib.util.find_spec("matplotlib") is None:
        bad(
            "memory_plot",
            "needs matplotlib, which is not installed: pip install 'hf_memstack[plot]' (or drop --memory-plot)",
        )
    if cfg.output.overwrite and cfg.checkpoint.resume_from == "latest":
        problems.append(
            "overwrite=True with resume_from='latest' contradict each other: --overwrite starts again, "
            "--resume-from latest continues; pick one"
        )
    if cfg.checkpoint.discard_later_checkpoints and not cfg.checkpoint.resume_from:
        bad("discard_later_checkpoints", "only applies with --resume-from CHECKPOINT")
    return problems


def _lora_problems(cfg: FinetuneConfig) -> list[str]:
    """LoRA settings that cannot work, or that do nothing without --lora-r."""
    problems = []
    if cfg.lora.lora_r < 0:
        problems.append(f"lora_r={cfg.lora.lora_r!r} must be >= 0 (0: full fine-tuning; 8 or 16 are common ranks)")
    if cfg.lora.lora_alpha is not None and not (math.isfinite(cfg.lora.lora_alpha) and cfg.lora.lora_alpha > 0):
        problems.append(f"lora_alpha={cfg.lora.lora_alpha!r} must be a positive number (default: 2 x lora_r)")
    if not (math.isfinite(cfg.lora.lora_dropout) and 0 <= cfg.lora.lora_dropout < 1):
        problems.append(f"lora_dropout={cfg.lora.lora_dropout!r} must be in [0, 1), e.g. 0.05")
    if not [t for t in cfg.lora.lora_target.split(",") if t.strip()]:
        problems.append(f"lora_target={cfg.lora.lora_target!r} names no module; pass e.g. q_proj,v_proj or all-linear")
    if cfg.lora.lora_r == 0:
        unused = [
            f"--{f.replace('_', '-')}"
            for f in ("lora_alpha", "lora_dropout", "lora_target", "merge_lora")
            if cfg.value(f) != FinetuneConfig.default(f)
        ]
        if unused:
            problems.append(
                f"{', '.join(unused)} given without --lora-r: they only apply to LoRA; add --lora-r 8 (or drop them)"
            )
    elif cfg.memory.policy != "auto" and "fsdp" in cfg.memory.policy:
        problems.append(
            f"lora_r={cfg.lora.lora_r} with policy={cfg.memory.policy!r}: LoRA under FSDP is not supported by this "
            "recipe yet "
            "(the adapters are small: drop fsdp from the policy)"
        )
    return problems


def _policy_problems(policy: MemoryPolicy, spec: str) -> list[str]:
    """What the library's policy validation leaves to the run: the device and the compile backend."""
    problems = []
    if policy.compile.mode != "none":
        backends = torch.compiler.list_backends(exclude_tags=())
        if policy.compile.backend not in backends:
            problems.append(
                f"policy={spec!r}: compile.backend={policy.compile.backend!r} is not a torch.compile backend here; "
                f"use one of {', '.join(b for b in ('inductor', 'aot_eager', 'eager') if b in backends)}"
            )
    if policy.precision == "fp16" and not torch.cuda.is_available():
        problems.append(f"policy={spec!r}: fp16 needs a GPU (Accelerate refuses fp16 on CPU); use bf16 or fp32 here")
    return problems


def _quant_problems(cfg: FinetuneConfig, policy: MemoryPolicy) -> list[str]:
    """4-bit base weights (quant:nf4) are frozen: only adapters can train on them."""
    if policy.quant.mode == "none" or cfg.lora.lora_r:
        return []
    return [
        f"policy={cfg.memory.policy!r} keeps the base weights in 4 bits, which cannot be trained: add --lora-r 16 "
        "(LoRA adapters "
        "train on the frozen 4-bit base, as QLoRA does), or drop quant:nf4 for full fine-tuning"
    ]


def _optimizer_problems(cfg: FinetuneConfig, policy: MemoryPolicy) -> list[str]:
    """The policy's optimizer rung against this run's settings (make_optimizer checks the same,
    later; here every problem is named by its flag, before anything is loaded)."""
    from hf_memstack.transforms.optim.optimizer import check_optimizer_policy

    problems, spec = [], cfg.memory.policy
    try:
        check_optimizer_policy(policy.optimizer)
    except RuntimeError as e:
        problems.append(f"policy={spec!r}: {e}")
    if policy.optimizer.step != "in_backward":
        return problems
    why = "optim:in_backward updates each parameter inside the backward"
    if cfg.train.grad_clip > 0:
        problems.append(
            f"grad_clip={cfg.train.grad_clip} with policy={spec!r}: {why}, before the global gradient norm exists; "
            "pass --grad-clip 0, or drop optim:in_backward from the policy"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.memory.global_batch_size and not (
        cfg.memory.batch_size.isdigit() and int(cfg.memory.batch_size) * world == cfg.memory.global_batch_size
    ):
        problems.append(
            f"global_batch_size={cfg.memory.global_batch_size} with policy={spec!r}: {why}, so gradients cannot be "
            "accumulated over micro-batches; drop --global-batch-size (the per-device batch is the step's batch), "
            "or drop optim:in_backward"
        )
    if world > 1 and policy.fsdp.mode == "none":
        problems.append(
            f"policy={spec!r} on {world} processes without fsdp: {why}, before DDP averages the gradients, so "
            "the replicas would drift apart; add fsdp to the policy, or drop optim:in_backward"
        )
    return problems


def _tracker_problems(report_to: str) -> list[str]:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    problems = []
    for name in [n.strip() for n in report_to.split(",")]:
        if name == "all":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            problems.append(
                f"report_to={name!r} is not an Accelerate tracker; use one of {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}"
            )
        elif name not in available:
            problems.append(
                f"report_to={name!r}: the {name} package is not installed; pip install {name}, or leave --report-to out"
            )
    return problems


def _scheduler_names() -> tuple[list[str], dict[str, str]]:
    """Transformers' scheduler names, and why the ones this loop cannot drive are refused."""
    from transformers import SchedulerType, get_scheduler

    usable, refused = [], {}
    for kind in SchedulerType:
        try:  # built once on a dummy optimizer: names needing extra arguments fail here, not mid-run
            built = get_scheduler(
                kind.value,
                torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                num_warmup_steps=1,
                num_training_steps=10,
            )
        except (ValueError, TypeError) as e:
            refused[kind.value] = f"it needs arguments this recipe does not pass ({str(e)[:80]})"
            continue
        if isinstance(built, torch.optim.lr_scheduler.LambdaLR):
            usable.append(kind.value)
        else:  # reduce_lr_on_plateau, greedy
            refused[kind.value] = "it adapts to a training metric instead of following the step count"
    return usable, refused
