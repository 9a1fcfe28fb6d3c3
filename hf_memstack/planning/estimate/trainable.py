"""What trains in an estimate: every parameter, LoRA with the common defaults, a PEFT config or a
dict of its fields, or what a PEFT model or a saved adapter says."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

from torch import nn

from ..._quiet import quiet_imports, quiet_peft_wrap
from ..._unwrap import peft_class

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel

    from ...policy import MemoryPolicy

Trainable: TypeAlias = "str | PeftConfig | dict[str, Any]"
"""What trains: ``"all"``, ``"lora"`` (:data:`DEFAULT_LORA`), a PEFT config, or a dict of ``LoraConfig``
fields; anything else is refused by :func:`peft_config_from`."""
M = TypeVar("M")


@quiet_imports()  # PEFT imports bitsandbytes and torchao: their import-time noise only
def what_trains(model: M, trainable: Trainable) -> tuple[M | nn.Module | str, Trainable]:
    """A PEFT model, or a saved adapter directory, says what trains itself (when ``trainable`` is
    left at "all"): its base model's config is estimated with its adapters (the base model, or the
    adapter's base id); any other ``model`` is returned as given."""
    if isinstance(model, nn.Module) and peft_class(model) and hasattr(model, "peft_config"):
        peft = cast("PeftModel", model)  # a PEFT model: its peft_config and active_adapter are not nn.Module's
        if not (isinstance(trainable, str) and trainable in ("all", "lora")):
            # Its own adapters are what trains: another config would silently estimate other adapters.
            raise ValueError(
                f"trainable={_short(trainable)} with a PEFT model ({type(model).__name__}) that has adapters of its own "
                f"({peft.active_adapter!r}); its adapters are what trains, so leave trainable at 'all' (or 'lora') to "
                "estimate them, or pass the base model (model.get_base_model()) with the trainable= you want"
            )
        # 'lora' on a LoRA model is its own adapters, not the default ones.
        return peft.get_base_model(), peft.peft_config[peft.active_adapter]
    if isinstance(model, nn.Module) and trainable == "all" and any(not p.requires_grad for p in model.parameters()):
        warnings.warn(
            f"{type(model).__name__} has frozen parameters, but the estimate builds it from its config, where every "
            "parameter trains; pass trainable= (a PEFT config, 'lora' or a dict) to estimate what really trains",
            stacklevel=3,
        )
    path = Path(str(model)).expanduser() if isinstance(model, (str, Path)) else None
    if path is not None and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from peft import PeftConfig

        adapter = PeftConfig.from_pretrained(str(path))
        return adapter.base_model_name_or_path, adapter if trainable == "all" else trainable
    return model, trainable


@quiet_imports()  # PEFT imports bitsandbytes and torchao: their import-time noise only
def peft_config_from(trainable: Trainable) -> PeftConfig | None:
    """``trainable`` as a PEFT config (None for ``"all"``).

    Raises:
        TypeError: not ``"all"``, ``"lora"``, a PEFT config or a dict.
        ValueError: a dict with fields ``LoraConfig`` does not have, or bad values.
    """
    if isinstance(trainable, str) and trainable == "all":
        return None
    allowed = "'all', 'lora', a PEFT config such as peft.LoraConfig(r=8, target_modules=['q_proj', 'v_proj']), or a dict of LoraConfig fields"
    if isinstance(trainable, str) and trainable != "lora":
        raise ValueError(f"trainable={trainable!r} is not one of {allowed}")
    if not isinstance(trainable, (str, dict)) and not type(trainable).__module__.startswith("peft."):
        raise TypeError(f"trainable={trainable!r} ({type(trainable).__name__}) must be {allowed}")
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError(f"trainable={trainable!r} needs PEFT: pip install peft") from None
    if isinstance(trainable, str):  # "lora": any other string was refused above
        return LoraConfig(**DEFAULT_LORA)
    if isinstance(trainable, dict):
        try:
            return LoraConfig(**{**DEFAULT_LORA, **trainable})
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"trainable={trainable!r} is not a valid LoraConfig ({e}); allowed fields are LoraConfig's, "
                "e.g. {'r': 16, 'lora_alpha': 32, 'target_modules': ['q_proj', 'v_proj']}"
            ) from None
    return trainable


# LoRA's common defaults (PEFT's own r=8), on every linear layer but the output head.
DEFAULT_LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}


@quiet_imports()  # PEFT imports bitsandbytes and torchao: their import-time noise only
@quiet_peft_wrap()  # PEFT's own deprecated call into Transformers, not the user's
def apply_peft(net: nn.Module, peft_config: PeftConfig) -> nn.Module:
    from peft import get_peft_model  # optional: only when a PEFT config is given

    peft_config = copy.deepcopy(peft_config)
    # A saved adapter's config says inference_mode=True (adapters frozen); what is estimated is training them.
    if getattr(peft_config, "inference_mode", False):
        peft_config.inference_mode = False
    try:
        return get_peft_model(net, peft_config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"trainable: the PEFT config does not fit {type(net).__name__} ({str(e).splitlines()[0][:200]}); "
            f"its linear layers are named {names}: pass target_modules from those"
        ) from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def policy_of(
    model: object, policy: MemoryPolicy | str | dict[str, Any] | None
) -> MemoryPolicy | str | dict[str, Any] | None:
    """The policy to estimate: the one given, else a prepared model's own (``model.memstack``):
    estimating a prepared model as plain fp32 would count a run it does not make."""
    if policy is None and isinstance(model, nn.Module):
        from ...record import record_of

        record = record_of(model)
        return record.policy if record is not None else None
    return policy
