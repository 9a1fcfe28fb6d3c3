"""One estimate's job traced on fake tensors: the model built, prepared under the policy, and one
training step (or one eval forward) metered; and which shallow depths stand for a deep stack."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...data.boundaries import packing_as_traced
from ...measure.memory import PhasePeaks, trace_eval_forward
from ...policy import MemoryPolicy
from ...prepare import prepare_model
from ...record import record_of
from ...transforms.loss_head.chunked import labelled_as_traced
from ...transforms.optim.optimizer import make_optimizer
from ...transforms.packed_attention import per_sample_as_traced
from ..model.config import build_model
from ..model.fake import (
    blocks_or_empty,
    build_fake_model,
    build_key,
    fake_batch,
    quant_counts,
    traced_step,
    values_kept,
)
from ..model.fake_experts import experts_on_fake_tensors
from ..model.vision_inputs import ImageSpec
from . import build_cache
from .depth import DepthPlan, FullTrace, _peft_picks_blocks, plan_depths
from .eval_logits import kept_outputs
from .fsdp_dtypes import compute_dtypes, forget_copies
from .sequence_shards import SequenceShards, sharded_batch, ulysses_on_fake_tensors
from .weights_dtype import WeightsDtype, set_dtypes

if TYPE_CHECKING:
    from peft import PeftConfig
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import PretrainedConfig

__all__ = ["Job", "Traced", "depth_plan", "trace"]


@dataclass(frozen=True, slots=True)
class Job:
    """What one estimate traces, besides the config."""

    task: str
    peft_config: PeftConfig | None
    trust_remote_code: bool
    weights: WeightsDtype
    policy: MemoryPolicy
    """The traced policy (no compile, no FSDP: those are accounted for after the trace)."""
    optimizer: str
    batch_size: int
    seq_len: int
    packed: bool
    mode: str = "train"
    packed_per_sample: bool = True
    """Packed rows' SDPA runs per sample (``hf_memstack_sdpa``): not under the policy's compile, which runs rows whole."""
    foreach: bool = False
    """PyTorch's AdamW steps with its foreach kernels (its default on CUDA), as traced."""
    label_fraction: float = 1.0
    """The share of positions with a label: the chunked head's rows, as traced."""
    keep_outputs: bool = False
    """The loop keeps the model's outputs through the backward (``outputs.loss.backward()``), as traced."""
    images: ImageSpec | None = None
    """A vision-language model's images per sample (None: a text model's batch)."""
    sharded: bool = False
    """The policy shards with FSDP over several ranks: traced in the dtypes a rank computes in (:mod:`.fsdp_dtypes`)."""
    sp: SequenceShards | None = None
    """sp:N: one rank of N traced (``seq_len`` its tokens), its attention the real Ulysses over a shapes-only group."""


@dataclass(frozen=True, slots=True)
class Traced:
    net: nn.Module
    phases: PhasePeaks
    counts: dict[str, int]
    """Parameters (``total``, ``trainable``) and the 4-bit layers' numbers (``quant_*``)."""


def trace(config: PretrainedConfig, job: Job) -> Traced:
    """The model of ``config`` built on fake tensors, prepared, and one training step traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    net = build_fake_model(config, job.task, job.peft_config, job.trust_remote_code, mode, job.weights)
    experts = experts_on_fake_tensors(net, config)  # before the trace: a refusal says what to change
    if job.mode == "eval":
        return _trace_eval(net, config, job, mode, experts)
    with mode, experts, _quiet_prepare(training=True), values_kept(mode, job.images):
        net.train()
        prepare_model(net, job.policy)
        params = [p for p in net.parameters() if p.requires_grad]
        # The optimizer the policy asks for, built as users build it (fp32 or 8-bit moments, stepped
        # after or in the backward), so its state is traced as it will be allocated.
        opt = make_optimizer(net, job.policy, lr=1e-4) if job.optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4)
        if job.foreach and type(opt) is torch.optim.AdamW:
            # The fake tensors are on the CPU, where AdamW would loop; on CUDA it defaults to foreach,
            # whose step holds a copy of every second moment at once: traced as it will run.
            for group in opt.param_groups:
                group["foreach"] = True
        batch = fake_batch(
            config, job.task, job.batch_size, job.seq_len, packed=job.packed, images=job.images, mode=mode
        )
        batch = sharded_batch(batch, job.sp)
        with (
            packing_as_traced(job.packed),
            per_sample_as_traced(job.packed_per_sample),
            labelled_as_traced(job.label_fraction),
            _as_a_rank_computes(net, job.sharded),
            ulysses_on_fake_tensors(net, job.sp),
        ):
            phases = traced_step(net, batch, opt, config, job.task, keep_outputs=job.keep_outputs)
    counts = {
        "total": sum(p.numel() for p in net.parameters()),
        "trainable": sum(p.numel() for p in params),
        "kept_outputs": phases.kept,
        **quant_counts(net),
    }
    return Traced(net=net, phases=phases, counts=counts)


def _trace_eval(
    net: nn.Module,
    config: PretrainedConfig,
    job: Job,
    mode: FakeTensorMode,
    experts: contextlib.AbstractContextManager[object],
) -> Traced:
    """The prepared model in eval mode, one forward of the eval batch traced under ``torch.no_grad()``;
    the outputs Trainer keeps of it counted (per batch: a line in the depth, flat)."""

    with mode, experts, _quiet_prepare(training=False), values_kept(mode, job.images):
        net.eval()
        prepare_model(net, job.policy)
        batch = fake_batch(
            config, job.task, job.batch_size, job.seq_len, packed=job.packed, images=job.images, mode=mode
        )
        with packing_as_traced(job.packed), per_sample_as_traced(job.packed_per_sample):
            phases, outputs = trace_eval_forward(net, batch, blocks=blocks_or_empty(net))
    kept = kept_outputs(outputs, getattr(config, "keys_to_ignore_at_inference", ["cache"]))
    params = [p for p in net.parameters() if p.requires_grad]
    counts = {
        "total": sum(p.numel() for p in net.parameters()),
        "trainable": sum(p.numel() for p in params),
        "kept": kept.device_bytes,
        "kept_host": kept.host_bytes,
        **quant_counts(net),
    }
    return Traced(net=net, phases=phases, counts=counts)


def _as_a_rank_computes(net: nn.Module, sharded: bool) -> contextlib.AbstractContextManager[object]:
    """Under FSDP's mixed precision, the step in the compute dtype a rank gathers and casts to."""
    record = record_of(net)  # the precision prepare_model resolved ("auto": the target device's)
    precision = getattr(record, "precision", None)
    if not sharded or precision is None or not precision.mixed:
        forget_copies(net)  # a model built once and traced again (build_cache) keeps no earlier reading
        return contextlib.nullcontext()
    return compute_dtypes(net, precision.dtype)


@contextlib.contextmanager
def _quiet_prepare(*, training: bool) -> Iterator[None]:
    """prepare_model's warnings about the machine it runs on, silenced while tracing: an estimate is of
    the job on its target device (a plan made on a laptop for a GPU), and the planner picks the precision
    itself. Out of training, also its warning that 16-bit trainable weights lose precision in updates."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*bf16 is emulated and about 2x slower", category=UserWarning)
        if not training:
            warnings.filterwarnings("ignore", message=".*optimizer updates then lose precision", category=UserWarning)
        yield


def depth_plan(config: PretrainedConfig, job: Job) -> DepthPlan | FullTrace | None:
    """Which shallow depths to trace for this job, or why every block is traced (None: the full
    trace says what is wrong with the config)."""

    def build(cfg: PretrainedConfig) -> nn.Module:
        with torch.device("meta"):
            net = build_model(cfg, job.task, trust_remote_code=job.trust_remote_code, dtype=job.weights.dtype)
            if job.weights.per_parameter:
                set_dtypes(net, job.weights.per_parameter)
        return net

    if job.images is not None:
        # Two stacks (the vision tower's, the language model's), cut by the config's text depth alone: no line.
        return FullTrace("a vision-language model: its vision tower's and language model's blocks are all traced")
    if job.task == "seq2seq-lm":
        # Two stacks (the encoder's, the decoder's), whose depths the config sets apart: no line.
        return FullTrace("an encoder-decoder: its encoder's and decoder's blocks are all traced")
    ck = job.policy.checkpointing
    every_n = ck.every_n if ck.mode == "every_n" else 1

    def plan() -> DepthPlan | FullTrace | None:
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
    return build_cache.cached("depth_plans", key, plan)
