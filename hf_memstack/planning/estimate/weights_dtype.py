"""The dtype a model's weights will have when it is loaded, so the estimator counts the bytes the
user's model really holds.

Transformers 5 loads with ``dtype="auto"`` by default: a checkpoint saved in bf16 comes back in
bf16. This mirrors ``from_pretrained``'s own resolution of ``"auto"`` for a local folder
(``transformers.modeling_utils._get_dtype``): the config's ``dtype`` (a legacy ``torch_dtype``
entry is read into it by the config class), else the ``dtype`` in a sharded checkpoint's index,
else the first floating tensor of the first weights file (its header only, nothing is
unpickled); a config with none of these gives fp32, as ``from_pretrained`` does. A model object
counts at its parameters' own dtypes - a prepared one at the dtypes training gives them (a base
frozen after ``prepare_model`` goes back to its loaded dtype: :mod:`hf_memstack.transforms.precision.master_reconcile`),
and its 4-bit layers (bitsandbytes' ``Params4bit``, torchao's ``NF4Tensor``) at their own bytes
(:func:`four_bit_layers`). The modules a model keeps in fp32
(``_keep_in_fp32_modules``) stay fp32, as ``from_pretrained`` keeps them.
"""

from __future__ import annotations

import pickle
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...files import read_json
from ...measure.accounting import tensor_bytes
from ...transforms._peft import logical_name
from ...transforms.blocks import find_blocks
from ...transforms.precision.master_reconcile import planned_dtypes
from ...transforms.quant.apply import four_bit_weight

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "DTYPE_CHOICES",
    "WeightsDtype",
    "FourBitLayers",
    "cast_like_from_pretrained",
    "four_bit_layers",
    "parse_dtype",
    "resolve_weights_dtype",
    "set_dtypes",
    "short_name",
]

_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
"""What ``dtype=`` (``--dtype``) accepts, besides ``torch.float32`` / ``torch.bfloat16`` / ``torch.float16``
and the long names (``"bfloat16"``)."""
_ALLOWED = (
    "'auto' (what from_pretrained gives), 'fp32', 'bf16', 'fp16' (or torch.float32, torch.bfloat16, torch.float16)"
)


@dataclass(frozen=True, slots=True)
class WeightsDtype:
    """The weights' dtype and where it was read."""

    dtype: torch.dtype
    source: str
    """e.g. ``"config.json's dtype"``, ``"the weights in model.safetensors"``, ``"requested"``."""
    per_parameter: dict[str, torch.dtype] | None = None
    """A model object's own dtype per parameter name (its frozen and trainable weights may differ)."""

    @property
    def name(self) -> str:
        return short_name(self.dtype)


def short_name(dtype: torch.dtype) -> str:
    """``bf16`` for torch.bfloat16 (the policy's names), else the dtype without ``torch.``."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def parse_dtype(dtype: object, *, field: str = "dtype") -> torch.dtype | None:
    """``dtype=`` as a torch dtype, or None for ``"auto"`` / None (resolve it from the model).

    Raises:
        ValueError: a string or torch dtype that is not one of the allowed ones.
        TypeError: neither a string nor a torch dtype.
    """
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return None
    if isinstance(dtype, torch.dtype):
        if dtype in _NAMES.values():
            return dtype
        raise ValueError(f"{field}={dtype} is not a weights dtype hf_memstack estimates; use {_ALLOWED}")
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _NAMES:
            return _NAMES[key]
        raise ValueError(f"{field}={dtype!r} is not one of {_ALLOWED}")
    raise TypeError(f"{field}={dtype!r} ({type(dtype).__name__}) must be a string or a torch.dtype: {_ALLOWED}")


def resolve_weights_dtype(model: object, config: PretrainedConfig, dtype: object = "auto") -> WeightsDtype:
    """The dtype the weights of ``model`` (a directory, cached hub id, config, config dict or
    model object; ``config`` is its loaded config) will have: ``dtype`` when given, else what
    ``from_pretrained(model)`` gives (see the module's docstring).

    Raises:
        ValueError, TypeError: a bad ``dtype`` (see :func:`parse_dtype`).
    """
    requested = parse_dtype(dtype)
    if requested is not None:
        return WeightsDtype(requested, "requested")
    if isinstance(model, nn.Module):
        return _of_module(model)
    own = _config_dtype(config)
    if own is not None:
        return WeightsDtype(own, "the config's dtype")
    folder = _local_folder(model)
    found = _checkpoint_dtype(folder) if folder is not None else None
    if found is not None:
        return WeightsDtype(*found)
    return WeightsDtype(
        torch.float32, "fp32: the config names no dtype" + (" and no weights file was found" if folder else "")
    )


def _of_module(model: nn.Module) -> WeightsDtype:
    # A prepared model's dtypes as training will hold them (its first training forward, make_optimizer
    # or the Trainer reconciles its master weights with what trains), the model left untouched.
    planned = planned_dtypes(model)
    per = {
        name: planned.get(id(p), p.dtype)
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.is_floating_point()
    }
    if not per:
        return WeightsDtype(torch.float32, "fp32: the model has no floating parameters")
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            counts[planned.get(id(p), p.dtype)] += p.numel()
    main = counts.most_common(1)[0][0]
    return WeightsDtype(main, "the model's parameters", per_parameter=per)


def _config_dtype(config: PretrainedConfig) -> torch.dtype | None:
    return _named_dtype(getattr(config, "dtype", None))


def _named_dtype(value: object) -> torch.dtype | None:
    """A torch dtype, or its name as configs and checkpoint indexes write it (``"bfloat16"``)."""
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def _local_folder(model: object) -> Path | None:
    """The folder holding the model's files: a local directory, or a cached hub id's snapshot (no download)."""
    if not isinstance(model, (str, Path)):
        return None
    path = Path(str(model)).expanduser()
    if path.is_dir():
        return path
    from transformers.utils import cached_file

    try:
        found = cached_file(
            str(model), "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False
        )
    except (OSError, ValueError):
        return None
    return Path(found).parent if found else None


def _checkpoint_dtype(folder: Path) -> tuple[torch.dtype, str] | None:
    """What ``from_pretrained`` reads when the config names no dtype: a sharded checkpoint index's
    ``dtype``, else the first floating tensor of the first weights file (safetensors: the header)."""
    from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index, first = folder / index_name, folder / single
        if index.is_file():
            try:
                # Bounded, non-blocking, RecursionError as a ValueError: the index is a received file too.
                data = read_json(index)
                shards = sorted(set(data["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            meta = data.get("metadata") or {}
            named = _named_dtype(meta.get("dtype")) if isinstance(meta, dict) else None
            if named is not None:
                return named, f"the dtype in {index_name}"
            first = folder / shards[0] if shards else first
        if first.is_file():
            # map_location="meta": safetensors reads the header; a .bin goes through torch.load(weights_only=True)
            try:
                state = load_state_dict(str(first), map_location="meta", weights_only=True)
                return get_state_dict_dtype(state), f"the weights in {first.name}"
            except Exception as e:  # a damaged file, or a pickle weights_only refuses: the user's file, not a bug
                why = (
                    "a pickle that torch.load(weights_only=True) refuses to load"
                    if isinstance(e, pickle.UnpicklingError)
                    else f"{type(e).__name__}: {(str(e).splitlines() or ['no message'])[0][:160]}"
                )
                raise ValueError(
                    f"dtype='auto': the config in {folder} names no dtype, and {first.name} cannot be read for it ({why}): "
                    "the file is damaged, truncated or not a weights file (nothing in it was run). Re-save the model "
                    "(save_pretrained writes safetensors), or pass dtype= (--dtype bf16|fp16|fp32) to say which dtype to count"
                ) from e
    return None


def cast_like_from_pretrained(net: nn.Module, dtype: torch.dtype) -> None:
    """Put the modules ``from_pretrained`` keeps in fp32 at that dtype (its ``dtype_plan``:
    ``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict`` under 16-bit), in place."""
    plan_of = getattr(net, "_get_dtype_plan", None)
    plan = plan_of(dtype) if callable(plan_of) else {}
    if plan:
        # The same matching as Transformers' loader: each key a pattern searched in the parameter's name.
        pattern = re.compile("|".join(f"(?:{key.replace('*', '.*')})" for key in plan))
        set_dtypes(
            net, {n: torch.float32 for n, _ in net.named_parameters(remove_duplicate=False) if pattern.search(n)}
        )


def set_dtypes(net: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Give the named floating parameters of ``net`` these dtypes, in place (tied ones stay tied)."""
    done: dict[int, nn.Parameter] = {}
    for module_name, module in net.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            want = dtypes.get(full)
            if p is None or want is None or not p.is_floating_point() or p.dtype == want:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(want), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]


@dataclass(frozen=True, slots=True)
class FourBitLayers:
    """A model object's 4-bit linear layers: what the estimate traces as 4-bit, and their real bytes."""

    targets: tuple[str, ...]
    """Their names, inside a block without the block's own (``self_attn.q_proj``): the same layers at any traced depth."""
    layers: int
    weights_bytes: int
    """Their bytes as the model holds them (codes and quantization state; bitsandbytes' or torchao's layout)."""


def four_bit_layers(model: nn.Module) -> FourBitLayers | None:
    """The 4-bit layers of ``model`` (loaded with bitsandbytes, or quantized by ``prepare_model``), or None."""
    found = [(logical_name(n), w) for n, m in model.named_modules() if (w := four_bit_weight(m)) is not None]
    if not found:
        return None
    try:
        blocks = find_blocks(model)
        prefixes = sorted({logical_name(b) for b in blocks.names}, key=len, reverse=True)
    except ValueError:
        prefixes = []
    targets = set()
    for name, _ in found:
        block = next((b for b in prefixes if name.startswith(b + ".")), None)
        targets.add(name[len(block) + 1 :] if block else name)
    return FourBitLayers(
        targets=tuple(sorted(targets)),
        layers=len(found),
        weights_bytes=sum(tensor_bytes(w) for _, w in {id(w): (n, w) for n, w in found}.values()),
    )
