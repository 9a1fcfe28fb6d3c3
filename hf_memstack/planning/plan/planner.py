"""plan_policy: walk the ladder, cheapest rung first, and return the first policy whose estimated
peak fits the budget with a margin - with the table of every rung considered."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Literal

from ...sizes import parse_bytes
from ...transforms.blocks import Blocks, find_blocks
from ...transforms.precision.apply import resolve_precision
from ...transforms.quant.apply import quantizable
from ...transforms.tiled_mlp import auto_tile_tokens
from ..estimate.checks import block_kinds, check_label_fraction, chunked_loss_problem
from ..estimate.depth import num_layers, with_depth
from ..estimate.trainable import Trainable, peft_config_from
from ..estimate.weights_dtype import WeightsDtype, parse_dtype, resolve_weights_dtype
from ..model.config import ModelSource, infer_task, load_config
from ..model.fake import meta_model
from ..model.vision_inputs import images_for
from .advice import suggestions
from .estimates import Estimates
from .head_speed import add_chunked_for_speed, chunked_loss_speed, head_share, speed_note
from .result import Plan, PlanRow
from .rungs import Requirement, RungContext, rungs_for
from .screen import num_blocks
from .sequence_rungs import sp_context
from .walk import walk_rungs

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["Plan", "PlanRow", "plan_policy"]


def plan_policy(
    model: ModelSource,
    *,
    budget: int | str,
    seq_len: int,
    batch_size: int | Literal["max"] = 1,
    world_size: int = 1,
    margin: float = 0.1,
    task: str | None = None,
    device: str | None = None,
    trainable: Trainable = "all",
    step_in_backward: bool = True,
    dtype: torch.dtype | str | None = "auto",
    packed: bool = False,
    label_fraction: float = 1.0,
    keep_outputs: bool = False,
    image_size: int | None = None,
    images_per_sample: int | None = None,
) -> Plan:
    """The cheapest rung of the ladder whose estimated peak fits ``budget`` with ``margin``: plain
    mixed precision, then the chunked loss head (causal LMs), selective then block checkpointing,
    sequence parallelism (several ranks, activations over one device), 4-bit base weights (LoRA runs,
    where torchao is installed), the optimizer rungs (stepped in the
    backward, 8-bit moments where torchao is installed, both), offload, FSDP (see
    :data:`hf_memstack.planning.plan.rungs.STEPS`).

    Args:
        model: hub id (local cache), local directory, config or model.
        budget: per-device memory, bytes or ``"80GiB"``.
        seq_len: tokens per sample.
        batch_size: per-device batch, or ``"max"``: the largest batch each rung fits (the first rung
            that fits at least one sample is chosen, at its largest batch, whose own estimate fits).
        world_size: devices; FSDP rungs are considered when > 1, and sequence parallelism (``sp:N``, N
            dividing it and the attention heads) where the activations at ``seq_len`` do not fit one
            device with every activation rung (:mod:`hf_memstack.planning.plan.sequence_rungs`).
        margin: fraction of the budget kept free (allocator fragmentation, the CUDA context).
        task: ``causal-lm``, ``seq2seq-lm`` or ``classification``; default: from the model (see :func:`estimate_memory`).
        device: where it will train (``cuda``/``cpu``; default: this machine) - picks bf16, fp16 or fp32
            (``cuda`` on a machine without a GPU: bf16).
        trainable: what trains, as for :func:`estimate_memory` (``"all"``, ``"lora"``, a PEFT config, a dict);
            anything but ``"all"`` is a LoRA run, offered the 4-bit base weights rung (``quant:nf4``).
        step_in_backward: whether the optimizer may step inside the backward (``optim:in_backward``
            rungs); pass False when the training loop accumulates gradients, clips them by their
            global norm or averages them with DDP, none of which that rung can do.
        dtype: the weights' dtype, as for :func:`estimate_memory` (default ``"auto"``: what
            ``from_pretrained`` gives); every rung is estimated at it.
        packed: rows of ``seq_len`` tokens packed with several samples (see :func:`estimate_memory`).
        label_fraction: the share of positions with a label, as for :func:`estimate_memory` (default 1.0);
            the chunked loss rungs' relative speed is scaled by it too (their head runs over those
            positions only: :mod:`hf_memstack.planning.plan.head_speed`), and the table says so.
            Below 1, a causal LM whose plan fits without ``loss:chunked`` gets it added when its
            head is predicted faster by ``head_speed.FASTER_BY`` or more (unless ``keep_outputs``):
            ``Plan.chunked_for_speed`` says why.
        keep_outputs: the training loop keeps the model's outputs through the backward
            (``outputs = model(**batch); outputs.loss.backward()``): every rung counts them, as
            :func:`estimate_memory` does (default False: Trainer's and the recipe's loop, which drop them).
        image_size, images_per_sample: a vision-language model's images (see :func:`estimate_memory`).

    Returns:
        :class:`Plan`. When nothing fits: the shortfall, and what would (more ranks, shorter
        sequences, a smaller batch with gradient accumulation).
    """
    budget_bytes = _check_plan_args(budget, margin, batch_size)
    usable = budget_bytes * (1 - margin)
    parse_dtype(dtype)  # a bad dtype= is refused before any work
    check_label_fraction(label_fraction)
    config = load_config(model)
    task = task or infer_task(model, config)
    images = images_for(config, image_size, images_per_sample, seq_len, task)  # refused before any rung is traced
    # Resolved once from what was given (the estimates below get its config, which no longer says
    # where its weights are): every rung counts the same weights.
    weights = resolve_weights_dtype(model, config, dtype)
    precision = _planned_precision(device, weights.dtype, trainable)
    est = Estimates(
        config,
        seq_len=seq_len,
        world_size=world_size,
        task=task,
        trainable=trainable,
        dtype=weights.dtype,
        packed=packed,
        device=device,
        label_fraction=label_fraction,
        keep_outputs=keep_outputs,
        image_size=image_size,
        images_per_sample=images_per_sample,
    )
    plan = Plan(
        policy=None,
        batch_size=0 if batch_size == "max" else batch_size,
        budget=budget_bytes,
        weights_dtype=weights.name,
        weights_dtype_source=weights.source,
        usable_bytes=int(usable),
        images=images.note() if images is not None else "",
    )
    context = _ladder(config, task, precision, seq_len, batch_size, world_size, trainable, step_in_backward, weights)
    context, plan.head_speed = _labelled_head(context, config, task, seq_len, weights, label_fraction)
    context = sp_context(context, config, est, task=task, world_size=world_size, batch_size=batch_size, usable=usable)
    shortfalls = walk_rungs(plan, est, rungs_for(context), batch_size, usable)
    if plan.fits:
        add_chunked_for_speed(
            plan,
            est,
            context,
            label_fraction=label_fraction,
            keep_outputs=keep_outputs,
            batch_size=batch_size,
            usable=usable,
        )
        return plan
    plan.shortfall_bytes = max(0, min(shortfalls))
    closest = min(plan.rows, key=lambda r: r.peak_bytes).policy if plan.rows else f"{precision}+ckpt"
    # More ranks are advised with the ladder's own FSDP rung (its heaviest activation rungs kept:
    # the chunked loss, every block checkpointed), not the closest rung's activations - the rows
    # bounded by their weights alone all read alike, and the first of them checkpoints nothing.
    several = dataclasses.replace(context, satisfied=context.satisfied | {Requirement.SEVERAL_DEVICES})
    sharded = next(r.policy for r in rungs_for(several) if r.step == "fsdp")
    plan.suggestions = suggestions(
        est, closest, batch_size, seq_len, world_size, usable, trainable=trainable, sharded=sharded
    )
    return plan


def _check_plan_args(budget: int | str, margin: float, batch_size: object) -> int:
    """The budget in bytes, once ``margin`` and ``batch_size`` are known to be usable."""
    budget_bytes = parse_bytes(budget, field="budget")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r} must be a number in [0, 1), e.g. 0.1 (10% of the budget kept free)")
    if batch_size != "max" and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer or 'max'")
    return budget_bytes


def _planned_precision(device: str | None, weights_dtype: torch.dtype, trainable: Trainable) -> str:
    """The mixed precision the run would get on ``device`` (default: this machine)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Planning a GPU run on a machine without one (a laptop, a CPU login node): bf16, as every GPU since Ampere runs.
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "bf16"
    name = resolve_precision("auto", device).name
    # fp32 (a CPU without native bf16) over a 16-bit full fine-tune is plain AdamW over the 16-bit
    # weights - prepare_model leaves them as loaded without autocast - and updates below their
    # resolution are lost. bf16 makes fp32 master weights (or pure bf16 with stochastic rounding):
    # slower on such a CPU, but it trains.
    if name == "fp32" and trainable == "all" and weights_dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return name


def _ladder(
    config: PretrainedConfig,
    task: str,
    precision: str,
    seq_len: int,
    batch_size: int | Literal["max"],
    world_size: int,
    trainable: Trainable,
    step_in_backward: bool,
    weights: WeightsDtype,
) -> RungContext:
    """What the memory rungs this model and job can take depend on (:func:`rungs_for` lists them)."""
    # The chunked-loss rungs only where prepare_model would accept loss:chunked (not BERT's LM head).
    chunked = task == "causal-lm" and chunked_loss_problem(config, task) is None
    torchao = importlib.util.find_spec("torchao") is not None
    # 4-bit base weights only where prepare_model would take them: not over GPT-2's Conv1D or a
    # mixture-of-experts router (read on the LoRA model built on meta, which the traces reuse).
    four_bit = torchao and not _trains_all(trainable) and quantizable(_meta_blocks(config, task, trainable, weights))
    tokens = seq_len * (1 if batch_size == "max" else int(batch_size))
    facts = {
        Requirement.CAUSAL_LM: chunked,
        Requirement.TORCHAO: torchao,
        Requirement.LORA_WITH_TORCHAO: four_bit,
        Requirement.STEP_IN_BACKWARD: step_in_backward,
        Requirement.TOKENS_OVER_ONE_TILE: _tiles_help(config, tokens),
        Requirement.FULL_FINETUNE: _trains_all(trainable),
        Requirement.SEVERAL_DEVICES: world_size > 1,
    }
    satisfied = frozenset(r for r, holds in facts.items() if holds)
    return RungContext(precision, num_blocks(config), satisfied)


def _labelled_head(
    context: RungContext,
    config: PretrainedConfig,
    task: str,
    seq_len: int,
    weights: WeightsDtype,
    label_fraction: float,
) -> tuple[RungContext, str]:
    """``context`` with the chunked loss rungs' speed at ``label_fraction`` (their head runs over the
    labelled positions only: :mod:`hf_memstack.planning.plan.head_speed`), and the plan's line on it."""
    if Requirement.CAUSAL_LM not in context.satisfied:
        return context, ""
    share = head_share(config, task=task, dtype=weights.dtype, seq_len=seq_len)
    speed = chunked_loss_speed(share, label_fraction)
    return dataclasses.replace(context, chunked_loss_speed=speed), speed_note(share, label_fraction)


def _meta_blocks(config: PretrainedConfig, task: str, trainable: Trainable, weights: WeightsDtype) -> Blocks | None:
    """The blocks of the LoRA model built on meta, cut to a block of each kind: what they hold is the
    deep model's (building the whole deep model with its adapters would be a large part of a plan's time)."""
    layers = num_layers(config)
    # At least 2: one block is no stack to find_blocks.
    shallow = with_depth(config, max(2, block_kinds(config, task))) if layers and layers > 2 else config
    net = meta_model(shallow, task, peft_config_from(trainable), False, weights, copy=False)  # only read
    try:
        return find_blocks(net)
    except ValueError:
        return None


def _trains_all(trainable: object) -> bool:
    return isinstance(trainable, str) and trainable == "all"


def _tiles_help(config: PretrainedConfig, tokens: int) -> bool:
    """A step's tokens span more than one MLP tile (the mlp:tiled rung then saves memory)."""

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0)
    experts = any(getattr(text, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    return bool(hidden) and not experts and tokens > auto_tile_tokens(hidden)
