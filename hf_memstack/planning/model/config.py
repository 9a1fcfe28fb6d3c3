"""The model an estimate is of: its Transformers config from whatever was given (a config, a dict, a
local directory, a cached hub id), its task (causal LM, sequence-to-sequence LM or classification), and the model built
from it with random weights."""

from __future__ import annotations

import copy
import difflib
import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import torch
from torch import nn

from ..._text import printable
from ...files import describe_kind
from ...record import unwrap_model
from ..estimate.trainable import apply_peft
from ..estimate.weights_dtype import cast_like_from_pretrained
from .config_file import check_config_file, check_dict_keys, check_sizes, read_config_file
from .vision_inputs import is_vision_language

if TYPE_CHECKING:
    from peft import PeftConfig
    from transformers import PretrainedConfig
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

ModelSource: TypeAlias = "str | Path | PretrainedConfig | dict[str, Any] | nn.Module"
"""What names the model of an estimate or a plan (a config file's path too): what ``_ACCEPTED`` tells the user."""
_ACCEPTED = (
    "a hub id (in the local cache), a local directory, a Transformers config (e.g. LlamaConfig(...)), a config "
    "dict with its 'model_type' (config.to_dict()), or a model"
)


def load_config(model: ModelSource, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """A Transformers config from a config object, a config dict, a local directory, or a hub id already in the
    local cache. Nothing is downloaded, so an unknown id fails at once instead of hanging offline.

    Raises:
        ValueError: not a directory with a config.json and not in the local Hugging Face cache; or
            its config.json (or the dict) is not valid JSON, has no ``model_type``, or describes an invalid model.
        TypeError: ``model`` is none of the above (e.g. a config class rather than a config).
    """
    config = _load(model, trust_remote_code)
    # A config object, or one built from a file or dict (checked before it was built, again here):
    # every block is built on meta, so a 20,000-block stack would take minutes before any answer.
    if callable(getattr(config, "to_dict", None)):
        check_sizes(config.to_dict(), f"model= a {type(config).__name__}")
    return config


def _load(model: ModelSource, trust_remote_code: bool) -> PretrainedConfig:
    from transformers import PretrainedConfig

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
    return _from_path_or_id(str(model), trust_remote_code)


def _from_path_or_id(model: str, trust_remote_code: bool) -> PretrainedConfig:
    """The config of a local folder or config file (checked first) or of a hub id in the local cache."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    local = _local_config(model, path)
    if local is not None:
        check_config_file(local, f"model={model!r}", trust_remote_code=trust_remote_code)
    else:
        _check_cached_config(model)
    try:
        return AutoConfig.from_pretrained(
            str(path) if local is not None else model, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # noqa: BLE001 - any failure to build the config is an invalid model (huggingface_hub's
        # strict-dataclass validation raises its own error type), said with its cause
        if local is not None:
            raise ValueError(
                f"model={model!r}: {local} is not a valid Transformers config ({_reason(e)}); fix the file or "
                "pass another model"
            ) from None
        if _looks_like_a_path(model):
            # `hf download ./nope` would be no help: the user meant a folder on disk.
            raise ValueError(
                f"model={model!r}: no such directory ({path.resolve()}); pass the directory holding the model's "
                "config.json (a save_pretrained folder) or a Hub model id in the local cache"
            ) from None
        near = _near_local_folder(model)
        fix = f"did you mean the folder {near!r}?" if near else f"download it first (`hf download {model} config.json`)"
        raise ValueError(
            f"model={model!r} is not a local directory with a config.json and not in the local Hugging Face cache "
            f"({type(e).__name__}); {fix} or pass a local directory"
        ) from None


def _local_config(model: str, path: Path) -> Path | None:
    """The config file ``model`` names on disk: a folder's config.json, or the file itself (Transformers
    reads a config file given by its path); None when nothing is there (a hub id). Anything else -
    a FIFO, a device, a socket - is refused, saying what it is, before anything opens it."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # nothing there (a hub id), or a name the OS refuses
        return None
    if stat.S_ISDIR(mode):
        return path / "config.json"
    if stat.S_ISREG(mode):
        return path
    raise ValueError(
        f"model={model!r} is {describe_kind(mode)}, not a directory or a config file; pass the directory holding "
        "the model's config.json (a save_pretrained folder) or a Hub model id in the local cache"
    )


def _check_cached_config(model: str) -> None:
    """A hub id's cached config.json, read as a folder's is (bounded, a regular file, JSON an object,
    a depth that builds) before Transformers reads it; nothing is downloaded."""
    from transformers.utils import cached_file

    try:
        found = cached_file(model, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):  # not in the cache, or not a hub id: Transformers says so below
        return
    if found:
        check_sizes(read_config_file(Path(found), f"model={model!r}"), f"model={model!r}: config.json")


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
    check_sizes(data, "model= a config dict")
    check_dict_keys(cls, data, "model= a config dict")
    try:
        return cls.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - a config class's own validation raises its own types
        raise ValueError(
            f"model= a config dict with model_type={model_type!r} is not a valid Transformers config ({_reason(e)}); "
            "fix its values"
        ) from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reason(e: BaseException) -> str:
    """The innermost cause's type and first line (validation errors wrap the useful one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    # Escaped: Transformers' messages quote values from the file (a model_type holding U+202E or NUL).
    return printable(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240] if str(e).strip() else ''}")


# The largest tensor one step may hold, in bytes: 1 PiB, thousands of times any device's memory.
# Past it the sizes are a typo (or a config's max_position_embeddings=10**12), and torch's sizes
# would overflow before any estimate: refused with the fix instead of an internal error.
MAX_TENSOR_BYTES = 2**50
# Bytes per value of the step's activations counted by the bound (fp32, the widest a step keeps).
_VALUE_BYTES = 4


def check_seq_len(config: PretrainedConfig, seq_len: int, batch_size: int = 1) -> None:
    """Raise ValueError when ``seq_len`` is not positive, above the model's position limit, or
    ``batch_size`` x ``seq_len`` tokens need a tensor above :data:`MAX_TENSOR_BYTES`."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    # A vision-language model's positions are its language model's (the composite config has none).
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"seq_len={seq_len} is above the model's limit of {limit} positions; use seq_len={limit} or less"
        )
    _check_tensor_sizes(config, seq_len, batch_size)


def _check_tensor_sizes(config: PretrainedConfig, seq_len: int, batch_size: int) -> None:
    """The attention mask and scores hold batch x seq_len x seq_len values, the hidden states,
    MLP and logits batch x seq_len x their width: any above the bound cannot exist on a device."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    widths = [getattr(text, n, None) for n in ("hidden_size", "intermediate_size", "vocab_size")]
    width = max((w for w in widths if isinstance(w, int) and not isinstance(w, bool) and w > 0), default=1)
    per_row = _VALUE_BYTES * seq_len * max(seq_len, width)
    if batch_size * per_row <= MAX_TENSOR_BYTES:
        return
    what = (
        "the attention scores, batch_size x seq_len x seq_len"
        if seq_len >= width
        else f"the activations, batch_size x seq_len x {width} (the model's widest layer)"
    )
    room = MAX_TENSOR_BYTES // (_VALUE_BYTES * batch_size)
    longest = min(math.isqrt(room), room // width)
    largest_batch = MAX_TENSOR_BYTES // per_row
    fix = (
        f"use seq_len={longest} or less at this batch size" if longest >= 1 else "no seq_len fits this batch size"
    ) + (f", or batch_size={largest_batch} or less at this seq_len" if largest_batch >= 1 else "")
    if per_row > MAX_TENSOR_BYTES:  # too long even for one sample: the position limit let it through
        fix += " (a config whose max_position_embeddings allows it is wrong too: copy the model's config.json again)"
    raise ValueError(
        f"seq_len={seq_len} (--seq-len) with batch_size={batch_size} (--batch-size) needs a tensor of "
        f"{batch_size * per_row:.3g} bytes ({what}, {_VALUE_BYTES} bytes each), above the limit of "
        f"{MAX_TENSOR_BYTES:.3g} bytes (1 PiB) that no device comes near: {fix}"
    )


def infer_task(model: object, config: PretrainedConfig) -> str:
    """Which head to build when no task is given: ``classification`` for a sequence-classification
    model (its class, or the config's ``architectures`` saved by ``save_pretrained``) and for an
    encoder without a causal-LM head (``BertModel``, ``BertForMaskedLM``: what the recipe
    fine-tunes such a model for), ``seq2seq-lm`` for an encoder-decoder saved with its LM head (T5, BART:
    ``*ForConditionalGeneration``, or no architecture named), else ``causal-lm``. See :func:`task_note` for why.

    Raises:
        ValueError: an encoder-decoder saved with another head (``BartForQuestionAnswering``): it is refused
            naming it, not built as a different model."""
    return _infer_task(model, config)[0]


def task_note(model: object, config: PretrainedConfig) -> str | None:
    """Why :func:`infer_task` chose classification for a model that names no classification head
    (an encoder), as a note for the estimate; None when the architecture says it plainly."""
    return _infer_task(model, config)[1]


TASKS = ("causal-lm", "seq2seq-lm", "classification")
"""The heads the estimator builds: a causal LM's, an encoder-decoder's LM (T5, BART), a sequence classifier's."""
SEQ2SEQ_NOTE = (
    "task: seq2seq-lm (an encoder-decoder): traced with seq_len input tokens and seq_len label tokens per sample "
    "(the decoder reads the labels shifted right); a shorter target costs less in the decoder"
)
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _infer_task(model: object, config: PretrainedConfig) -> tuple[str, str | None]:

    names = (
        [type(unwrap_model(model)).__name__]
        if isinstance(model, nn.Module)
        else list(getattr(config, "architectures", None) or [])
    )
    if any(n.endswith("ForSequenceClassification") for n in names):
        return "classification", None
    if config is None and isinstance(model, nn.Module):
        config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and not is_vision_language(config):
        return _encoder_decoder_task(config, names), None
    if any(n.endswith(_CAUSAL_HEADS) for n in names):
        return "causal-lm", None
    if _is_encoder(config):
        # An encoder (BERT, RoBERTa...) is not a causal LM: building it as one makes a decoder it
        # never was (BertLMHeadModel, with an is_decoder warning per layer) and estimates its MLM-sized head.
        what = printable(names[0]) if names else type(config).__name__  # names: the config's architectures
        return "classification", (
            f"task: classification ({what} is an encoder, fine-tuned with a classification head as the "
            "recipe does); pass task='causal-lm' (--task causal-lm) to estimate it as a decoder"
        )
    return "causal-lm", None


def _encoder_decoder_task(config: PretrainedConfig, names: list[str]) -> str:
    """An encoder-decoder (T5, BART) generating text is a ``seq2seq-lm``; built as a causal LM it would be
    its decoder alone (BartForCausalLM) or nothing (T5): another model. Any other head is refused."""
    if not names or any(n.endswith("ForConditionalGeneration") for n in names):
        return "seq2seq-lm"
    raise ValueError(
        f"{printable(names[0])} ({type(config).__name__}, model_type={config.model_type!r}) is an encoder-decoder "
        "without a sequence-to-sequence LM head or a classification head: the estimator cannot build it as saved; "
        "pass task='seq2seq-lm' (--task seq2seq-lm) to estimate it with its LM head, or task='classification'"
    )


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


def _auto_class(config: PretrainedConfig, task: str) -> type[_BaseAutoModelClass]:
    """The Auto class that builds ``config``'s model for ``task``: a vision-language model (a config
    with a ``vision_config``) is built whole, vision tower included, as ``from_pretrained`` on
    ``AutoModelForImageTextToText`` builds it - its causal-LM class (Qwen2-VL has none) or one
    without the tower (Mllama's) would be another model."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    if not is_vision_language(config):
        if task == "causal-lm" and getattr(config, "is_encoder_decoder", False):
            # AutoModelForCausalLM would build the decoder alone (BartForCausalLM): another model.
            raise ValueError(
                f"task='causal-lm' on {type(config).__name__} (model_type={config.model_type!r}), an encoder-decoder: "
                "its causal-LM model would be its decoder alone, not the model; pass task='seq2seq-lm' "
                "(--task seq2seq-lm) or leave task out"
            )
        autos = {"causal-lm": AutoModelForCausalLM, "seq2seq-lm": AutoModelForSeq2SeqLM}
        return autos.get(task, AutoModelForSequenceClassification)
    if task != "causal-lm":
        raise ValueError(
            f"task={task!r} on {type(config).__name__} (model_type={config.model_type!r}), a vision-language model: "
            "the estimator builds it as Transformers' image-text-to-text model (its language-model head); pass "
            "task='causal-lm' (--task causal-lm) or leave task out"
        )
    return AutoModelForImageTextToText


def _build(config: PretrainedConfig, task: str, trust_remote_code: bool, dtype: torch.dtype) -> nn.Module:

    auto = _auto_class(config, task)
    try:
        # A copy: from_config writes the dtype into the config it is given (the user's, or their model's).
        return auto.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code, dtype=dtype)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            if is_vision_language(config):
                raise ValueError(f"{type(config).__name__} has no image-text-to-text model in Transformers") from None
            raise ValueError(
                f"{type(config).__name__} (model_type={config.model_type!r}) has no {task} model in Transformers; "
                "pass task='causal-lm', 'seq2seq-lm' or 'classification' to match the model"
            ) from None
        raise ValueError(
            f"{type(config).__name__} does not describe a valid model ({str(e).splitlines()[0][:240]}); fix its config"
        ) from None
    except (RuntimeError, TypeError, AssertionError) as e:
        raise ValueError(
            f"{type(config).__name__} does not describe a model Transformers can build "
            f"({type(e).__name__}: {str(e).splitlines()[0][:240]}); fix its config"
        ) from None
