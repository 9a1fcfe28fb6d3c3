"""MemoryEstimate: what estimate_memory returns - one step's peak per rank by category, the
dtypes it counted, its notes - and the one-line summary ``hf-memstack estimate`` prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...sizes import format_bytes

__all__ = ["MemoryEstimate"]


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
    """Parameters and buffers, frozen ones included (FSDP: this rank's shards plus the root's parameters gathered
    in the compute dtype - embeddings, final norm, head - which FSDP holds through the forward and backward)."""
    gradients: int
    """Gradients of the trainable parameters."""
    optimizer: int
    """Optimizer state of the trainable parameters."""
    activations: int
    """Activations alive at the end of the forward (what the backward needs: the meter's
    ``saved_activations``), at most what the peak holds besides the model states."""
    temporaries: int
    """The rest of the peak besides the model states and ``activations``: transient buffers, logits
    and their gradients. Not MemTracker's own split of the peak moment (the meter's ``activations``
    and ``temporaries``, which labels by where a tensor was made: a recomputed block's activations
    count as activations there), whose sum is the same."""
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
    activations_per_block: int = 0
    """The activations the forward leaves per block of the stack (the depth extrapolation's slope; 0 when
    every block was traced): ``activations`` holds at least this times ``blocks`` (the planner checks it)."""
    blocks: int = 0
    """The model's blocks (0 when traced in full)."""
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

    keep_outputs: bool = False
    """Train mode: the loop counted keeps the model's outputs through the backward
    (``outputs = model(**batch); outputs.loss.backward()``); False: it drops them once the loss is
    taken (Trainer, the recipe), as ``estimate_memory(keep_outputs=False)``, the default, counts."""
    kept_outputs_bytes: int = 0
    """With ``keep_outputs``: the outputs that loop holds (fp32 logits under a mixed precision): alive
    when the forward ends, so in ``activations``, through the backward and the optimizer step; and the
    previous step's through the forward, until ``outputs`` is rebound. 0 when they are dropped."""

    sequence_parallel: int = 1
    """Ranks each row's tokens are sharded over (``sp:N``; 1: none). Under it the step is one rank's: traced at
    ``sp_tokens_per_rank`` tokens (:mod:`hf_memstack.planning.estimate.sequence_shards`), ``seq_len`` the row's."""
    sp_tokens_per_rank: int = 0
    """Under ``sp:N``: each rank's tokens of a row, ``ceil(seq_len / N)`` (0 without it)."""
    sp_all_to_all_bytes: int = 0
    """Under ``sp:N``: one block's all-to-all buffers (send copy and receive buffer of q and the repeated k/v,
    the gathered position ids), in ``temporaries`` and the peak; never more than one block's at a time."""
    sp_kv_repeat_bytes: int = 0
    """Under ``sp:N`` with fewer kv heads than N divide: the repeated keys and values the blocks that are not
    checkpointed keep for the backward, beyond the traced ones, in ``activations`` and the peak."""

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
        kept = f"; the loop keeps its outputs ({format_bytes(self.kept_outputs_bytes)})" if self.keep_outputs else ""
        sp = (
            f", {self.sp_tokens_per_rank} tokens per rank (sp:{self.sequence_parallel})"
            if self.sequence_parallel > 1
            else ""
        )
        return (
            f"{self.model} [{self.policy}] {self.weights_dtype} weights, batch {self.batch_size} x seq {self.seq_len}, "
            f"{self.world_size} rank(s){sp}: peak {format_bytes(self.peak_bytes)} in the {self.peak_phase} phase ({cats}){kept}"
        )
