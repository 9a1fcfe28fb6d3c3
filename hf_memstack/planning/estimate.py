"""estimate_memory: how much memory a training step will take, where it goes, and which phase
holds the peak - from a config alone, without downloading or materialising any weights.

The model is built from its config under PyTorch's ``FakeTensorMode`` (tensors with shapes and
dtypes but no storage), the memory policy is applied with :func:`prepare_model`, and the memory
meter traces one real Transformers forward, backward and optimizer step on fake data. So the
estimate counts exactly what the meter measures - frozen parameters, tied embeddings, the logits
of large vocabularies - for any architecture Transformers can build. Two things are not traced
and are accounted for separately: torch.compile (estimated as its eager policy: compile usually
lowers the peak a little) and FSDP over ``world_size`` ranks (the traced model states are divided
by the ranks, plus one block's gathered parameters).

A deep stack of identical blocks is traced at two shallow depths and extrapolated, phase by phase
(:mod:`hf_memstack.planning.depth`): seconds for a 7B or 70B config, and every field equal to the full
trace's, which ``extrapolate=False`` runs.

``mode="eval"`` estimates evaluation instead: one forward under ``torch.no_grad()`` in eval mode, as
``Trainer.prediction_step`` runs it, and the logits ``Trainer.evaluate()`` keeps across the eval set
(:mod:`hf_memstack.planning.eval_logits`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.boundaries import packing_as_traced
from ..measure.accounting import tensor_bytes
from ..measure.memory import PhasePeaks, StepMemory, step_memory_of
from ..policy import MemoryPolicy
from ..sizes import format_bytes
from . import build_cache
from .depth import DepthPlan, _peft_picks_blocks, extrapolate_line, extrapolate_phases, plan_depths, with_depth
from .estimate_checks import check_arguments, check_depth, check_mode, chunked_loss_problem, chunked_loss_verdict
from .fake_model import (
    blocks_or_empty,
    build_fake_model,
    build_key,
    fake_batch,
    quant_counts,
    quant_notes,
    refuse_mixture_of_experts,
    traced_step,
)
from .model_config import build_model, check_seq_len, infer_task, load_config, task_note
from .trainable import DEFAULT_LORA, peft_config_from, what_trains
from .weights_dtype import WeightsDtype, resolve_weights_dtype, set_dtypes, short_name

__all__ = [
    "DEFAULT_LORA",
    "MemoryEstimate",
    "build_model",
    "check_seq_len",
    "chunked_loss_problem",
    "estimate_memory",
    "infer_task",
    "load_config",
    "peft_config_from",
    "task_note",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """The estimated peak of one training step (bytes, per rank), by category; with ``mode="eval"``,
    of one evaluation forward, plus the outputs ``Trainer.evaluate()`` keeps across the eval set.

    The five categories are what is alive *at the peak* and sum to ``peak_bytes`` (as the meter's
    ``StepMemory`` reports them), not each one's own maximum: a step that peaks in its forward +
    backward before any gradient exists (``optim:in_backward`` frees each gradient as it is made)
    reads ``gradients`` 0 B, and the optimizer state of the first step is counted where it is alive."""

    model: str
    """The model as given (path or id), or the config's name."""
    policy: str
    """The policy estimated, as a string."""
    batch_size: int
    seq_len: int
    world_size: int
    parameters: int
    """Parameters and buffers, frozen ones included (FSDP: this rank's shards plus one gathered block)."""
    gradients: int
    """Gradients of the trainable parameters."""
    optimizer: int
    """Optimizer state of the trainable parameters."""
    activations: int
    """Activations alive at the end of the forward (what the backward needs)."""
    temporaries: int
    """The rest of the peak: transient buffers, logits and their gradients at the peak."""
    peak_bytes: int
    """The step's estimated peak on one rank."""
    peak_phase: str
    """``forward+backward`` or ``optimizer``: where the step peaks (``forward`` in eval mode)."""
    forward_backward_peak: int
    """The peak of the forward + backward alone (grows about linearly with the batch)."""
    trainable_parameters: int
    total_parameters: int
    weights_dtype: str = "fp32"
    """The dtype the weights were counted at (``bf16``, ``fp16``, ``fp32``): what ``from_pretrained``
    gives (``dtype="auto"``), the model's own, or the ``dtype=`` asked for."""
    weights_dtype_source: str = ""
    """Where that dtype was read: ``the config's dtype``, ``the weights in model.safetensors``, ``requested``..."""
    trainable_dtype: str = "fp32"
    """The dtype the trainable parameters were counted at once the policy is applied: ``fp32`` under
    ``weights:fp32`` (``prepare_model`` casts 16-bit trainable weights to fp32 master weights under a
    mixed precision), ``bf16`` under ``weights:bf16``, ``none`` when nothing trains."""
    notes: tuple[str, ...] = ()
    mode: str = "train"
    """``train`` (one training step) or ``eval`` (one forward under ``torch.no_grad()`` in eval mode, as
    ``Trainer.prediction_step`` runs it: no gradients, no optimizer state, nothing saved for a backward, so
    ``activations`` is 0 and ``peak_phase`` is ``forward``)."""
    eval_samples: int = 0
    """Eval mode: the evaluation samples the kept outputs are counted for (0 in train mode)."""
    eval_logits_bytes: int = 0
    """Eval mode: the outputs Trainer keeps for ``eval_samples`` samples (the logits: samples x seq_len x
    vocab for a causal LM, x num_labels for classification, in the dtype the model returns them), on the
    device until evaluation ends unless ``eval_accumulation_steps`` moves them to host memory; none are kept
    with ``prediction_loss_only=True`` or ``evaluate()`` without ``compute_metrics``."""
    eval_logits_host_bytes: int = 0
    """Eval mode: the same outputs as the numpy arrays ``compute_metrics`` / ``predict()`` receive, in host
    memory (bf16 ones become fp32 there)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        cats = ", ".join(
            f"{k} {format_bytes(getattr(self, k))}"
            for k in ("parameters", "gradients", "optimizer", "activations", "temporaries")
        )
        if self.mode == "eval":
            return (
                f"{self.model} [{self.policy}] {self.weights_dtype} weights, eval batch {self.batch_size} x seq {self.seq_len}, "
                f"{self.world_size} rank(s): forward peak {format_bytes(self.peak_bytes)} ({cats}); logits kept by "
                f"Trainer.evaluate for {self.eval_samples} samples {format_bytes(self.eval_logits_bytes)} on the device "
                f"({format_bytes(self.eval_logits_host_bytes)} as numpy in host memory)"
            )
        return (
            f"{self.model} [{self.policy}] {self.weights_dtype} weights, batch {self.batch_size} x seq {self.seq_len}, "
            f"{self.world_size} rank(s): peak {format_bytes(self.peak_bytes)} in the {self.peak_phase} phase ({cats})"
        )


def estimate_memory(
    model: str | Path | Any,
    policy: MemoryPolicy | str | dict[str, Any] | None = None,
    *,
    batch_size: int,
    seq_len: int,
    world_size: int = 1,
    optimizer: str = "adamw",
    trainable: Any = "all",
    task: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype | str | None = "auto",
    packed: bool = False,
    extrapolate: bool = True,
    mode: str = "train",
    eval_samples: int | None = None,
) -> MemoryEstimate:
    """Estimate one training step's peak memory per rank, by category (or, with ``mode="eval"``, one
    evaluation forward's and the logits Trainer keeps).

    Args:
        model: a hub id (from the local cache), a local directory, a config, a config dict with its
            ``model_type`` (``config.to_dict()``), or a model (its config is used).
        policy: the memory policy (string, dict, :class:`MemoryPolicy`).
        batch_size: per-device micro-batch size.
        seq_len: tokens per sample.
        world_size: ranks sharing the model under an FSDP policy.
        optimizer: ``adamw`` (as ``policy.optimizer`` says: fp32 or 8-bit moments, stepped after or in
            the backward - built by :func:`hf_memstack.make_optimizer`) or ``sgd`` (no state).
        trainable: what trains: ``"all"``; ``"lora"`` (LoRA r=8, alpha=16 on every linear layer
            but the output head); a PEFT config (e.g. ``LoraConfig(...)``); or a dict of
            ``LoraConfig`` fields (``{"r": 16, "target_modules": ["q_proj", "v_proj"]}``). Frozen
            parameters count as parameters, with no gradient and no optimizer state.
        task: ``causal-lm`` or ``classification`` (which head the config gets); default: from the
            model given (its class, or its config's ``architectures``); an encoder without a
            causal-LM head (``BertModel``) is ``classification`` (said in the notes); else ``causal-lm``.
        dtype: the weights' dtype: ``"auto"`` (default) counts what ``from_pretrained(model)`` gives
            (the config's ``dtype``/``torch_dtype``, else the saved weights' own; fp32 for a config
            naming none), a model object at its parameters' dtypes; or ``"bf16"``, ``"fp16"``,
            ``"fp32"`` (or a torch dtype) to count another load. Frozen weights count at it;
            trainable ones as ``prepare_model`` leaves them (it keeps their dtype). The estimate
            says which it used (``weights_dtype``).
        packed: each row of ``seq_len`` tokens holds several samples (``position_ids`` restarting, as
            :class:`hf_memstack.data.PackedCollator` makes them). SDPA and eager attention then build a
            dense ``[batch, 1, seq_len, seq_len]`` mask, which is counted; unpacked batches build none.
        extrapolate: trace a few of the model's blocks and extrapolate the identical rest (seconds at
            any depth, equal to the full trace: see :mod:`hf_memstack.planning.depth`); a stack whose blocks
            differ is traced in full, as is every one with ``extrapolate=False``.
        mode: ``"train"`` (default) or ``"eval"``: one forward of a ``batch_size`` eval batch under
            ``torch.no_grad()`` with the model in eval mode and the policy applied (its precision;
            checkpointing does nothing without gradients), as ``Trainer.prediction_step`` runs it; no
            gradients or optimizer state (``optimizer`` is not used). Extrapolated across depth as
            training is. The estimate also counts the outputs Trainer keeps (``eval_logits_bytes``).
        eval_samples: eval mode only: the evaluation set's size, for ``eval_logits_bytes`` (default:
            ``batch_size``, one batch's).

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
    check_mode(mode, eval_samples)
    given = model
    model, trainable = what_trains(model, trainable)
    peft_config = peft_config_from(trainable)
    config = load_config(model, trust_remote_code=trust_remote_code)
    # A model object counts at its own parameters' dtypes (a PEFT model's names match the traced one's).
    weights = resolve_weights_dtype(given if isinstance(given, nn.Module) else model, config, dtype)
    inferred_note = task_note(model, config) if task is None else None
    task = task or infer_task(model, config)
    policy = MemoryPolicy.coerce(policy)
    if optimizer == "sgd" and (policy.optimizer.state, policy.optimizer.step) != ("fp32", "after_backward"):
        raise ValueError(
            f"optimizer='sgd' with policy {policy.to_string()!r}: the policy's optimizer rung (optim:8bit, "
            "optim:in_backward) is an AdamW; use optimizer='adamw' or drop the optim: tokens"
        )
    notes = (
        [f"world_size={world_size} without FSDP: every rank holds the whole model (data parallel)"]
        if (policy.fsdp.mode == "none" and world_size > 1)
        else []
    )
    if inferred_note:
        notes.append(inferred_note)
    if policy.fsdp.mode != "none" and world_size == 1:
        notes.append(
            "an fsdp policy with world_size=1 shards nothing: pass world_size (--world-size) as the number of devices"
        )
    traced = MemoryPolicy.from_dict({**policy.to_dict(), "compile": {"mode": "none"}, "fsdp": {"mode": "none"}})
    if policy.compile.mode != "none":
        notes.append("compile is estimated as eager: its fused kernels usually lower the peak a little")
    check_seq_len(config, seq_len)
    check_depth(config)
    if policy.loss.mode == "chunked":
        problem, note = chunked_loss_verdict(config, task, trust_remote_code)
        if problem is not None:
            raise ValueError(problem)
        notes += [note] if note else []

    job = _Job(
        task=task,
        peft_config=peft_config,
        trust_remote_code=trust_remote_code,
        weights=weights,
        policy=traced,
        optimizer=optimizer,
        batch_size=batch_size,
        seq_len=seq_len,
        packed=packed and task == "causal-lm",
        mode=mode,
    )
    depth = _depth_plan(config, job) if extrapolate else None
    if depth is None:
        full = _trace(config, job)
        m, net, counts = step_memory_of(full.phases), full.net, full.counts
    else:
        # Two shallow traces, a period of blocks apart; every count on their line at the full depth.
        lo, hi = (_trace(with_depth(config, d), job) for d in depth.depths)
        m, net = step_memory_of(extrapolate_phases(lo.phases, hi.phases, depth)), hi.net
        counts = {k: extrapolate_line((lo.counts[k], hi.counts[k]), depth.depths, depth.layers) for k in hi.counts}
        notes.append(depth.note())
    notes += quant_notes(counts, peft_config is not None)
    total_params, trainable_params = counts["total"], counts["trainable"]
    est = _per_rank(
        m, net, policy, world_size, config, batch_size, seq_len, trainable_params, total_params, notes, model
    )
    if mode == "eval":
        est = _with_kept_logits(est, counts, eval_samples or batch_size)
    # fp32 weights need no note (the fields say it); 16-bit ones say where the dtype came from and what it means.
    notes = (
        (*est.notes, _dtype_note(weights, net, policy, training=mode == "train"))
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


@dataclass(frozen=True, slots=True)
class _Job:
    """What one estimate traces, besides the config."""

    task: str
    peft_config: Any
    trust_remote_code: bool
    weights: WeightsDtype
    policy: MemoryPolicy
    """The traced policy (no compile, no FSDP: those are accounted for after the trace)."""
    optimizer: str
    batch_size: int
    seq_len: int
    packed: bool
    mode: str = "train"


@dataclass(frozen=True, slots=True)
class _Traced:
    net: nn.Module
    phases: PhasePeaks
    counts: dict[str, int]
    """Parameters (``total``, ``trainable``) and the 4-bit layers' numbers (``quant_*``)."""


def _trace(config: Any, job: _Job) -> _Traced:
    """The model of ``config`` built on fake tensors, prepared, and one training step traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..prepare import prepare_model
    from ..transforms.optim import make_optimizer

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    net = build_fake_model(config, job.task, job.peft_config, job.trust_remote_code, mode, job.weights)
    refuse_mixture_of_experts(net, config)
    if job.mode == "eval":
        return _trace_eval(net, config, job, mode)
    with mode:
        net.train()
        prepare_model(net, job.policy)
        params = [p for p in net.parameters() if p.requires_grad]
        # The optimizer the policy asks for, built as users build it (fp32 or 8-bit moments, stepped
        # after or in the backward), so its state is traced as it will be allocated.
        opt = make_optimizer(net, job.policy, lr=1e-4) if job.optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4)
        batch = fake_batch(config, job.task, job.batch_size, job.seq_len, packed=job.packed)
        with packing_as_traced(job.packed):
            phases = traced_step(net, batch, opt, config, job.task)
    counts = {
        "total": sum(p.numel() for p in net.parameters()),
        "trainable": sum(p.numel() for p in params),
        **quant_counts(net),
    }
    return _Traced(net=net, phases=phases, counts=counts)


def _trace_eval(net: nn.Module, config: Any, job: _Job, mode: Any) -> _Traced:
    """The prepared model in eval mode, one forward of the eval batch traced under ``torch.no_grad()``;
    the outputs Trainer keeps of it counted (per batch: a line in the depth, flat)."""
    from ..measure.memory import trace_eval_forward
    from ..prepare import prepare_model
    from .eval_logits import kept_outputs

    with mode, warnings.catch_warnings():
        # Its warning that 16-bit trainable weights lose precision in updates is about training.
        warnings.filterwarnings("ignore", message=".*optimizer updates then lose precision", category=UserWarning)
        net.eval()
        prepare_model(net, job.policy)
        batch = fake_batch(config, job.task, job.batch_size, job.seq_len, packed=job.packed)
        with packing_as_traced(job.packed):
            phases, outputs = trace_eval_forward(net, batch)
    kept = kept_outputs(outputs, getattr(config, "keys_to_ignore_at_inference", ["cache"]))
    params = [p for p in net.parameters() if p.requires_grad]
    counts = {
        "total": sum(p.numel() for p in net.parameters()),
        "trainable": sum(p.numel() for p in params),
        "kept": kept.device_bytes,
        "kept_host": kept.host_bytes,
        **quant_counts(net),
    }
    return _Traced(net=net, phases=phases, counts=counts)


def _with_kept_logits(est: MemoryEstimate, counts: dict[str, int], samples: int) -> MemoryEstimate:
    """The eval estimate: the forward's peak, nothing saved for a backward, and the outputs kept for ``samples``."""
    per_sample, per_sample_host = counts["kept"] // est.batch_size, counts["kept_host"] // est.batch_size
    kept = per_sample * samples
    note = (
        f"eval: Trainer.evaluate() with compute_metrics (and predict()) keeps {format_bytes(kept)} of logits for {samples} samples "
        f"on the device until the loop ends: its peak there is about {format_bytes(est.peak_bytes + kept)} (the forward's peak "
        "plus them; concatenating a batch copies what is kept so far). prediction_loss_only=True keeps none, "
        "eval_accumulation_steps=N moves them to host memory every N batches, preprocess_logits_for_metrics="
        f"lambda logits, labels: logits.argmax(-1) keeps one id a token; in host memory they take {format_bytes(per_sample_host * samples)}"
    )
    return dataclasses.replace(
        est,
        mode="eval",
        peak_phase="forward",
        activations=0,
        temporaries=est.activations + est.temporaries,
        forward_backward_peak=est.peak_bytes,
        eval_samples=samples,
        eval_logits_bytes=kept,
        eval_logits_host_bytes=per_sample_host * samples,
        notes=(*est.notes, note),
    )


def _depth_plan(config: Any, job: _Job) -> DepthPlan | None:
    """Which shallow depths to trace for this job, or None to trace every block."""

    def build(cfg: Any) -> nn.Module:
        with torch.device("meta"):
            net = build_model(cfg, job.task, trust_remote_code=job.trust_remote_code, dtype=job.weights.dtype)
            if job.weights.per_parameter:
                set_dtypes(net, job.weights.per_parameter)
        return net

    ck = job.policy.checkpointing
    every_n = ck.every_n if ck.mode == "every_n" else 1

    def depth_plan() -> DepthPlan | None:
        try:
            return plan_depths(config, build, every_n=every_n, peft_config=job.peft_config)
        except ValueError:
            return None  # the full trace (next) says what is wrong with the config

    # The same for every rung and batch of a plan: what plan_depths reads is the config, the
    # weights' dtypes, the checkpointing period and whether the PEFT config picks blocks.
    key = (
        *build_key(config, job.task, job.trust_remote_code, job.weights),
        every_n,
        _peft_picks_blocks(job.peft_config),
    )
    return build_cache.cached("depth_plans", key, depth_plan)


def _dtype_note(weights: WeightsDtype, net: nn.Module, policy: MemoryPolicy, *, training: bool = True) -> str:
    """The weights' dtype, where it came from, and (training) what trains in which dtype."""
    trainable = sorted({short_name(p.dtype) for p in net.parameters() if p.requires_grad and p.is_floating_point()})
    frozen = sorted({short_name(p.dtype) for p in net.parameters() if not p.requires_grad and p.is_floating_point()})
    held = f"trainable parameters {'/'.join(trainable) or 'none'}" + (f", frozen {'/'.join(frozen)}" if frozen else "")
    note = (
        f"weights counted in {weights.name} ({weights.source}): {held}; pass dtype= (--dtype) to estimate another load"
    )
    if training and policy.master_weights == "bf16":
        note += ". Pure bf16 (weights:bf16): the trainable weights, their gradients and AdamW's moments in bf16, updated with stochastic rounding"
    elif training and policy.precision != "fp32" and weights.dtype != torch.float32:
        # prepare_model casts the 16-bit trainable weights to fp32 master weights (policy.master_weights='fp32').
        note += (
            ". prepare_model casts 16-bit trainable weights to fp32 master weights (weights:fp32, counted here); "
            "'weights:bf16' keeps them in bf16 with stochastic rounding (8 bytes per trainable parameter instead of 16)"
        )
    return note


def _per_rank(
    m: StepMemory,
    net: nn.Module,
    policy: MemoryPolicy,
    world: int,
    config: Any,
    batch: int,
    seq: int,
    trainable: int,
    total: int,
    notes: list[str],
    model: Any,
) -> MemoryEstimate:
    params, grads, opt = m.parameters, m.gradients, m.optimizer
    # What the peak holds beyond the model states: activations and temporaries (logits, their gradients, buffers).
    rest = max(0, m.peak_bytes - params - grads - opt)
    traced_states = params + grads + opt
    if policy.fsdp.mode != "none" and world > 1:
        # Sharded states; plus the parameters of the block being computed, gathered in full.
        block = max((sum(tensor_bytes(p) for p in b.parameters()) for b in blocks_or_empty(net)), default=0)
        params, grads, opt = params // world + 2 * block, grads // world, opt // world
        if policy.fsdp.cpu_offload:
            notes.append("fsdp cpu_offload: sharded parameters, gradients and optimizer state live in host memory")
            params, grads, opt = 2 * block, 0, 0
    # The forward+backward peak as traced, less what sharding takes off this rank. Not the step's
    # model states plus a rest: those are the optimizer phase's (every gradient alive, the step's
    # temporaries), and where that phase holds the peak the forward+backward would read as equal to
    # it at every batch size - the planner's slope per sample then read 0.
    fb_peak = max(0, m.forward_backward_peak - (traced_states - (params + grads + opt)))
    name = getattr(config, "_name_or_path", "") or type(net).__name__
    return MemoryEstimate(
        model=str(model) if isinstance(model, (str, Path)) else name,
        policy=policy.to_string(),
        batch_size=batch,
        seq_len=seq,
        world_size=world,
        parameters=params,
        gradients=grads,
        optimizer=opt,
        activations=min(m.saved_activations, rest),
        temporaries=rest - min(m.saved_activations, rest),
        peak_bytes=params + grads + opt + rest,
        peak_phase=m.peak_phase,
        forward_backward_peak=fb_peak,
        trainable_parameters=trainable,
        total_parameters=total,
        notes=tuple(notes),
    )
