"""A model folder's config.json, read and checked before Transformers reads it.

``AutoConfig.from_pretrained`` reads the file itself and trusts it: a FIFO there blocks, JSON
nested 100,000 deep raises ``RecursionError``, ``num_hidden_layers: 1000000000`` builds a list
per layer in the config and then a block per layer on the meta device (its time grows with the
layers: a typo's 10^9 never ends), an unknown ``model_type`` is echoed raw in its message. Each is refused here
first, naming the file, the field, the value and the fix; the same depth and head checks apply to
a config dict or object the estimator is given.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...files import FileContentError, read_json

__all__ = ["MAX_LAYERS", "check_config_file", "check_dict_keys", "check_sizes", "read_config_file"]

# The most blocks a stack may have. The deepest released models have 61 (DeepSeek-V3), 80
# (Llama-3-70B), 96 (GPT-3 175B), 126 (Llama-3.1-405B); DeepNet trained 1,000 layers. Every
# block is built on the meta device to count parameters and compare blocks, so an estimate's and a
# plan's time grow with the blocks: at this many, tens of seconds on 2 cores; past it, minutes.
MAX_LAYERS = 1024
# The fields that count a stack's blocks, across Transformers' configs.
_LAYER_FIELDS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "encoder_layers",
    "decoder_layers",
)
# The dtype names a config.json may carry (torch's names of the floating-point dtypes weights load in).
CONFIG_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64"})


def read_config_file(config: Path, what: str) -> dict[str, Any]:
    """The fields in ``config`` (a folder's config.json): a regular file (not a FIFO, a directory, a
    device) holding a JSON object. ``what`` names the model as the user gave it (``model='...'``).

    Raises:
        ValueError: there is no such file, or it is not a regular file, not JSON, nested too
            deeply, or not an object.
    """
    try:
        data = read_json(config)
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(
            f"{what} is a directory without a config.json; pass a directory written by save_pretrained"
        ) from None
    except FileContentError as e:
        raise ValueError(
            f"{what}: {e}; it must be the model's config.json (a JSON file save_pretrained writes): "
            "replace it, or re-download the model"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{what}: {config} holds a JSON {type(data).__name__}, not an object of config fields; "
            "re-save the model with save_pretrained"
        )
    return data


def check_sizes(data: Mapping[str, Any], what: str) -> None:
    """Refuse a stack deeper than :data:`MAX_LAYERS` and attention heads that key/value heads do
    not divide, in ``data`` and every sub-config in it (``text_config``...), before anything is built.

    Raises:
        ValueError: naming the field, its value, the limit and the fix.
    """
    todo: list[tuple[str, Mapping[str, Any]]] = [("", data)]
    while todo:  # a loop, not recursion: the JSON may nest as deep as its parser allowed
        prefix, fields = todo.pop()
        for key, value in fields.items():
            if isinstance(value, Mapping):
                todo.append((f"{prefix}{key}.", value))
            elif key in _LAYER_FIELDS and _number(value) and value > MAX_LAYERS:
                raise ValueError(
                    f"{what} has {prefix}{key}={value!r}: a stack of more than {MAX_LAYERS:,} blocks, deeper than any "
                    "model released (the deepest have 60-130); the estimator would build every block. Fix the value "
                    "(copy the model's config.json again)"
                )
        _check_heads(prefix, fields, what)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_heads(prefix: str, fields: Mapping[str, Any], what: str) -> None:
    """Grouped-query attention repeats each key/value head for ``heads / kv_heads`` query heads: a
    ratio that is not whole fails inside the model's forward, with torch's words about tensor sizes."""
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, kv)) and heads % kv:  # type: ignore[operator]
        raise ValueError(
            f"{what} has {prefix}num_key_value_heads={kv!r}, which does not divide {prefix}num_attention_heads={heads!r} "
            "(each key/value head serves a whole number of query heads); set it to a divisor of the heads "
            f"(e.g. {heads} or 1)"
        )


def check_config_file(config: Path, what: str, *, trust_remote_code: bool) -> None:
    """Everything wrong with ``config`` (a folder's config.json, or the file the user named) that
    Transformers would hang on, crash on or say unclearly (see the module docstring), as one ValueError."""
    from transformers import CONFIG_MAPPING

    data = read_config_file(config, what)
    if "model_type" not in data:
        raise ValueError(
            f"{what}: {config} has no 'model_type' (which architecture it is); "
            'add it (e.g. "model_type": "llama") or re-save the model with save_pretrained'
        )
    check_sizes(data, f"{what}: {config.name}")
    _check_dtypes(data, f"{what}: {config.name}")
    model_type = data["model_type"]
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        # A misspelled field would build the architecture's default for it, silently (a dict is checked alike).
        check_dict_keys(CONFIG_MAPPING[model_type], data, f"{what}: {config.name}")
    elif data.get("auto_map") and not trust_remote_code:
        raise ValueError(
            f"{what}: {config} has model_type={model_type!r}, which this Transformers does not know, and an "
            "auto_map: the model is defined by custom code in its folder, which hf_memstack does not run "
            "(trust_remote_code is off). Read the code; if you trust it, pass trust_remote_code=True "
            "(estimate_memory / plan_policy), or estimate a built-in architecture of the same shape"
        )
    elif not data.get("auto_map"):
        # Transformers' own message quotes the value raw (a U+202E in it turns the terminal's line around).
        import transformers

        raise ValueError(
            f"{what}: {config} has model_type={model_type!r}, which Transformers {transformers.__version__} does not "
            "know: fix the field (e.g. 'llama'), or upgrade transformers if the architecture is newer"
        )


def _check_dtypes(data: Mapping[str, Any], what: str) -> None:
    for field in ("dtype", "torch_dtype"):
        value = data.get(field)
        if value is not None and value not in CONFIG_DTYPES:
            # Transformers would fail on it with torch's own words (no attribute 'float8', no Storage).
            raise ValueError(
                f"{what} has {field}={value!r}, which is not a dtype Transformers "
                f"loads weights in; set it to the dtype the weights were saved in, one of {sorted(CONFIG_DTYPES)}, "
                "or remove the field"
            )


def check_dict_keys(cls: type, data: Mapping[str, Any], what: str) -> None:
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
