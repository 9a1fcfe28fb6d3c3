"""The wrapper walk: the model ``prepare_model`` recorded its work on, seen through DDP/FSDP1/
DataParallel (``.module``), ``torch.compile`` (``._orig_mod``) and PEFT (``get_base_model()``).

Apart from :mod:`hf_memstack.record` because the transforms need the walk (the loss head and the
precision find the prepared model with it) while the record holds the transforms' result types:
with the walk in the record module, each imported the other.
"""

from __future__ import annotations

from typing import Protocol, cast

from torch import nn

__all__ = ["RecordBase", "peft_class", "record_of", "unwrap_model"]


class PeftWrapper(Protocol):
    """A PEFT model, as the walk and its callers use one: nn.Module types an attribute it does not
    define as ``Tensor | Module``, so ``get_base_model`` is typed through this (a cast, after the
    check that found it)."""

    def get_base_model(self) -> nn.Module: ...


class RecordBase:
    """What the walk looks for: :class:`hf_memstack.record.MemstackRecord` derives from it."""

    __slots__ = ()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module ``prepare_model`` recorded its work on, seen through DDP/FSDP1/DataParallel
    (``.module``), ``torch.compile`` (``._orig_mod``) and PEFT (``get_base_model()``) wrappers, in
    any nesting; the innermost model when none of them holds a record."""
    current = model
    for _ in range(16):  # wrappers nest a few deep at most; never loop on a cycle
        if isinstance(current.__dict__.get("memstack"), RecordBase):
            return current
        inner = _inner(current)
        if inner is None:
            return current
        current = inner
    return current


def record_of(model: nn.Module) -> RecordBase | None:
    """``model.memstack`` of the prepared model inside ``model`` (through DDP, compile, PEFT), or
    None: a :class:`hf_memstack.record.MemstackRecord` (typed here by its base, which this module
    can import without importing the record's result types)."""
    record = unwrap_model(model).__dict__.get("memstack")
    return record if isinstance(record, RecordBase) else None


# Wrappers that hold the model as ``.module`` (DDP, DataParallel, FSDP1, DeepSpeed's engine, and
# hf_memstack.integrations.trainer_loss.TrainerLoss: a trainer's compute_loss as a module).
_MODULE_WRAPPERS = {
    "DistributedDataParallel",
    "DataParallel",
    "FullyShardedDataParallel",
    "DeepSpeedEngine",
    "TrainerLoss",
}


def _inner(model: nn.Module) -> nn.Module | None:
    modules = model.__dict__.get("_modules", {})
    if type(model).__name__ in _MODULE_WRAPPERS and isinstance(modules.get("module"), nn.Module):
        return modules["module"]
    if type(model).__name__ == "OptimizedModule" and isinstance(
        modules.get("_orig_mod"), nn.Module
    ):  # torch.compile(model)
        return modules["_orig_mod"]
    if peft_class(model) and hasattr(model, "get_base_model"):
        base = _peft_base(model)
        return base if base is not model else None
    return None


def _peft_base(model: nn.Module) -> nn.Module | None:
    """``get_base_model()``; for a PEFT model whose active adapter was deleted (``delete_adapter``),
    where it raises ``KeyError`` (it reads the active adapter's config), the model its tuner wraps."""
    try:
        return cast(PeftWrapper, model).get_base_model()
    except KeyError:
        tuner = model.__dict__.get("_modules", {}).get("base_model")
        if not isinstance(tuner, nn.Module):
            return None
        inner = tuner.__dict__.get("_modules", {}).get("model")
        # A LoRA-like tuner wraps the model as .model; a prompt-learning PeftModel's base_model is the model.
        return inner if type(tuner).__module__.startswith("peft.") and isinstance(inner, nn.Module) else tuner


def peft_class(obj: object) -> bool:
    """True when ``obj``'s class is PEFT's or derives from one: FSDP2's ``fully_shard`` swaps a
    sharded module's class for ``FSDP<Name>`` (defined in torch), with PEFT's class as a base."""
    return any(cls.__module__.startswith("peft.") for cls in type(obj).__mro__)
