"""apply_checkpointing: activation checkpointing through the model's own Transformers API, or
PyTorch's checkpoint wrapper around the repeated blocks when the model has none."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._device import device_of
from .blocks import Blocks
from .policy import CheckpointingConfig

__all__ = ["apply_checkpointing", "uses_transformers_checkpointing"]


def uses_transformers_checkpointing(model: nn.Module, cfg: CheckpointingConfig) -> bool:
    """True when the model's own Transformers API can apply ``cfg`` (else the PyTorch wrapper is used)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    if cfg.block_classes is not None:
        return False  # an explicit block override is honoured with the wrapper
    if hasattr(model, "activation_checkpointing_enable"):
        return True
    # transformers < 5 has only `gradient_checkpointing_enable`, without every_n_layers / offload.
    return hasattr(model, "gradient_checkpointing_enable") and cfg.mode == "full"


def apply_checkpointing(model: nn.Module, cfg: CheckpointingConfig, *, blocks: Blocks | None) -> dict[str, Any]:
    """Enable activation checkpointing on ``model`` in place.

    Transformers models use ``activation_checkpointing_enable`` (5.x; ``gradient_checkpointing_enable``
    on older versions), which also disables the KV cache in checkpointed layers and makes the input
    embeddings' output require grad (frozen embeddings / PEFT). Other models get PyTorch's
    non-reentrant ``checkpoint_wrapper`` around each block (``blocks`` must then be given).

    Returns a record: ``method`` (``transformers`` / ``torch-wrapper``), ``checkpointed`` (block indices).
    """
    if cfg.mode == "none":
        return {"method": "none", "checkpointed": [], "note": ""}
    every_n = cfg.every_n if cfg.mode == "every_n" else 1
    offload = cfg.mode == "offload"
    note = ""
    if offload and device_of(model).type == "cpu":
        # The saved inputs already live in host memory; Transformers 5.24 would still ask for pinned
        # memory and fail on a host without an accelerator. Full checkpointing is the same thing here.
        offload = False
        note = "offload skipped: the model is on the CPU, its activations are already in host memory"
    ckpt_kwargs = {"use_reentrant": cfg.use_reentrant}

    if uses_transformers_checkpointing(model, cfg):
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=ckpt_kwargs, every_n_layers=every_n, offload=offload
            )
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
        n = len(blocks) if blocks is not None else 0
        return {"method": "transformers", "checkpointed": [i for i in range(n) if i % every_n == 0], "note": note}

    if blocks is None:
        raise ValueError("apply_checkpointing needs the model's blocks for the PyTorch wrapper fallback")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    checkpoint_fn = _offloaded_checkpoint if offload else checkpoint
    checkpointed = []
    for i, (name, block) in enumerate(zip(blocks.names, blocks.modules)):
        # Same choice as Transformers' every_n_layers: blocks 0, n, 2n, ...
        if i % every_n:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn, **ckpt_kwargs))
        checkpointed.append(i)
    if cfg.use_reentrant and hasattr(model, "enable_input_require_grads"):
        # Reentrant checkpointing drops gradients when no input of the block requires grad.
        model.enable_input_require_grads()
    return {"method": "torch-wrapper", "checkpointed": checkpointed, "note": note}


def _offloaded_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Checkpoint whose saved block inputs live in (pinned, when a GPU exists) host memory."""
    pin = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "pin_memory requires a GPU" on CPU-only hosts
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return checkpoint(function, *args, **kwargs)

