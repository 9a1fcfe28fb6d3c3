"""The model: the tokenizer, the model (with LoRA), the policy and how it is sharded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from safetensors import SafetensorError

from .common import RecipeError, Route, printable
from .flags import FinetuneConfig
from .stops import nonfinite, nonfinite_in_files

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from datasets import Dataset
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from hf_memstack.data import LabelFraction
    from hf_memstack.policy import MemoryPolicy
    from hf_memstack.transforms.precision.apply import ResolvedPrecision


def _lora_targets(cfg: FinetuneConfig) -> str | list[str]:
    return (
        "all-linear"
        if cfg.lora.lora_target.strip() == "all-linear"
        else [t.strip() for t in cfg.lora.lora_target.split(",") if t.strip()]
    )


def add_lora(cfg: FinetuneConfig, model: torch.nn.Module, task: str) -> torch.nn.Module:
    """The model with LoRA adapters (PEFT) on ``--lora-target``; base weights frozen. A
    classification head stays trainable (PEFT's modules_to_save for sequence classification)."""
    from peft import LoraConfig, TaskType, get_peft_model

    targets = _lora_targets(cfg)
    config = LoraConfig(
        r=cfg.lora.lora_r,
        lora_alpha=cfg.lora.lora_alpha or 2 * cfg.lora.lora_r,
        lora_dropout=cfg.lora.lora_dropout,
        target_modules=targets,
        task_type=TaskType.SEQ_CLS if task == "classification" else TaskType.CAUSAL_LM,
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise RecipeError(
            f"lora_target={cfg.lora.lora_target!r} does not fit {cfg.model.model} "
            f"({str(e).splitlines()[0][:160]}); its linear "
            f"layers are named {', '.join(names)}: pass some of those (or all-linear)"
        ) from None


def resolve_model_path(name: str) -> str:
    """An alias (``minilm``: the table hf-memstack shares) as its model folder; any other name as given."""
    from hf_memstack.models import resolve_model_alias

    try:
        return resolve_model_alias(name)
    except ValueError as e:
        raise RecipeError(str(e)) from None


def load_tokenizer(cfg: FinetuneConfig, model_path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or model_path
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        custom = None if cfg.model.trust_remote_code else _custom_code(source, "tokenizer_config.json")
        if custom:
            raise RecipeError(f"tokenizer={source!r} {custom}") from None
        raise RecipeError(
            f"no tokenizer could be loaded from {source!r} ({type(e).__name__}: {str(e)[:160]}); "
            "pass --tokenizer with a tokenizer id or directory"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def load_model_config(cfg: FinetuneConfig, model_path: str) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        custom = None if cfg.model.trust_remote_code else _custom_code(model_path, "config.json")
        if custom:
            raise RecipeError(f"model={cfg.model.model!r} {custom}") from None
        raise RecipeError(
            f"model={cfg.model.model!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}); "
            "pass a local directory or check the id and the network"
        ) from None
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise RecipeError(
            f"seq_len={cfg.data.seq_len} is above {cfg.model.model}'s limit of {limit} positions; use --seq-len "
            f"{limit} or less"
        )
    return config


def load_model(
    cfg: FinetuneConfig,
    model_path: str,
    task: str,
    num_labels: int,
    *,
    rank0_only: bool = False,
    skeleton: bool = False,
) -> PreTrainedModel:
    """The pretrained model in fp32 (mixed precision computes in bf16/fp16 from fp32 master weights).
    ``rank0_only``: only rank 0 reads the weights, the other ranks build on the meta device and get
    their shards by broadcast in prepare_model. ``skeleton``: the architecture on the meta device,
    no weights (to build Accelerate's FSDP plugin before the Accelerator exists)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_memstack.distributed import from_pretrained_for_fsdp

    config = load_model_config(cfg, model_path)
    auto_class = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    if skeleton:
        with torch.device("meta"):
            return auto_class.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    kwargs: dict[str, Any] = {
        "trust_remote_code": cfg.model.trust_remote_code,
        "dtype": torch.float32,
        "use_safetensors": None,
    }
    if task == "classification":
        kwargs["num_labels"] = num_labels
    try:
        if rank0_only:
            model = from_pretrained_for_fsdp(auto_class, model_path, **kwargs)
        else:
            model = auto_class.from_pretrained(model_path, **kwargs)
    except SafetensorError as e:  # neither OSError nor ValueError: a damaged weights file
        raise RecipeError(_damaged_weights(cfg.model.model, model_path, e)) from None
    except (OSError, ValueError) as e:
        raise RecipeError(
            f"model={cfg.model.model!r}: the weights could not be loaded ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    check_finite_weights(model, f"model={cfg.model.model!r}", Path(model_path))
    return model


def check_finite_weights(model: torch.nn.Module, where: str, folder: Path) -> None:
    """Refuse weights holding NaN or inf (a damaged file, or one saved from a run that diverged):
    training from them gives a NaN loss from the first step. One pass over the loaded tensors; only
    when one is not finite are the folder's safetensors files read to name the file holding it.

    Raises:
        RecipeError: naming the tensor, the file (where it is a safetensors file of ``folder``) and the fix.
    """
    found = nonfinite(model.state_dict().items())
    if found is None:
        return
    name, kind = found
    in_file = nonfinite_in_files(sorted(folder.glob("*.safetensors"))) if folder.is_dir() else None
    held = (
        f"tensor {in_file[1]!r} of {in_file[0]}" if in_file else f"the model's tensor {name!r} (loaded from {folder})"
    )
    raise RecipeError(
        f"{where}: the weights hold {kind} values ({held}): training from them gives a NaN loss and a NaN "
        "model. The file is damaged or was saved from a run that diverged; use an intact copy of the weights "
        "(download or save them again, or an earlier checkpoint)"
    )


def _damaged_weights(model: str, model_path: str, e: Exception) -> str:
    """The message for a weights file safetensors cannot read: the first file of the folder that
    does not open (header too large, shapes that do not match the byte ranges, overlapping offsets)."""
    from safetensors import safe_open

    folder, damaged, why = Path(model_path), None, f"{type(e).__name__}: {_first_line(e)}"
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(path), "pt"):
                pass
        except (OSError, SafetensorError) as bad:
            damaged, why = path, f"{type(bad).__name__}: {_first_line(bad)}"
            break
    return (
        f"model={model!r}: {damaged or f'a weights file of {folder}'} is not a readable safetensors file ({why}): it is "
        "damaged, truncated or not a weights file, and nothing in it was loaded or run. Download or save the "
        "model again (save_pretrained writes model.safetensors)"
    )


def _first_line(e: BaseException) -> str:
    return printable((str(e).splitlines() or ["no message"])[0][:200])


def _custom_code(source: str, config_name: str) -> str | None:
    """Why a local folder holding its own code was refused (config_name's ``auto_map``: Transformers
    would import that folder's Python files), with the fix; None: not a local folder with code."""
    from hf_memstack.files import read_json

    path = Path(source).expanduser() / config_name
    try:
        found = read_json(path, max_bytes=2**20) if path.is_file() else None
    except (OSError, ValueError):
        return None
    auto_map = found.get("auto_map") if isinstance(found, dict) else None
    if not isinstance(auto_map, dict) or not auto_map:
        return None
    names = sorted({printable(str(v)) for vs in auto_map.values() for v in (vs if isinstance(vs, list) else [vs]) if v})
    return (
        f"is a folder with its own code: {config_name}'s auto_map names {', '.join(names)} (the folder's .py files), "
        "and Transformers cannot load it without running that code. Pass --trust-remote-code to run it, only if "
        "you trust the code (it runs as Python, with your permissions: read the folder's .py files first); "
        "nothing from the folder was run"
    )


def planner_label_fraction(cfg: FinetuneConfig, model_path: str, train: Dataset, task: str) -> LabelFraction | None:
    """The training rows' label fraction for --policy auto's planner (its chunked-head rungs count
    the head over the labelled positions only); None when the planner does not run or the task has
    no per-token labels (a classifier), and the planner keeps its default, every position."""
    from .data import training_label_fraction

    if cfg.memory.policy != "auto" or not cfg.memory.memory_budget or task != "causal-lm":
        return None
    return training_label_fraction(train, task, load_tokenizer(cfg, model_path), cfg)


def choose_policy(
    cfg: FinetuneConfig,
    model_path: str,
    task: str,
    device_type: str,
    world: int,
    labels: LabelFraction | None = None,
) -> tuple[MemoryPolicy, str]:
    """--policy as given; or, for 'auto' with --memory-budget, the planner's cheapest rung that fits
    (returned with the planner's table), its head counted over ``labels``' share of the positions."""
    from hf_memstack import MemoryPolicy, plan_policy

    if cfg.memory.policy != "auto" or not cfg.memory.memory_budget:
        return MemoryPolicy.coerce(cfg.memory.policy), ""
    batch: int | Literal["max"] = int(cfg.memory.batch_size) if cfg.memory.batch_size.isdigit() else "max"
    try:
        # optim:in_backward rungs only when this run could train with them (no clipping, no
        # accumulation, no DDP): the planner does not offer what the loop would then refuse.
        in_backward = cfg.train.grad_clip == 0 and not cfg.memory.global_batch_size and world == 1
        # dtype="fp32": load_model loads the weights in fp32 whatever the checkpoint's dtype (fp32
        # master weights under mixed precision), so that is what the plan must count.
        # A LoRA run plans for its adapters (which also opens the 4-bit base rung), not a full fine-tune.
        trainable: dict[str, object] | str = (
            {
                "r": cfg.lora.lora_r,
                "lora_alpha": cfg.lora.lora_alpha or 2 * cfg.lora.lora_r,
                "target_modules": _lora_targets(cfg),
                "task_type": "SEQ_CLS" if task == "classification" else "CAUSAL_LM",
            }
            if cfg.lora.lora_r
            else "all"
        )
        plan = plan_policy(
            model_path,
            budget=cfg.memory.memory_budget,
            seq_len=cfg.data.seq_len,
            batch_size=batch,
            device=device_type,
            world_size=world,
            task=task,
            step_in_backward=in_backward,
            dtype="fp32",
            trainable=trainable,
            # --packing on's rows hold several samples (position_ids restarting): SDPA and eager
            # attention then build a dense [batch, 1, seq, seq] mask, which an unpacked plan leaves out.
            # (--packing wrapped cuts blocks of one text a row: no restarting positions, no mask.)
            packed=cfg.data.packing == "on" and task == "causal-lm",
            label_fraction=labels.fraction if labels is not None else 1.0,
        )
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise RecipeError(
            f"policy=auto with memory_budget={cfg.memory.memory_budget!r}: the planner cannot plan this run ({e}); "
            "pass --policy explicitly"
        ) from None
    if not plan.fits:
        raise RecipeError(
            f"policy=auto: nothing fits memory_budget={cfg.memory.memory_budget}; raise --memory-budget, "
            f"lower --seq-len/--batch-size, or use more devices:\n{plan.table()}"
        )
    return cast("MemoryPolicy", plan.policy), plan.table()  # a plan that fits names its policy


def choose_route(policy: MemoryPolicy, precision: ResolvedPrecision, device_type: str) -> Route:
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
        raise RecipeError(
            f"policy={policy.to_string()!r}: fp16 with fsdp:hybrid_shard is not supported: Accelerate's loss scaler "
            "does not reach an optimizer it has not prepared; use bf16, or fsdp (full_shard) through Accelerate's plugin"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and route == "none":
        raise RecipeError(
            f"launched with an Accelerate FSDP config but policy={policy.to_string()!r} has no fsdp; add it "
            "(e.g. --policy bf16+ckpt+fsdp) or launch with recipes/configs/multi-gpu-ddp.yaml"
        )
    return route
