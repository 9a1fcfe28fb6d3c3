"""Weights in and out of a sharded model: rank 0 alone reads a pretrained model (the other ranks
build it on the meta device, then get rank 0's weights into their shards), and rank 0 alone writes
the gathered full state dict, so that no rank holds a second full copy it does not need."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..errors import DistributedMismatchError
from ..files import weights_follow_umask

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

__all__ = ["from_pretrained_for_fsdp", "load_from_rank0", "save_pretrained_full"]


def from_pretrained_for_fsdp(
    model_class: type[PreTrainedModel] | type[_BaseAutoModelClass], pretrained: str, **kwargs: Any
) -> PreTrainedModel:
    """Load a pretrained model for FSDP without a full copy on every rank.

    Rank 0 calls ``model_class.from_pretrained(pretrained, **kwargs)``; every other rank builds the
    same architecture, in rank 0's dtype, on the meta device (no memory). ``prepare_model`` with an
    ``fsdp`` policy then broadcasts rank 0's weights into each rank's shards. Call it on every rank,
    after the process group is initialised; without one it is plain ``from_pretrained``.

    ``model_class`` is an ``AutoModelFor*`` class or a model class.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model_class.from_pretrained(pretrained, **kwargs)
    model, dtype = _load_on_rank0(model_class, pretrained, kwargs)
    return model if model is not None else _meta_skeleton(model_class, pretrained, dtype, kwargs)


def _load_on_rank0(
    model_class: type[PreTrainedModel] | type[_BaseAutoModelClass], pretrained: str, kwargs: dict[str, Any]
) -> tuple[PreTrainedModel | None, torch.dtype]:
    """Rank 0 loads; every rank learns the dtype it loaded in ("auto" may pick the checkpoint's),
    or that it failed - then every rank raises, instead of waiting for weights that never come."""

    model, error = None, None
    if dist.get_rank() == 0:
        try:
            model = model_class.from_pretrained(pretrained, **kwargs)
        except Exception as e:  # noqa: BLE001 - told to the other ranks (waiting in the broadcast), then re-raised
            error = e
    outcome: str | None
    if error is not None:
        outcome = f"{type(error).__name__}: {error}"
    else:
        outcome = next((str(p.dtype) for p in model.parameters()), "torch.float32") if model is not None else None
    message = [outcome]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    loaded = str(message[0])  # rank 0's outcome: a dtype's name, its error, or None
    if not loaded.startswith("torch."):
        raise DistributedMismatchError(
            f"rank 0 could not load {pretrained!r}, so no rank can shard it: {message[0]}", failed_ranks=(0,)
        )
    return model, getattr(torch, loaded.removeprefix("torch."))


def _meta_skeleton(
    model_class: type[PreTrainedModel] | type[_BaseAutoModelClass],
    pretrained: str,
    dtype: torch.dtype,
    kwargs: dict[str, Any],
) -> PreTrainedModel:
    """The architecture rank 0 loaded, on the meta device, in its dtype."""
    from transformers import AutoConfig

    trust = kwargs.get("trust_remote_code", False)
    config = kwargs.get("config") or AutoConfig.from_pretrained(
        pretrained, trust_remote_code=trust, revision=kwargs.get("revision")
    )
    # Loading options (dtype: rank 0's, revision, use_safetensors...) do not go to the config;
    # those that shape the architecture (num_labels, ...) go to the config, as from_pretrained does.
    config.update(
        {
            k: v
            for k, v in kwargs.items()
            if k not in ("config", "attn_implementation", "dtype", "torch_dtype") and hasattr(config, k)
        }
    )
    extra = {"attn_implementation": kwargs["attn_implementation"]} if kwargs.get("attn_implementation") else {}
    with torch.device("meta"):
        if hasattr(model_class, "_model_mapping"):  # an AutoModelFor* class
            auto = cast("type[_BaseAutoModelClass]", model_class)
            return auto.from_config(config, dtype=dtype, trust_remote_code=trust, **extra)
        return cast("type[PreTrainedModel]", model_class)._from_config(config, dtype=dtype, **extra)


def load_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, device: str) -> None:
    """Fill each rank's shards from rank 0's full state dict, one tensor at a time (PyTorch's
    ``broadcast_from_rank0``), then the non-persistent buffers, which no state dict carries
    (rotary ``inv_freq``: meta on the other ranks, and recomputing them needs each model's code)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for module in model.modules():
        for leaf, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[leaf] = torch.empty_like(buf, device=device)
    set_model_state_dict(
        model,
        # torch types the state dict as a dict (invariant) of its ValueType union; a dict of tensors is one.
        full_state or {},  # type: ignore[arg-type]
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    for module in model.modules():
        for leaf in sorted(module._non_persistent_buffers_set):
            buf = module._buffers.get(leaf)
            if buf is not None:
                dist.broadcast(buf, src=0)


def save_pretrained_full(model: PreTrainedModel, save_directory: str, **kwargs: Any) -> None:
    """Gather the full state dict on rank 0 (in CPU memory) and write it with ``save_pretrained``
    (safetensors, mode ``0o666 & ~umask`` like the other files), loadable by ``from_pretrained`` in
    one process. Call it on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        original = type(model)
        # FSDP2 swaps the class for a generated `FSDP<Class>`: save under the model's own class name.
        model.__class__ = next(c for c in original.__mro__ if not c.__name__.startswith("FSDP"))
        try:
            # safetensors writes its files mode 0600: they get the umask's mode, like config.json (see files.py).
            with weights_follow_umask(save_directory):
                model.save_pretrained(save_directory, state_dict=state, safe_serialization=True, **kwargs)
        finally:
            model.__class__ = original
    dist.barrier()
