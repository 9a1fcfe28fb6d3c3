"""estimate_memory: how much memory a training step will take, where it goes, and which phase
holds the peak - from a config alone, without downloading or materialising any weights.

The model is built from its config under PyTorch's ``FakeTensorMode`` (tensors with shapes and
dtypes but no storage), the memory policy is applied with :func:`prepare_model`, and the memory
meter traces one real Transformers forward, backward and optimizer step on fake data. So the
estimate counts exactly what the meter measures - frozen parameters, tied embeddings, the logits
of large vocabularies - for any architecture Transformers can build. Two things are not traced
and are accounted for separately: torch.compile (estimated as its eager policy: compile usually
lowers the peak a little) and FSDP over ``world_size`` ranks (each part of each traced phase as one
rank holds it - sharded model states, gathered parameters: :mod:`hf_memstack.planning.estimate.fsdp_shards`).

A deep stack of identical blocks is traced at two shallow depths and extrapolated, phase by phase
(:mod:`hf_memstack.planning.estimate.depth`): seconds for a 7B or 70B config, and every field equal to the full
trace's, which ``extrapolate=False`` runs.

``mode="eval"`` estimates evaluation instead: one forward under ``torch.no_grad()`` in eval mode, as
``Trainer.prediction_step`` runs it, and the logits ``Trainer.evaluate()`` keeps across the eval set
(:mod:`hf_memstack.planning.estimate.eval_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...measure.memory import StepMemory, step_memory_of
from ...policy import MemoryPolicy
from ..model.config import SEQ2SEQ_NOTE, ModelSource, check_seq_len, infer_task, load_config, task_note
from ..model.fake import quant_notes
from ..model.vision_inputs import images_for
from .accounting import dtype_note, per_rank, with_kept_logits
from .checks import (
    check_arguments,
    check_depth,
    check_loop,
    chunked_loss_verdict,
)
from .depth import FULL_TRACE_ASKED, DepthPlan, FullTrace, extrapolate_line, extrapolate_phases, num_layers, with_depth
from .fsdp_shards import FsdpShards, fsdp_shards
from .result import MemoryEstimate
from .sequence_shards import sequence_shards, sp_world, with_sequence_shards
from .trace import Job, Traced, depth_plan, trace
from .trainable import Trainable, peft_config_from, policy_of, what_trains
from .weights_dtype import FourBitLayers, WeightsDtype, four_bit_layers, resolve_weights_dtype, short_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..model.vision_inputs import ImageSpec

__all__ = ["estimate_memory"]


def estimate_memory(
    model: ModelSource,
    policy: MemoryPolicy | str | dict[str, Any] | None = None,
    *,
    batch_size: int,
    seq_len: int,
    world_size: int = 1,
    optimizer: str = "adamw",
    trainable: Trainable = "all",
    task: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str | None = "auto",
    packed: bool = False,
    extrapolate: bool = True,
    mode: str = "train",
    eval_samples: int | None = None,
    device: str | None = None,
    label_fraction: float = 1.0,
    keep_outputs: bool = False,
    image_size: int | None = None,
    images_per_sample: int | None = None,
) -> MemoryEstimate:
    """Estimate one training step's peak memory per rank, by category (or, with ``mode="eval"``, one
    evaluation forward's and the logits Trainer keeps).

    Args:
        model: a hub id (from the local cache), a local directory, a config, a config dict with its
            ``model_type`` (``config.to_dict()``), or a model (its config is used).
        policy: the memory policy (string, dict, :class:`MemoryPolicy`); default: a prepared model's
            own (``model.memstack``), else ``fp32``.
        batch_size: per-device micro-batch size.
        seq_len: tokens per sample.
        world_size: ranks sharing the model under an FSDP policy.
        optimizer: ``adamw`` (as ``policy.optimizer`` says: fp32 or 8-bit moments, stepped after or in
            the backward - built by :func:`hf_memstack.make_optimizer`) or ``sgd`` (no state).
        trainable: what trains: ``"all"``; ``"lora"`` (LoRA r=8, alpha=16 on every linear layer
            but the output head); a PEFT config (e.g. ``LoraConfig(...)``); or a dict of
            ``LoraConfig`` fields (``{"r": 16, "target_modules": ["q_proj", "v_proj"]}``). Frozen
            parameters count as parameters, with no gradient and no optimizer state.
        task: ``causal-lm``, ``seq2seq-lm`` or ``classification`` (which head the config gets); default:
            from the model given (its class, or its config's ``architectures``); an encoder without a
            causal-LM head (``BertModel``) is ``classification`` (said in the notes); an encoder-decoder's
            ``*ForConditionalGeneration`` (T5, BART) is ``seq2seq-lm`` (labels as long as the inputs);
            else ``causal-lm``.
        dtype: the weights' dtype: ``"auto"`` (default) counts what ``from_pretrained(model)`` gives
            (the config's ``dtype``/``torch_dtype``, else the saved weights' own; fp32 for a config
            naming none), a model object at its parameters' dtypes; or ``"bf16"``, ``"fp16"``,
            ``"fp32"`` (or a torch dtype) to count another load. Frozen weights count at it;
            trainable ones as ``prepare_model`` leaves them (it keeps their dtype). The estimate
            says which it used (``weights_dtype``).
        packed: each row of ``seq_len`` tokens holds several samples (``position_ids`` restarting, as
            :class:`hf_memstack.data.PackedCollator` makes them). SDPA and eager attention then build a
            dense ``[batch, 1, seq_len, seq_len]`` mask, which is counted; unpacked batches build none.
            Under ``sp:N`` each sample of the whole rows runs alone after the all-to-all, one across the
            shard boundary included (:mod:`hf_memstack.planning.estimate.sequence_shards`).
        extrapolate: trace a few of the model's blocks and extrapolate the identical rest (seconds at
            any depth, equal to the full trace: see :mod:`hf_memstack.planning.estimate.depth`); a stack whose blocks
            differ is traced in full, as is every one with ``extrapolate=False``.
        mode: ``"train"`` (default) or ``"eval"``: one forward of a ``batch_size`` eval batch under
            ``torch.no_grad()`` with the model in eval mode and the policy applied (its precision;
            checkpointing does nothing without gradients), as ``Trainer.prediction_step`` runs it; no
            gradients or optimizer state (``optimizer`` is not used). Extrapolated across depth as
            training is. The estimate also counts the outputs Trainer keeps (``eval_logits_bytes``).
        eval_samples: eval mode only: the evaluation set's size, for ``eval_logits_bytes`` (default:
            ``batch_size``, one batch's).
        device: where the step will run, ``"cuda"`` or ``"cpu"`` (default: this machine's GPU if it
            has one). It decides how PyTorch's AdamW steps: on CUDA with its foreach kernels, which
            hold one more copy of the second moments (4 bytes per trainable fp32 parameter) while
            they step, on the CPU parameter by parameter.
        label_fraction: the share of token positions with a label (not -100): ``loss:chunked`` runs
            its head over those only, so a prompt-masked dataset's head holds that share of a full
            one's. Default 1.0 (every position), so nothing is promised that the data does not give.
        keep_outputs: the training loop keeps the model's outputs through the backward
            (``outputs = model(**batch); outputs.loss.backward()``, Transformers' docs, or
            ``out = model(x); loss = criterion(out, y); loss.backward()``): under a mixed precision
            they hold the logits in fp32 (``batch x seq x vocab x 4`` bytes), alive through the
            backward and the optimizer step, and the previous step's through the next forward.
            Default False: the loop that drops them once the loss is taken (Trainer, the recipe).
            ``kept_outputs_bytes`` says what they add.
        image_size: a vision-language model (Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT, Gemma-3, Idefics3,
            SmolVLM, Mllama): pixels a side of each image given to its processor, which makes the pixel
            tensors and image tokens from it as the family does (default: the family's, from the config:
            the vision tower's ``image_size``; 448 for Qwen2-VL). Said in the notes.
        images_per_sample: a vision-language model: images in each sample (default 1; 0: text only).
            Their image tokens are part of ``seq_len``.

    Raises:
        ValueError: bad sizes, an unknown model, a PEFT config that matches no module, or a
            policy the model cannot use - what ``prepare_model`` would refuse on the real model,
            also ``loss:chunked`` on a head it does not reproduce (checked on a one-block copy
            with random weights when that is small; the notes say when it was not checked).
        TypeError: ``model``, ``trainable`` or ``dtype`` of a type that is none of the above.
    """
    check_arguments(
        batch_size=batch_size, seq_len=seq_len, world_size=world_size, optimizer=optimizer, task=task, dtype=dtype
    )
    check_loop(mode, eval_samples, label_fraction, keep_outputs)
    foreach = _steps_foreach(device)
    given = model
    model, trainable = what_trains(model, trainable)
    peft_config = peft_config_from(trainable)
    config = load_config(model, trust_remote_code=trust_remote_code)
    # A model object counts at its own parameters' dtypes (a PEFT model's names match the traced one's).
    weights = resolve_weights_dtype(given if isinstance(given, nn.Module) else model, config, dtype)
    inferred_note = task_note(model, config) if task is None else None
    task = task or infer_task(model, config)
    policy = MemoryPolicy.coerce(policy_of(given, policy))
    world_size = sp_world(policy, world_size)  # sp:N with world_size=1 (not given): its N ranks
    notes = _policy_notes(policy, optimizer, world_size, inferred_note)
    four_bit = _four_bit_of(given, notes)
    traced = _traced_policy(policy, four_bit)
    check_seq_len(config, seq_len, batch_size)
    images = images_for(config, image_size, images_per_sample, seq_len, task)
    notes += _input_notes(images, task)
    check_depth(config)
    notes += _chunked_loss_notes(policy, config, task, trust_remote_code)
    sp = sequence_shards(config, policy, batch_size, seq_len, task, mode, packed, weights.dtype)  # sp:N's shard
    job = Job(
        task=task,
        peft_config=peft_config,
        trust_remote_code=trust_remote_code,
        weights=weights,
        policy=traced,
        optimizer=optimizer,
        batch_size=batch_size,
        seq_len=sp.tokens if sp is not None else seq_len,  # one sp rank's tokens
        packed=packed and task == "causal-lm" and images is None,
        mode=mode,
        # A compiled run's attention cannot read the samples' lengths: its rows run whole.
        packed_per_sample=policy.compile.mode == "none",
        foreach=foreach,
        label_fraction=float(label_fraction),
        keep_outputs=keep_outputs,
        images=images,
        sharded=policy.fsdp.mode != "none" and world_size > 1,
        sp=sp,
    )
    layers, chunked = num_layers(config), policy.loss.mode == "chunked"
    shards = functools.partial(fsdp_shards, policy=policy, world=world_size, layers=layers, chunked_loss=chunked)
    m, net, counts = _traced_step(config, job, extrapolate, notes, shards)
    # The model's own 4-bit layers at their own bytes (bitsandbytes' layout differs from the traced NF4's).
    four_bit_delta, counts = _four_bit_counts(four_bit, counts)
    notes += quant_notes(counts, peft_config is not None)
    total_params, trainable_params = counts["total"], counts["trainable"]
    est = per_rank(
        m, net, policy, world_size, config, batch_size, seq_len, trainable_params, total_params, notes, model
    )
    if four_bit_delta and (policy.fsdp.mode == "none" or world_size == 1):
        est = _plus_parameters(est, four_bit_delta)
    if mode == "eval":
        est = with_kept_logits(est, counts, eval_samples or batch_size)
    est = with_sequence_shards(_with_trace_counts(est, counts, keep_outputs), sp, policy)
    return _with_weights_dtype(est, weights, net, policy, training=mode == "train")


def _input_notes(images: ImageSpec | None, task: str) -> list[str]:
    """What the notes say about the inputs: a VLM's images, an encoder-decoder's labels."""
    return ([images.note()] if images is not None else []) + ([SEQ2SEQ_NOTE] if task == "seq2seq-lm" else [])


def _four_bit_counts(four_bit: FourBitLayers | None, counts: dict[str, int]) -> tuple[int, dict[str, int]]:
    """The model's own 4-bit layers at their own bytes: how much they differ from the traced NF4's, and
    the counts with their bytes."""
    if four_bit is None:
        return 0, counts
    return four_bit.weights_bytes - counts.get("quant_bytes", 0), {**counts, "quant_bytes": four_bit.weights_bytes}


def _chunked_loss_notes(
    policy: MemoryPolicy, config: PretrainedConfig, task: str, trust_remote_code: bool
) -> list[str]:
    """``loss:chunked`` refused where ``prepare_model`` would refuse it; else what was checked, as notes."""
    if policy.loss.mode != "chunked":
        return []
    problem, note = chunked_loss_verdict(config, task, trust_remote_code)
    if problem is not None:
        raise ValueError(problem)
    return [note] if note else []


def _plus_parameters(est: MemoryEstimate, extra: int) -> MemoryEstimate:
    """``est`` with ``extra`` bytes of parameters, alive through the whole step."""
    return dataclasses.replace(
        est,
        parameters=est.parameters + extra,
        peak_bytes=est.peak_bytes + extra,
        forward_backward_peak=est.forward_backward_peak + extra,
    )


def _with_trace_counts(est: MemoryEstimate, counts: dict[str, int], keep_outputs: bool) -> MemoryEstimate:
    """The trace's per-block reading (the planner's floor) and the kept outputs, on the estimate."""
    return dataclasses.replace(
        est,
        activations_per_block=counts.get("saved_per_block", 0),
        blocks=counts.get("blocks", 0),
        keep_outputs=keep_outputs,
        kept_outputs_bytes=counts.get("kept_outputs", 0),
    )


def _four_bit_of(given: object, notes: list[str]) -> FourBitLayers | None:
    """A model object's 4-bit layers, to be traced 4-bit (torchao's NF4 on fake tensors; needs torchao)."""
    four_bit = four_bit_layers(given) if isinstance(given, nn.Module) else None
    if four_bit is not None and importlib.util.find_spec("torchao") is None:
        notes.append(
            f"{four_bit.layers} 4-bit layers are counted at the weights' dtype: tracing them 4-bit needs torchao "
            "(pip install 'hf_memstack[quant]')"
        )
        return None
    return four_bit


def _traced_policy(policy: MemoryPolicy, four_bit: FourBitLayers | None) -> MemoryPolicy:
    """The policy as traced: no compile, no FSDP, no sp:N (accounted for after); a model's 4-bit layers 4-bit."""
    # Sequence parallelism too: traced as one rank's tokens, its exchange added after (sequence_shards.py).
    fields = {
        **policy.to_dict(),
        "compile": {"mode": "none"},
        "fsdp": {"mode": "none"},
        "sequence_parallel": {"size": 1},
    }
    if four_bit is not None:
        fields["quant"] = {**fields.get("quant", {}), "mode": "nf4", "targets": list(four_bit.targets)}
    return MemoryPolicy.from_dict(fields)


def _steps_foreach(device: str | None) -> bool:
    """Whether PyTorch's AdamW steps with its foreach kernels there: its default on CUDA."""
    if device is None:
        return torch.cuda.is_available()
    if not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'cuda' or 'cpu' (where the step will run), or None: this machine")
    return device.startswith("cuda")


def _policy_notes(policy: MemoryPolicy, optimizer: str, world_size: int, inferred_note: str | None) -> list[str]:
    """The notes the policy and job call for before tracing (an sgd optimizer under an optimizer rung is refused)."""
    if optimizer == "sgd" and (policy.optimizer.state, policy.optimizer.step) != ("fp32", "after_backward"):
        raise ValueError(
            f"optimizer='sgd' with policy {policy.to_string()!r}: the policy's optimizer rung (optim:8bit, "
            "optim:in_backward) is an AdamW; use optimizer='adamw' or drop the optim: tokens"
        )
    notes = (
        [f"world_size={world_size} without FSDP: every rank holds the whole model (data parallel, or sp:N)"]
        if (policy.fsdp.mode == "none" and world_size > 1)
        else []
    )
    if inferred_note:
        notes.append(inferred_note)
    if policy.fsdp.mode != "none" and world_size == 1:
        notes.append(
            "an fsdp policy with world_size=1 shards nothing: pass world_size (--world-size) as the number of devices"
        )
    if policy.compile.mode != "none":
        notes.append("compile is estimated as eager: its fused kernels usually lower the peak a little")
        if policy.compile.mode == "full" and policy.loss.mode == "chunked":
            notes.append("compile:full runs the chunked head over every position, whatever label_fraction says")
    return notes


def _traced_step(
    config: PretrainedConfig,
    job: Job,
    extrapolate: bool,
    notes: list[str],
    shards_of: Callable[[nn.Module], FsdpShards | None],
) -> tuple[StepMemory, nn.Module, dict[str, int]]:
    """The step's memory on one rank, the traced model and its counts: one full trace, or two shallow
    ones extrapolated to the full depth (said in ``notes``). ``shards_of(net)``: how FSDP shards the
    traced model (None without FSDP), applied to each part of each phase before its peak is taken."""
    planned = depth_plan(config, job) if extrapolate else FULL_TRACE_ASKED
    depth = planned if isinstance(planned, DepthPlan) else None
    traced: dict[int, Traced] = {}

    def at(d: int) -> Traced:
        if d not in traced:
            with warnings.catch_warnings():
                # A shallow stack of every_n blocks checkpoints only its block 0 on purpose (one period of
                # the full depth's pattern): prepare_model's warning speaks of the traced copy, not the user's model.
                warnings.filterwarnings(
                    "ignore", message=r"policy\.checkpointing\.every_n=\d+ with \d+ blocks", category=UserWarning
                )
                traced[d] = trace(with_depth(config, d), job)
        return traced[d]

    # Two shallow traces, a period of blocks apart; every count on their line at the full depth. When
    # their parts cannot be matched (an unlike block 0 in a one-period trace), a period deeper.
    while depth is not None:
        lo, hi = at(depth.depths[0]), at(depth.depths[1])
        shards = shards_of(hi.net)
        phases = extrapolate_phases(lo.phases, hi.phases, depth, shards.per_rank if shards else None)
        if phases is not None:
            phases = shards.saved(phases) if shards else phases
            counts = {k: extrapolate_line((lo.counts[k], hi.counts[k]), depth.depths, depth.layers) for k in hi.counts}
            slope = (hi.phases.forward_activations - lo.phases.forward_activations) // depth.period
            counts["saved_per_block"] = max(0, slope - (shards.saved_copies_per_block() if shards else 0))
            counts["blocks"] = depth.layers
            notes.append(depth.note())
            return step_memory_of(phases), hi.net, counts
        depth = depth.deeper()
        if depth is None:
            planned = FullTrace("its block 0 differs from the others, and deeper traces would be slower")
    if isinstance(planned, FullTrace):
        notes.append(planned.note())
    full = trace(config, job)
    shards = shards_of(full.net)
    return step_memory_of(shards.phases(full.phases) if shards else full.phases), full.net, full.counts


def _with_weights_dtype(
    est: MemoryEstimate, weights: WeightsDtype, net: nn.Module, policy: MemoryPolicy, *, training: bool
) -> MemoryEstimate:
    """The estimate with the dtypes its weights were counted at."""
    # fp32 weights need no note (the fields say it); 16-bit ones say where the dtype came from and what it means.
    notes = (
        (*est.notes, dtype_note(weights, net, policy, training=training))
        if weights.dtype != torch.float32
        else est.notes
    )
    trainable_dtype = "/".join(
        sorted({short_name(p.dtype) for p in net.parameters() if p.requires_grad and p.is_floating_point()})
    )
    return dataclasses.replace(
        est,
        weights_dtype=weights.name,
        weights_dtype_source=weights.source,
        trainable_dtype=trainable_dtype or "none",
        notes=notes,
    )
