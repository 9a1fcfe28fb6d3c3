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

import copy
import dataclasses
import difflib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..accounting import tensor_bytes
from ..data.boundaries import packing_as_traced
from ..memory import PhasePeaks, StepMemory, step_memory_of, trace_training_step
from ..policy import MemoryPolicy
from ..sizes import format_bytes
from . import build_cache
from .depth import DepthPlan, _peft_picks_blocks, extrapolate_line, extrapolate_phases, plan_depths, text_config, with_depth
from .weights_dtype import WeightsDtype, cast_like_from_pretrained, parse_dtype, resolve_weights_dtype, set_dtypes, short_name

__all__ = ["DEFAULT_LORA", "MemoryEstimate", "build_model", "check_seq_len", "chunked_loss_problem", "estimate_memory", "infer_task",
           "load_config", "peft_config_from", "task_note"]


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
        cats = ", ".join(f"{k} {format_bytes(getattr(self, k))}" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries"))
        if self.mode == "eval":
            return (f"{self.model} [{self.policy}] {self.weights_dtype} weights, eval batch {self.batch_size} x seq {self.seq_len}, "
                    f"{self.world_size} rank(s): forward peak {format_bytes(self.peak_bytes)} ({cats}); logits kept by "
                    f"Trainer.evaluate for {self.eval_samples} samples {format_bytes(self.eval_logits_bytes)} on the device "
                    f"({format_bytes(self.eval_logits_host_bytes)} as numpy in host memory)")
        return (f"{self.model} [{self.policy}] {self.weights_dtype} weights, batch {self.batch_size} x seq {self.seq_len}, "
                f"{self.world_size} rank(s): peak {format_bytes(self.peak_bytes)} in the {self.peak_phase} phase ({cats})")


_ACCEPTED = ("a hub id (in the local cache), a local directory, a Transformers config (e.g. LlamaConfig(...)), a config "
             "dict with its 'model_type' (config.to_dict()), or a model")


def load_config(model: str | Path | Any, *, trust_remote_code: bool = False) -> Any:
    """A Transformers config from a config object, a config dict, a local directory, or a hub id
    already in the local cache. Nothing is downloaded, so an unknown id fails at once instead of
    hanging offline.

    Raises:
        ValueError: not a directory with a config.json and not in the local Hugging Face cache; or
            its config.json (or the dict) is not valid JSON, has no ``model_type``, or describes an invalid model.
        TypeError: ``model`` is none of the above (e.g. a config class rather than a config).
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, nn.Module):
        return model.config
    if isinstance(model, dict):
        return _config_from_dict(model)
    if not isinstance(model, (str, Path)):
        what = f"the class {model.__name__}, not a config: pass {model.__name__}(...)" if isinstance(model, type) else type(model).__name__
        raise TypeError(f"model={_short(model)} ({what}); pass {_ACCEPTED}")
    path = Path(str(model)).expanduser()
    if path.is_dir():
        _check_config_file(path)
    try:
        return AutoConfig.from_pretrained(str(path) if path.is_dir() else str(model), local_files_only=True,
                                          trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure to build the config is an invalid model (huggingface_hub's
        # strict-dataclass validation raises its own error type), said with its cause
        if path.is_dir():
            raise ValueError(f"model={str(model)!r}: {path / 'config.json'} is not a valid Transformers config "
                             f"({_reason(e)}); fix the file or pass another model") from None
        raise ValueError(
            f"model={str(model)!r} is not a local directory with a config.json and not in the local Hugging Face cache "
            f"({type(e).__name__}); download it first (`hf download {model} config.json`) or pass a local directory"
        ) from None


def _config_from_dict(data: dict[str, Any]) -> Any:
    """The config a ``config.to_dict()`` (or a parsed config.json) describes, built as
    ``AutoConfig.from_pretrained`` builds one from its file: the class named by ``model_type``."""
    from transformers import CONFIG_MAPPING

    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"model= a config dict without a 'model_type' string (model_type={model_type!r}; keys "
                         f"{sorted(map(str, data))[:8]}...): it does not say which architecture it is; add it (e.g. "
                         "{'model_type': 'llama', ...}) or pass the config object")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model= a config dict with model_type={model_type!r}, which this Transformers does not know (a model with "
                         "custom code? load its config with AutoConfig.from_pretrained(..., trust_remote_code=True) and pass that)")
    cls = CONFIG_MAPPING[model_type]
    _check_dict_keys(cls, data)
    try:
        return cls.from_dict({k: v for k, v in data.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001 - a config class's own validation raises its own types
        raise ValueError(f"model= a config dict with model_type={model_type!r} is not a valid Transformers config ({_reason(e)}); "
                         "fix its values") from None


def _check_dict_keys(cls: type, data: dict[str, Any]) -> None:
    """A config keeps keys it does not define, and builds its defaults instead: ``"hiden_size": 64`` would
    estimate a 4096-wide model. A key that is not the config's (nor a generation setting, which older
    configs carry) but is close to one of its keys is refused as the typo it most likely is; other
    extra keys are kept, as Transformers keeps them."""
    from transformers import GenerationConfig

    default = cls()
    known = set(default.to_dict()) | set(getattr(cls, "attribute_map", {})) | set(GenerationConfig().to_dict())
    for key in (str(k) for k in data if k not in known):
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
        if close:
            raise ValueError(f"model= a config dict with {key!r}, which {cls.__name__} does not define (the model would be "
                             f"built with the default {close[0]}={getattr(default, close[0], None)!r}); did you mean {close[0]!r}?")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reason(e: BaseException) -> str:
    """The innermost cause's type and first line (validation errors wrap the useful one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240] if str(e).strip() else ''}"


def _check_config_file(path: Path) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"model={str(path)!r} is a directory without a config.json; pass a directory written by save_pretrained")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"model={str(path)!r}: {config} is not valid JSON ({e}); fix or re-download it") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"model={str(path)!r}: {config} has no 'model_type' (which architecture it is); "
                         "add it (e.g. \"model_type\": \"llama\") or re-save the model with save_pretrained")


def check_seq_len(config: Any, seq_len: int) -> None:
    """Raise ValueError when ``seq_len`` is not positive or above the model's position limit."""
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len={seq_len} is above the model's limit of {limit} positions; use seq_len={limit} or less")


def infer_task(model: Any, config: Any) -> str:
    """Which head to build when no task is given: ``classification`` for a sequence-classification
    model (its class, or the config's ``architectures`` saved by ``save_pretrained``) and for an
    encoder without a causal-LM head (``BertModel``, ``BertForMaskedLM``: what the recipe
    fine-tunes such a model for), else ``causal-lm``. See :func:`task_note` for why."""
    return _infer_task(model, config)[0]


def task_note(model: Any, config: Any) -> str | None:
    """Why :func:`infer_task` chose classification for a model that names no classification head
    (an encoder), as a note for the estimate; None when the architecture says it plainly."""
    return _infer_task(model, config)[1]


_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _infer_task(model: Any, config: Any) -> tuple[str, str | None]:
    from ..record import unwrap_model

    names = [type(unwrap_model(model)).__name__] if isinstance(model, nn.Module) else list(getattr(config, "architectures", None) or [])
    if any(n.endswith("ForSequenceClassification") for n in names):
        return "classification", None
    if any(n.endswith(_CAUSAL_HEADS) for n in names):
        return "causal-lm", None
    if config is None and isinstance(model, nn.Module):
        config = getattr(model, "config", None)
    if _is_encoder(config):
        # An encoder (BERT, RoBERTa...) is not a causal LM: building it as one makes a decoder it
        # never was (BertLMHeadModel, with an is_decoder warning per layer) and estimates its MLM-sized head.
        what = names[0] if names else type(config).__name__
        return "classification", (f"task: classification ({what} is an encoder, fine-tuned with a classification head as the "
                                  "recipe does); pass task='causal-lm' (--task causal-lm) to estimate it as a decoder")
    return "causal-lm", None


def _is_encoder(config: Any) -> bool:
    """A Transformers encoder: its model type has a masked-LM head, it is not set up as a decoder,
    and it is not an encoder-decoder (BART and T5 generate)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config is None or getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return False
    return getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def build_model(config: Any, task: str, peft_config: Any | None = None, *, trust_remote_code: bool = False,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of ``config`` for ``task`` (random weights in ``dtype``, the modules Transformers
    keeps in fp32 kept there as ``from_pretrained`` keeps them), with PEFT adapters when given.
    ``config`` is left as it was.

    Raises:
        ValueError: the config describes an invalid model, or the PEFT config matches no module.
    """
    net = _build(config, task, trust_remote_code, dtype)
    cast_like_from_pretrained(net, dtype)
    return _apply_peft(net, peft_config) if peft_config is not None else net


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
    _check_arguments(batch_size=batch_size, seq_len=seq_len, world_size=world_size, optimizer=optimizer, task=task, dtype=dtype)
    _check_mode(mode, eval_samples)
    given = model
    model, trainable = _what_trains(model, trainable)
    peft_config = peft_config_from(trainable)
    config = load_config(model, trust_remote_code=trust_remote_code)
    # A model object counts at its own parameters' dtypes (a PEFT model's names match the traced one's).
    weights = resolve_weights_dtype(given if isinstance(given, nn.Module) else model, config, dtype)
    inferred_note = task_note(model, config) if task is None else None
    task = task or infer_task(model, config)
    policy = MemoryPolicy.coerce(policy)
    if optimizer == "sgd" and (policy.optimizer.state, policy.optimizer.step) != ("fp32", "after_backward"):
        raise ValueError(f"optimizer='sgd' with policy {policy.to_string()!r}: the policy's optimizer rung (optim:8bit, "
                         "optim:in_backward) is an AdamW; use optimizer='adamw' or drop the optim: tokens")
    notes = [f"world_size={world_size} without FSDP: every rank holds the whole model (data parallel)"] if (
        policy.fsdp.mode == "none" and world_size > 1) else []
    if inferred_note:
        notes.append(inferred_note)
    if policy.fsdp.mode != "none" and world_size == 1:
        notes.append("an fsdp policy with world_size=1 shards nothing: pass world_size (--world-size) as the number of devices")
    traced = MemoryPolicy.from_dict({**policy.to_dict(), "compile": {"mode": "none"}, "fsdp": {"mode": "none"}})
    if policy.compile.mode != "none":
        notes.append("compile is estimated as eager: its fused kernels usually lower the peak a little")
    check_seq_len(config, seq_len)
    _check_depth(config)
    if policy.loss.mode == "chunked":
        problem, note = _chunked_loss_verdict(config, task, trust_remote_code)
        if problem is not None:
            raise ValueError(problem)
        notes += [note] if note else []

    job = _Job(task=task, peft_config=peft_config, trust_remote_code=trust_remote_code, weights=weights, policy=traced,
               optimizer=optimizer, batch_size=batch_size, seq_len=seq_len, packed=packed and task == "causal-lm", mode=mode)
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
    notes += _quant_notes(counts, peft_config is not None)
    total_params, trainable_params = counts["total"], counts["trainable"]
    est = _per_rank(m, net, policy, world_size, config, batch_size, seq_len, trainable_params, total_params, notes, model)
    if mode == "eval":
        est = _with_kept_logits(est, counts, eval_samples or batch_size)
    # fp32 weights need no note (the fields say it); 16-bit ones say where the dtype came from and what it means.
    notes = (*est.notes, _dtype_note(weights, net, policy, training=mode == "train")) if weights.dtype != torch.float32 else est.notes
    trainable_dtype = "/".join(sorted({short_name(p.dtype) for p in net.parameters() if p.requires_grad and p.is_floating_point()}))
    return dataclasses.replace(est, weights_dtype=weights.name, weights_dtype_source=weights.source,
                               trainable_dtype=trainable_dtype or "none", notes=notes)


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

    from ..optim import make_optimizer
    from ..prepare import prepare_model

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    net = _fake_model(config, job.task, job.peft_config, job.trust_remote_code, mode, job.weights)
    _refuse_mixture_of_experts(net, config)
    if job.mode == "eval":
        return _trace_eval(net, config, job, mode)
    with mode:
        net.train()
        prepare_model(net, job.policy)
        params = [p for p in net.parameters() if p.requires_grad]
        # The optimizer the policy asks for, built as users build it (fp32 or 8-bit moments, stepped
        # after or in the backward), so its state is traced as it will be allocated.
        opt = make_optimizer(net, job.policy, lr=1e-4) if job.optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4)
        batch = _batch(config, job.task, job.batch_size, job.seq_len, packed=job.packed)
        with packing_as_traced(job.packed):
            phases = _traced_step(net, batch, opt, config, job.task)
    counts = {"total": sum(p.numel() for p in net.parameters()), "trainable": sum(p.numel() for p in params), **_quant_counts(net)}
    return _Traced(net=net, phases=phases, counts=counts)


def _trace_eval(net: nn.Module, config: Any, job: _Job, mode: Any) -> _Traced:
    """The prepared model in eval mode, one forward of the eval batch traced under ``torch.no_grad()``;
    the outputs Trainer keeps of it counted (per batch: a line in the depth, flat)."""
    from ..memory import trace_eval_forward
    from ..prepare import prepare_model
    from .eval_logits import kept_outputs

    with mode, warnings.catch_warnings():
        # Its warning that 16-bit trainable weights lose precision in updates is about training.
        warnings.filterwarnings("ignore", message=".*optimizer updates then lose precision", category=UserWarning)
        net.eval()
        prepare_model(net, job.policy)
        batch = _batch(config, job.task, job.batch_size, job.seq_len, packed=job.packed)
        with packing_as_traced(job.packed):
            phases, outputs = trace_eval_forward(net, batch)
    kept = kept_outputs(outputs, getattr(config, "keys_to_ignore_at_inference", ["cache"]))
    params = [p for p in net.parameters() if p.requires_grad]
    counts = {"total": sum(p.numel() for p in net.parameters()), "trainable": sum(p.numel() for p in params),
              "kept": kept.device_bytes, "kept_host": kept.host_bytes, **_quant_counts(net)}
    return _Traced(net=net, phases=phases, counts=counts)


def _with_kept_logits(est: MemoryEstimate, counts: dict[str, int], samples: int) -> MemoryEstimate:
    """The eval estimate: the forward's peak, nothing saved for a backward, and the outputs kept for ``samples``."""
    per_sample, per_sample_host = counts["kept"] // est.batch_size, counts["kept_host"] // est.batch_size
    kept = per_sample * samples
    note = (f"eval: Trainer.evaluate() with compute_metrics (and predict()) keeps {format_bytes(kept)} of logits for {samples} samples "
            f"on the device until the loop ends: its peak there is about {format_bytes(est.peak_bytes + kept)} (the forward's peak "
            "plus them; concatenating a batch copies what is kept so far). prediction_loss_only=True keeps none, "
            "eval_accumulation_steps=N moves them to host memory every N batches, preprocess_logits_for_metrics="
            f"lambda logits, labels: logits.argmax(-1) keeps one id a token; in host memory they take {format_bytes(per_sample_host * samples)}")
    return dataclasses.replace(est, mode="eval", peak_phase="forward", activations=0, temporaries=est.activations + est.temporaries,
                               forward_backward_peak=est.peak_bytes, eval_samples=samples, eval_logits_bytes=kept,
                               eval_logits_host_bytes=per_sample_host * samples, notes=(*est.notes, note))


def _check_mode(mode: Any, eval_samples: Any) -> None:
    if mode not in ("train", "eval"):
        raise ValueError(f"mode={mode!r} is not one of 'train' (a training step), 'eval' (an evaluation forward and the "
                         "logits Trainer.evaluate keeps)")
    if eval_samples is None:
        return
    if not isinstance(eval_samples, int) or isinstance(eval_samples, bool) or eval_samples <= 0:
        raise ValueError(f"eval_samples={eval_samples!r} must be a positive integer (the evaluation set's size, len(eval_dataset))")
    if mode != "eval":
        raise ValueError(f"eval_samples={eval_samples} is only used with mode='eval' (mode={mode!r}); pass mode='eval' to "
                         "estimate evaluation, or drop eval_samples")


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
    key = (*_build_key(config, job.task, job.trust_remote_code, job.weights), every_n, _peft_picks_blocks(job.peft_config))
    return build_cache.cached("depth_plans", key, depth_plan)


def _build_key(config: Any, task: str, trust_remote_code: bool, weights: WeightsDtype) -> tuple[Any, ...]:
    """Everything a model built on meta depends on besides its PEFT config."""
    per = tuple(sorted((k, str(v)) for k, v in weights.per_parameter.items())) if weights.per_parameter else None
    return (*build_cache.config_key(config), task, trust_remote_code, str(weights.dtype), per)


def _check_depth(config: Any) -> None:
    """A config without blocks builds (embeddings and a head) and would be estimated as that: refused."""
    layers = getattr(text_config(config), "num_hidden_layers", None)
    if isinstance(layers, int) and not isinstance(layers, bool) and layers <= 0:
        raise ValueError(f"model= a {type(config).__name__} with num_hidden_layers={layers}: a model without blocks, which no "
                         "checkpoint is; set num_hidden_layers to the model's number of layers (config.json's num_hidden_layers)")


def _check_arguments(*, batch_size: Any, seq_len: Any, world_size: Any, optimizer: Any, task: Any, dtype: Any) -> None:
    """The plain arguments of :func:`estimate_memory`, refused before any work."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r} is not one of 'adamw', 'sgd'")
    if task is not None and task not in ("causal-lm", "classification"):
        raise ValueError(f"task={task!r} is not one of 'causal-lm', 'classification'")
    parse_dtype(dtype)


def _dtype_note(weights: WeightsDtype, net: nn.Module, policy: MemoryPolicy, *, training: bool = True) -> str:
    """The weights' dtype, where it came from, and (training) what trains in which dtype."""
    trainable = sorted({short_name(p.dtype) for p in net.parameters() if p.requires_grad and p.is_floating_point()})
    frozen = sorted({short_name(p.dtype) for p in net.parameters() if not p.requires_grad and p.is_floating_point()})
    held = f"trainable parameters {'/'.join(trainable) or 'none'}" + (f", frozen {'/'.join(frozen)}" if frozen else "")
    note = f"weights counted in {weights.name} ({weights.source}): {held}; pass dtype= (--dtype) to estimate another load"
    if training and policy.master_weights == "bf16":
        note += ". Pure bf16 (weights:bf16): the trainable weights, their gradients and AdamW's moments in bf16, updated with stochastic rounding"
    elif training and policy.precision != "fp32" and weights.dtype != torch.float32:
        # prepare_model casts the 16-bit trainable weights to fp32 master weights (policy.master_weights='fp32').
        note += (". prepare_model casts 16-bit trainable weights to fp32 master weights (weights:fp32, counted here); "
                 "'weights:bf16' keeps them in bf16 with stochastic rounding (8 bytes per trainable parameter instead of 16)")
    return note


# Past this many parameters (one block kept), the chunked loss is not compared with the model's own here.
_LOSS_CHECK_MAX_PARAMETERS = 32 * 2**20  # building more costs seconds on a CPU
_LOSS_VERDICTS: dict[tuple[str, str, str], tuple[str | None, str | None]] = {}


def chunked_loss_problem(config: Any, task: str, *, trust_remote_code: bool = False) -> str | None:
    """Why ``prepare_model`` would refuse ``loss:chunked`` on the model of ``config`` for ``task``, or None.

    The estimator's model has no values (fake tensors), so ``prepare_model`` cannot run the part of
    its check that compares the chunked loss with the model's own on a few tokens (BERT's LM head
    transforms the hidden states before the output layer, which the chunked loss skips). This runs
    that same check (:func:`hf_memstack.loss.check_loss_head`) on the same architecture with one
    block and random weights - when that is small enough; otherwise the estimate says it was not checked.
    """
    return _chunked_loss_verdict(config, task, trust_remote_code)[0]


def _chunked_loss_verdict(config: Any, task: str, trust_remote_code: bool) -> tuple[str | None, str | None]:
    """(the refusal, a note), computed once per config and task."""
    key = (type(config).__qualname__, config.to_json_string(use_diff=False), task)
    if key not in _LOSS_VERDICTS:
        if len(_LOSS_VERDICTS) > 64:
            _LOSS_VERDICTS.clear()
        _LOSS_VERDICTS[key] = _check_chunked_loss(config, task, trust_remote_code)
    return _LOSS_VERDICTS[key]


def _check_chunked_loss(config: Any, task: str, trust_remote_code: bool) -> tuple[str | None, str | None]:
    from ..loss import check_loss_head
    from ..policy import LossConfig

    small = copy.deepcopy(config)
    text = text_config(small)
    if isinstance(getattr(text, "num_hidden_layers", None), int) and text.num_hidden_layers > 1:
        text.num_hidden_layers = 1  # what happens between the backbone and the output head does not depend on the depth
    with torch.device("meta"):
        try:
            shape = build_model(small, task, trust_remote_code=trust_remote_code)
        except ValueError:
            return None, None  # the full model's build (next) says what is wrong with the config
    if sum(p.numel() for p in shape.parameters()) > _LOSS_CHECK_MAX_PARAMETERS:
        return None, ("loss:chunked was not compared with the model's own loss here (too large to build for that check); "
                      "prepare_model compares them on the real weights before training")
    del shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        real = build_model(small, task, trust_remote_code=trust_remote_code)
    try:
        check_loss_head(real, LossConfig(mode="chunked"))
    except ValueError as e:
        return f"{e} (estimate_memory refuses what prepare_model refuses)", None
    return None, None


def _quant_counts(net: nn.Module) -> dict[str, int]:
    """The traced 4-bit base's numbers (none without one), each a line in the number of blocks."""
    from ..record import record_of

    record = record_of(net)
    quant = record.quant if record is not None else None
    if quant is None or not quant.layers:
        return {}
    return {"quant_layers": len(quant.layers), "quant_weights": quant.weights, "quant_bytes": quant.bytes_4bit,
            "quant_bytes_before": quant.bytes_before}


def _quant_notes(counts: dict[str, int], lora: bool) -> list[str]:
    """What the traced 4-bit base holds (its bytes are in ``parameters``, counted as traced)."""
    if not counts.get("quant_layers"):
        return []
    bits = 8 * counts["quant_bytes"] / counts["quant_weights"]
    notes = [f"4-bit base weights: {counts['quant_layers']} linear layers, {format_bytes(counts['quant_bytes'])} for "
             f"{counts['quant_weights']:,} weights ({bits:.2f} bits each; {format_bytes(counts['quant_bytes_before'])} before quantization)"]
    if not lora:
        notes.append("quant:nf4 with trainable='all': the 4-bit layers are frozen and only the rest trains; pass trainable='lora' "
                     "(--lora-r) for QLoRA")
    return notes


def _what_trains(model: Any, trainable: Any) -> tuple[Any, Any]:
    """A PEFT model, or a saved adapter directory, says what trains itself (when ``trainable`` is
    left at "all"): its base model's config is estimated with its adapters."""
    if isinstance(model, nn.Module) and type(model).__module__.startswith("peft.") and hasattr(model, "peft_config"):
        return model.get_base_model(), model.peft_config[model.active_adapter] if trainable == "all" else trainable
    if isinstance(model, nn.Module) and trainable == "all" and any(not p.requires_grad for p in model.parameters()):
        warnings.warn(f"{type(model).__name__} has frozen parameters, but the estimate builds it from its config, where every "
                      "parameter trains; pass trainable= (a PEFT config, 'lora' or a dict) to estimate what really trains",
                      stacklevel=3)
    path = Path(str(model)).expanduser() if isinstance(model, (str, Path)) else None
    if path is not None and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from peft import PeftConfig

        adapter = PeftConfig.from_pretrained(str(path))
        return adapter.base_model_name_or_path, adapter if trainable == "all" else trainable
    return model, trainable


def _traced_step(net: nn.Module, batch: Any, opt: Any, config: Any, task: str) -> PhasePeaks:
    """The meter's step on fake tensors. A forward that needs the data's values (an output whose
    shape depends on them, a ``.item()``) cannot run there: said as such, not as a trace error."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return trace_training_step(net, batch, opt)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise ValueError(
            f"the estimator cannot trace {type(net).__name__} ({type(config).__name__}, task={task!r}) without real data: its "
            f"forward depends on the values of the batch ({type(e).__name__}: {str(e).splitlines()[0][:120]}). Measure it "
            "instead: hf_memstack.measure_step or find_batch_size on the real model"
        ) from None


def _refuse_mixture_of_experts(net: nn.Module, config: Any) -> None:
    """A mixture-of-experts model cannot be traced on fake tensors: its default experts kernel
    (``torch._grouped_mm``) has no fake-tensor version for fp32 in this PyTorch, and its eager
    experts path picks each expert's tokens by the router's values (``nonzero``: shapes that depend
    on the data). Said as such, with what to do, instead of the kernel's raw error."""
    from ..record import unwrap_model

    inner = net.get_base_model() if callable(getattr(net, "get_base_model", None)) else net  # a PEFT model's own
    cls = type(unwrap_model(inner))
    can_set = getattr(cls, "_can_set_experts_implementation", None)
    if callable(can_set) and can_set():
        raise ValueError(
            f"the estimator cannot trace {cls.__name__} ({type(config).__name__}): it is a mixture-of-experts model, whose "
            "experts route each token by the router's values (shapes that depend on the data, which a trace without "
            "values cannot follow; torch._grouped_mm has no fake-tensor kernel for fp32 either). Measure it instead: "
            "hf_memstack.measure_step(model, batch, optimizer) on the real model, or find_batch_size "
            "(hf-memstack find-batch-size MODEL --policy ... --seq-len ... --budget ...)"
        )


def peft_config_from(trainable: Any) -> Any | None:
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
    if trainable == "lora":
        return LoraConfig(**DEFAULT_LORA)
    if isinstance(trainable, dict):
        try:
            return LoraConfig(**{**DEFAULT_LORA, **trainable})
        except (TypeError, ValueError) as e:
            raise ValueError(f"trainable={trainable!r} is not a valid LoraConfig ({e}); allowed fields are LoraConfig's, "
                             "e.g. {'r': 16, 'lora_alpha': 32, 'target_modules': ['q_proj', 'v_proj']}") from None
    return trainable


# LoRA's common defaults (PEFT's own r=8), on every linear layer but the output head.
DEFAULT_LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}


def _fake_model(config: Any, task: str, peft_config: Any | None, trust_remote_code: bool, mode: Any,
                weights: WeightsDtype) -> nn.Module:
    """The model built on the meta device in the weights' dtype (PEFT adapters added there, in the
    dtype PEFT gives them), then given fake tensors: shapes and dtypes, no storage. Built on meta
    first because ``Module.to()`` (which PEFT calls on its new adapters) cannot swap fake
    parameters; tied parameters stay tied. A model object's own per-parameter dtypes are kept."""
    def build() -> nn.Module:
        with torch.device("meta"):
            net = build_model(config, task, trust_remote_code=trust_remote_code, dtype=weights.dtype)
            if weights.per_parameter:
                set_dtypes(net, weights.per_parameter)
            if peft_config is not None:
                net = _apply_peft(net, peft_config)
                if weights.per_parameter:
                    set_dtypes(net, weights.per_parameter)
        return net

    # Built once per config and job (PEFT's wrapping is most of a build), copied for each trace.
    net = build_cache.model_copy((*_build_key(config, task, trust_remote_code, weights), repr(peft_config)), build)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            fakes[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if parameter else new
        return fakes[id(t)]

    for module in net.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = fake(p, True)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b, False)
    return net


def _per_rank(m: StepMemory, net: nn.Module, policy: MemoryPolicy, world: int, config: Any, batch: int, seq: int,
              trainable: int, total: int, notes: list[str], model: Any) -> MemoryEstimate:
    params, grads, opt = m.parameters, m.gradients, m.optimizer
    # What the peak holds beyond the model states: activations and temporaries (logits, their gradients, buffers).
    rest = max(0, m.peak_bytes - params - grads - opt)
    traced_states = params + grads + opt
    if policy.fsdp.mode != "none" and world > 1:
        # Sharded states; plus the parameters of the block being computed, gathered in full.
        block = max((sum(tensor_bytes(p) for p in b.parameters()) for b in _blocks_or_empty(net)), default=0)
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
        model=str(model) if isinstance(model, (str, Path)) else name, policy=policy.to_string(), batch_size=batch, seq_len=seq,
        world_size=world, parameters=params, gradients=grads, optimizer=opt, activations=min(m.saved_activations, rest),
        temporaries=rest - min(m.saved_activations, rest), peak_bytes=params + grads + opt + rest, peak_phase=m.peak_phase,
        forward_backward_peak=fb_peak, trainable_parameters=trainable, total_parameters=total, notes=tuple(notes),
    )


def _blocks_or_empty(net: nn.Module) -> tuple[nn.Module, ...]:
    from ..blocks import find_blocks

    try:
        return find_blocks(net).modules
    except ValueError:
        return ()


def _build(config: Any, task: str, trust_remote_code: bool, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    try:
        # A copy: from_config writes the dtype into the config it is given (the user's, or their model's).
        return auto.from_config(copy.deepcopy(config), trust_remote_code=trust_remote_code, dtype=dtype)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ValueError(f"{type(config).__name__} has no {task} model in Transformers; pass task='classification' "
                             "or 'causal-lm' to match the model") from None
        raise ValueError(f"{type(config).__name__} does not describe a valid model ({str(e).splitlines()[0][:240]}); fix its config") from None
    except (RuntimeError, TypeError, AssertionError) as e:
        raise ValueError(f"{type(config).__name__} does not describe a model Transformers can build "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:240]}); fix its config") from None


def _apply_peft(net: nn.Module, peft_config: Any) -> nn.Module:
    from peft import get_peft_model  # optional: only when a PEFT config is given

    peft_config = copy.deepcopy(peft_config)
    # A saved adapter's config says inference_mode=True (adapters frozen); what is estimated is training them.
    if getattr(peft_config, "inference_mode", False):
        peft_config.inference_mode = False
    try:
        return get_peft_model(net, peft_config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"trainable: the PEFT config does not fit {type(net).__name__} ({str(e).splitlines()[0][:200]}); "
                         f"its linear layers are named {names}: pass target_modules from those") from None


def _batch(config: Any, task: str, batch: int, seq: int, *, packed: bool = False) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, max(2, config.vocab_size - 1), (batch, seq))
    if task == "classification":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(batch, dtype=torch.long)}
    if packed:  # two samples a row, positions restarting at the second: the collator's layout
        half = seq // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand(batch, seq)
        return {"input_ids": ids, "labels": ids, "position_ids": positions}
    return {"input_ids": ids, "labels": ids}
