"""What estimate_memory refuses before tracing: bad arguments, a model without blocks, and the
chunked loss on a head it does not reproduce (checked on a one-block copy with random weights)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from ...policy import LossConfig
from ...transforms.loss_head.apply import check_loss_head
from ..model.config import TASKS, build_model
from . import build_cache
from .depth import blocks_of_every_kind, text_config, with_depth
from .weights_dtype import parse_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def check_arguments(
    *, batch_size: object, seq_len: object, world_size: object, optimizer: object, task: object, dtype: object
) -> None:
    """The plain arguments of :func:`estimate_memory`, refused before any work."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r} is not one of 'adamw', 'sgd'")
    if task is not None and task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {', '.join(map(repr, TASKS))}")
    parse_dtype(dtype)


def check_label_fraction(label_fraction: object) -> None:
    """``label_fraction``: the share of positions with a label (a prompt-masked dataset's), in (0, 1]."""
    if not isinstance(label_fraction, (int, float)) or isinstance(label_fraction, bool) or not 0 < label_fraction <= 1:
        raise ValueError(
            f"label_fraction={label_fraction!r} must be a number in (0, 1]: the share of token positions with a label "
            "other than -100 (1.0, the default, when every position carries loss; 0.5 when prompts take half the tokens)"
        )


def check_mode(mode: object, eval_samples: object) -> None:
    if mode not in ("train", "eval"):
        raise ValueError(
            f"mode={mode!r} is not one of 'train' (a training step), 'eval' (an evaluation forward and the "
            "logits Trainer.evaluate keeps)"
        )
    if eval_samples is None:
        return
    if not isinstance(eval_samples, int) or isinstance(eval_samples, bool) or eval_samples <= 0:
        raise ValueError(
            f"eval_samples={eval_samples!r} must be a positive integer (the evaluation set's size, len(eval_dataset))"
        )
    if mode != "eval":
        raise ValueError(
            f"eval_samples={eval_samples} is only used with mode='eval' (mode={mode!r}); pass mode='eval' to "
            "estimate evaluation, or drop eval_samples"
        )


def check_depth(config: PretrainedConfig) -> None:
    """A config without blocks builds (embeddings and a head) and would be estimated as that: refused."""
    layers = getattr(text_config(config), "num_hidden_layers", None)
    if isinstance(layers, int) and not isinstance(layers, bool) and layers <= 0:
        raise ValueError(
            f"model= a {type(config).__name__} with num_hidden_layers={layers}: a model without blocks, which no "
            "checkpoint is; set num_hidden_layers to the model's number of layers (config.json's num_hidden_layers)"
        )


# Past this many parameters (one block kept), the chunked loss is not compared with the model's own here.
_LOSS_CHECK_MAX_PARAMETERS = 32 * 2**20  # building more costs seconds on a CPU


_LOSS_VERDICTS: dict[tuple[str, str, str], tuple[str | None, str | None]] = {}


def chunked_loss_problem(config: PretrainedConfig, task: str, *, trust_remote_code: bool = False) -> str | None:
    """Why ``prepare_model`` would refuse ``loss:chunked`` on the model of ``config`` for ``task``, or None.

    The estimator's model has no values (fake tensors), so ``prepare_model`` cannot run the part of
    its check that compares the chunked loss with the model's own on a few tokens (BERT's LM head
    transforms the hidden states before the output layer, which the chunked loss skips). This runs
    that same check (:func:`hf_memstack.transforms.loss_head.apply.check_loss_head`) on the same architecture with one
    block and random weights - when that is small enough; otherwise the estimate says it was not checked.
    """
    return chunked_loss_verdict(config, task, trust_remote_code)[0]


def chunked_loss_verdict(config: PretrainedConfig, task: str, trust_remote_code: bool) -> tuple[str | None, str | None]:
    """(the refusal, a note), computed once per config and task."""
    key = (type(config).__qualname__, config.to_json_string(use_diff=False), task)
    if key not in _LOSS_VERDICTS:
        if len(_LOSS_VERDICTS) > 64:
            _LOSS_VERDICTS.clear()
        _LOSS_VERDICTS[key] = _check_chunked_loss(config, task, trust_remote_code)
    return _LOSS_VERDICTS[key]


def block_kinds(config: PretrainedConfig, task: str, trust_remote_code: bool = False) -> int:
    """:func:`~.depth.blocks_of_every_kind` read from the full model's blocks, built on meta (no bytes,
    but each block's build takes time), once per config and task: the chunked-loss check and the
    planner's 4-bit check both cut their copies to it."""

    def count() -> int:
        with torch.device("meta"):
            return blocks_of_every_kind(config, build_model(config, task, trust_remote_code=trust_remote_code))

    return build_cache.cached("block_kinds", (*build_cache.config_key(config), task, trust_remote_code), count)


def _check_chunked_loss(config: PretrainedConfig, task: str, trust_remote_code: bool) -> tuple[str | None, str | None]:

    # What happens between the backbone and the output head does not depend on the depth: the fewest
    # blocks that hold every kind of block the model has (one, unless its layers differ).
    if task == "seq2seq-lm":
        # An encoder-decoder's head is refused by its class (no values needed): the whole model on meta.
        with torch.device("meta"):
            model = build_model(config, task, trust_remote_code=trust_remote_code)
        try:
            check_loss_head(model, LossConfig(mode="chunked"))
        except ValueError as e:
            return f"{e} (estimate_memory refuses what prepare_model refuses)", None
        raise AssertionError("loss:chunked accepted on an encoder-decoder")  # check_loss_head refuses every one
    layers = getattr(text_config(config), "num_hidden_layers", None)
    try:
        multi = isinstance(layers, int) and layers > 1
        small = with_depth(config, block_kinds(config, task, trust_remote_code)) if multi else copy.deepcopy(config)
        with torch.device("meta"):
            shape = build_model(small, task, trust_remote_code=trust_remote_code)
    except ValueError:
        return None, None  # the full model's build (next) says what is wrong with the config
    if sum(p.numel() for p in shape.parameters()) > _LOSS_CHECK_MAX_PARAMETERS:
        return None, (
            "loss:chunked was not compared with the model's own loss here (too large to build for that check); "
            "prepare_model compares them on the real weights before training"
        )
    del shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        real = build_model(small, task, trust_remote_code=trust_remote_code)
    try:
        check_loss_head(real, LossConfig(mode="chunked"))
    except ValueError as e:
        return f"{e} (estimate_memory refuses what prepare_model refuses)", None
    return None, None


def check_loop(mode: str, eval_samples: int | None, label_fraction: float, keep_outputs: object) -> None:
    """The arguments that say what the step runs: train or eval, labelled share, outputs kept."""
    check_mode(mode, eval_samples)
    check_label_fraction(label_fraction)
    _check_keep_outputs(keep_outputs, mode)


def _check_keep_outputs(keep_outputs: object, mode: str) -> None:
    if not isinstance(keep_outputs, bool):
        raise TypeError(f"keep_outputs={keep_outputs!r} must be True or False (whether the loop keeps `outputs`)")
    if keep_outputs and mode != "train":
        raise ValueError(
            f"keep_outputs=True with mode={mode!r}: it counts a training loop holding its outputs through the "
            "backward; evaluation counts the logits Trainer keeps (eval_logits_bytes): drop keep_outputs"
        )
