"""The model an estimate is of: its Transformers config from whatever was given (a config, a dict, a
local directory, a cached hub id), its task (causal LM or classification), and the model built
from it with random weights."""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..record import unwrap_model
from .trainable import apply_peft
from .weights_dtype import cast_like_from_pretrained

if TYPE_CHECKING:
    from peft import PeftConfig
    from transformers import PretrainedConfig

_ACCEPTED = (
    "a hub id (in the local cache), a local directory, a Transformers config (e.g. LlamaConfig(...)), a config "
    "dict with its 'model_type' (config.to_dict()), or a model"
)


def load_config(model: str | Path | Any, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """A Transformers config from a config object, a config dict, a local directory, or a hub id
    already in the local cache. Nothing is downloaded, so an unknown id fails at once instead of
    hanging offline.

    Raises:
        ValueError: not a directory with a config.json and not in the local Hugging Face cache; or
            its config.json (or the dict) is not valid JSON, has no ``model_type``, or describes an invalid model.
        TypeError: ``model`` is none of the above (e.g. a config class rather than a config).
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, nn.Module):
        return cast(PretrainedConfig, model.config)  # a Transformers model's (estimate_memory's models are)
    if isinstance(model, dict):
        return _config_from_dict(model)
    if not isinstance(model, (str, Path)):
        what = (
            f"the class {model.__name__}, not a config: pass {model.__name__}(...)"
            if isinstance(model, type)
            else type(model).__name__
        )
        raise TypeError(f"model={_short(model)} ({what}); pass {_ACCEPTED}")
    path = Path(str(model)).expanduser()
    if path.is_dir():
        _check_config_file(path, trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(
            str(path) if path.is_dir() else str(model), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # noqa: BLE001 - any failure to build the config is an invalid model (huggingface_hub's
        # strict-dataclass validation raises its own error type), said with its cause
        if path.is_dir():
            raise ValueError(
                f"model={str(model)!r}: {path / 'config.json'} is not a valid Transformers config "
                f"({_reason(e)}); fix the file or pass another model"
            ) from None
        if _looks_like_a_path(str(model)):
            # `hf download ./nope` would be no help: the user meant a folder on disk.
            where = "not a directory" if path.exists() else "no such directory"
            raise ValueError(
                f"model={str(model)!r}: {where} ({path.resolve()}); pass the directory holding the model's "
                "config.json (a save_pretrained folder) or a Hub model id in the local cache"
            ) from None
        near = _near_local_folder(str(model))
        fix = f"did you mean the folder {near!r}?" if near else f"download it first (`hf download {model} config.json`)"
        raise ValueError(
            f"model={str(model)!r} is not a local directory with a config.json and not in the local Hugging Face cache "
            f"({type(e).__name__}); {fix} or pass a local directory"
        ) from None


def _near_local_folder(name: str) -> str | None:
    """A folder of the current directory holding a config.json whose name is close to ``name`` (a typo)."""
    try:
        folders = [p.name for p in Path.cwd().iterdir() if (p / "config.json").is_file()] if "/" not in name else []
    except OSError:  # an unreadable working directory: no suggestion
        folders = []
    close = difflib.get_close_matches(name, folders, n=1, cutoff=0.8)
    return close[0] if close else None


def _looks_like_a_path(name: str) -> bool:
    """A folder the user named, rather than a Hub id (``name`` or ``org/name``): it starts at the root,
    home or the current folder, has more than one ``/``, or names something that exists."""
    return name.startswith(("/", "~", ".")) or name.count("/") > 1 or "\\" in name or Path(name).exists()


def _config_from_dict(data: dict[str, Any]) -> PretrainedConfig:
    """The config a ``config.to_dict()`` (or a parsed config.json) describes, built as
    ``AutoConfig.from_pretrained`` builds one from its file: the class named by ``model_type``."""
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(
            f"model= a config dict without a 'model_type' string (model_type={model_type!r}; keys "
            f"{sorted(map(str, data))[:8]}...): it does not say which architecture it is; add it (e.g. "
            "{'model_type': 'llama', ...}) or pass the config object"
        )
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model= a config dict with model_type={model_type!r}, which this Transformers does not know (a model with "
            "custom code? load its config with AutoConfig.from_pretrained(..., trust_remote_code=True) and pass that)"
        )
    cls = CONFIG_MAPPING[model_type]
    _check_dict_keys(cls, data, "model= a config dict")
    try:
        return cls.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - a config class's own validation raises its own types
        raise ValueError(
            f"model= a config dict with model_type={model_type!r} is not a valid Transformers config ({_reason(e)}); "
            "fix its values"
        ) from None


def _check_dict_keys(cls: type, data: dict[str, Any], what: str) -> None:
    """A config keeps keys it does not define, and builds its defaults instead: ``"hiden_size": 64`` would
    estimate a 4096-wide model. A key that is not the config's (nor a generation setting, which older
    configs carry) but is close to one of its keys is refused as the typo it most likely is; other
    extra keys are kept, as Transformers keeps them."""
    from transformers import GenerationConfig

    default = cls()
    known = set(default.to_dict()) | set(getattr(cls, "attribute_map", {})) | set(GenerationConfig().to_dict())
    for key in (str(k) for k in data if k not in known):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
        if close:
            raise ValueError(
                f"{what} with {key!r}, which {cls.__name__} does not define (the model would be "
                f"built with the default {close[0]}={getattr(default, close[0], None)!r}); did you mean {close[0]!r}?"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reason(e: BaseException) -> str:
    """The innermost cause's type and first line (validation errors wrap the useful one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240] if str(e).strip() else ''}"


# The dtype names a config.json may carry (torch's names of the floating-point dtypes weights load in).
_CONFIG_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})


def _check_config_file(path: Path, *, trust_remote_code: bool) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(
            f"model={str(path)!r} is a directory without a config.json; pass a directory written by save_pretrained"
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"model={str(path)!r}: {config} is not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"model={str(path)!r}: {config} holds a JSON {type(data).__name__}, not an object of config fields; "
            "re-save the model with save_pretrained"
        )
    if "model_type" not in data:
        raise ValueError(
            f"model={str(path)!r}: {config} has no 'model_type' (which architecture it is); "
            'add it (e.g. "model_type": "llama") or re-save the model with save_pretrained'
        )
    for field in ("dtype", "torch_dtype"):
        value = data.get(field)
        if value is not None and value not in _CONFIG_DTYPES:
            # Transformers would fail on it with torch's own words (no attribute 'float8', no Storage).
            raise ValueError(
                f"model={str(path)!r}: {config.name} has {field}={value!r}, which is not a dtype Transformers "
                f"loads weights in; set it to the dtype the weights were saved in, one of {sorted(_CONFIG_DTYPES)}, "
                "or remove the field"
            )
    from transformers import CONFIG_MAPPING

    model_type = data["model_type"]
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        # A misspelled field would build the architecture's default for it, silently (a dict is checked alike).
        _check_dict_keys(CONFIG_MAPPING[model_type], data, f"model={str(path)!r}: {config.name}")
    elif data.get("auto_map") and not trust_remote_code:
        raise ValueError(
            f"model={str(path)!r}: {config} has model_type={model_type!r}, which this Transformers does not know, and an "
            "auto_map: the model is defined by custom code in its folder, which hf_memstack does not run "
            "(trust_remote_code is off). Read the code; if you trust it, pass trust_remote_code=True "
            "(estimate_memory / plan_policy), or estimate a built-in architecture of the same shape"
        )


def check_seq_len(config: PretrainedConfig, seq_len: int) -> None:
    """Raise ValueError when ``seq_len`` is not positive or above the model's position limit."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} is above the model's limit of {limit} positions; use seq_len={limit} or less"
        )


def infer_task(model: Any, config: PretrainedConfig) -> str:
    """Which head to build when no task is given: ``classification`` for a sequence-classification
    model (its class, or the config's ``architectures`` saved by ``save_pretrained``) and for an
    encoder without a causal-LM head (``BertModel``, ``BertForMaskedLM``: what the recipe
    fine-tunes such a model for), else ``causal-lm``. See :func:`task_note` for why."""
    return _infer_task(model, config)[0]


def task_note(model: Any, config: PretrainedConfig) -> str | None:
    """Why :func:`infer_task` chose classification for a model that names no classification head
    (an encoder), as a note for the estimate; None when the architecture says it plainly."""
    return _infer_task(model, config)[1]


_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _infer_task(model: Any, config: PretrainedConfig) -> tuple[str, str | None]:

    names = (
        [type(unwrap_model(model)).__name__]
        if isinstance(model, nn.Module)
        else list(getattr(config, "architectures", None) or [])
    )
    if any(n.endswith("ForSequenceClassification") for n in names):
        return "classification", None
    if any(n.endswith(_CAUSAL_HEADS) for n in names):
        return "causal-lm", None
    if config is None and isinstance(model, nn.Module):
        config = getattr(model, "config", None)
    if _is_encoder(config):
        # An encoder (BERT, RoBERTa...) is not a causal LM: building it as one makes a decoder it
        # never was (BertLMHeadModel, with an is_decoder warning per layer) and estimates its MLM-sized head.
        what = names[0] if names else type(config).__name__
        return "classification", (
            f"task: classification ({what} is an encoder, fine-tuned with a classification head as the "
            "recipe does); pass task='causal-lm' (--task causal-lm) to estimate it as a decoder"
        )
    return "causal-lm", None


def _is_encoder(config: PretrainedConfig) -> bool:
    """A Transformers encoder: its model type has a masked-LM head, it is not set up as a decoder,
    and it is not an encoder-decoder (BART and T5 generate)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config is None or getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return False
    return getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def build_model(
    config: PretrainedConfig,
    task: str,
    peft_config: PeftConfig | None = None,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """The model of ``config`` for ``task`` (random weights in ``dtype``, the modules Transformers
    keeps in fp32 kept there as ``from_pretrained`` keeps them), with PEFT adapters when given.
    ``config`` is left as it was.

    Raises:
        ValueError: the config describes an invalid model, or the PEFT config matches no module.
    """
    net = _build(config, task, trust_remote_code, dtype)
    cast_like_from_pretrained(net, dtype)
    return apply_peft(net, peft_config) if peft_config is not None else net


def _build(config: PretrainedConfig, task: str, trust_remote_code: bool, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    try:
        # A copy: from_config writes the dtype into the config it is given (the user's, or their model's).
        return auto.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code, dtype=dtype)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ValueError(
                f"{type(config).__name__} has no {task} model in Transformers; pass task='classification' "
                "or 'causal-lm' to match the model"
            ) from None
        raise ValueError(
            f"{type(config).__name__} does not describe a valid model ({str(e).splitlines()[0][:240]}); fix its config"
        ) from None
    except (RuntimeError, TypeError, AssertionError) as e:
        raise ValueError(
            f"{type(config).__name__} does not describe a model Transformers can build "
            f"({type(e).__name__}: {str(e).splitlines()[0][:240]}); fix its config"
        ) from None
