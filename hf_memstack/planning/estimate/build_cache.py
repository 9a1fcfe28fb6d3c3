"""What the estimator builds once per config and job instead of once per trace: the depth plan
(the full model built on meta, its blocks compared) and the model on meta with its PEFT adapters.

The planner estimates up to a dozen rungs of one model, each with two shallow traces: those
differ in the policy and the batch, not in the model built, so the builds (the depth plan's
full-depth meta model, PEFT's wrapping: else paid again on every trace) are kept here, keyed by everything that
goes into them - the config's class and every field, the task, the weights' dtypes, the PEFT
config - and a cached model is handed out as a deep copy (its caller prepares and fakes it in place).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, TypeVar, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["cached", "clear", "config_key", "model_copy"]

T = TypeVar("T")

_MOST = 16  # entries per cache: a plan holds two depths and the full model's plan per job
_CACHES: dict[str, dict[tuple[Hashable, ...], object]] = {
    "block_kinds": {},
    "depth_plans": {},
    "meta_models": {},
    "parameter_counts": {},
}


def config_key(config: PretrainedConfig) -> tuple[str, str]:
    """The config as a key: its class and every field (``to_json_string`` with the defaults, so two
    configs that differ anywhere - depth, width, dtype, a per-block list - never share an entry)."""
    return type(config).__qualname__, config.to_json_string(use_diff=False) + _private_settings(config)


def _private_settings(config: PretrainedConfig) -> str:
    """What ``to_json_string`` leaves out but the build reads: the attention (and experts)
    implementation a config was given (``attn_implementation="eager"``), its own and its sub-configs'."""
    settings = []
    for owner in (config, *(getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {})):
        if owner is not None and hasattr(owner, "__dict__"):
            settings += sorted(
                (k, v)
                for k, v in vars(owner).items()
                if k.startswith("_") and isinstance(v, (str, int, bool, type(None))) and "implementation" in k
            )
    return repr(settings)


def cached(cache: str, key: tuple[Hashable, ...], build: Callable[[], T]) -> T:
    """``build()``'s value for ``key`` in the named cache, built on the first call (None is kept too)."""
    entries = _CACHES[cache]
    if key in entries:
        return cast(T, entries[key])  # built by this key's build, of its type
    value = build()
    if len(entries) >= _MOST:
        entries.clear()
    entries[key] = value
    return value


def model_copy(key: tuple[Hashable, ...], build: Callable[[], nn.Module]) -> nn.Module:
    """A deep copy of the meta model cached for ``key`` (tied parameters stay tied: one memo)."""
    return copy.deepcopy(cached("meta_models", key, build))


def clear() -> None:
    """Forget every cached build (tests compare against fresh builds)."""
    for entries in _CACHES.values():
        entries.clear()
