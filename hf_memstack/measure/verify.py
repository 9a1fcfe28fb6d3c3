"""verify: run one forward + backward and check that the policy really took effect.

Many failures here are silent: checkpointing set but not active (a model left in eval mode,
set after ``accelerator.prepare``, replaced by ``TrainingArguments(gradient_checkpointing=True)``),
a compile that runs eager, autocast that never reaches the matmuls, trainable parameters that
never get gradients (frozen inputs under reentrant checkpointing, every adapter frozen). This
module observes each of them and reports it as a FAIL line with its cause and fix; it never
raises on a model that trains wrongly (that is what it is for), only on a model it cannot run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .._device import device_of, preserved_rng
from ..data.boundaries import compare_packed_to_separate, is_packed
from ..distributed._ranks import on_every_rank, reraise, runs_collectives, share_error
from ..distributed._stalls import watching
from ..record import MemstackRecord, record_of, unwrap_model
from ..transforms.checkpointing.verify import checkpointing_policy_problems, verify_checkpointing
from ..transforms.compile import compile_policy_problems, verify_compile
from ..transforms.loss_head.verify import verify_loss_head
from ..transforms.optim.verify import optimizer_paused
from ..transforms.precision.apply import precision_policy_problems, verify_precision
from ..transforms.quant.verify import verify_quant
from ..transforms.sequence_parallel.reduce import sequence_parallel_size
from ..transforms.sequence_parallel.verify import shard_for_rank, verify_sequence_parallel
from ..transforms.tiled_mlp import verify_tiled_mlp
from .batch_checks import check_batch, no_labelled_token
from .observe import Observed, observe_step
from .step import LossFn, forward_loss

__all__ = ["Check", "VerifyReport", "verify"]


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict: its name, whether it passed, and what was seen (with the cause and fix on failure)."""

    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class VerifyReport:
    """What one observed step showed; ``ok`` when every check passed."""

    checks: list[Check] = field(default_factory=list)
    saved_activation_bytes: int = 0
    """Bytes saved for backward outside checkpointed regions (checkpointing shrinks this)."""
    recomputed_blocks: list[int] = field(default_factory=list)
    compiled_calls: int = 0
    forward_flops: int = 0
    """FLOPs of the forward (matmuls and attention, as ``torch.utils.flop_counter`` counts them)."""
    backward_flops: int = 0
    """FLOPs of the backward, recompute included."""
    recompute_flops: int = 0
    """The part of ``backward_flops`` spent re-running checkpointed forward code."""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def __str__(self) -> str:
        return "\n".join(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks)


def verify(
    model: nn.Module, batch: object, *, loss_fn: LossFn | None = None, raise_on_failure: bool = False
) -> VerifyReport:
    """Run one forward + backward on ``batch`` and check what ``prepare_model`` promised.

    Checks:
        * ``policy``: what runs is what ``model.memstack`` records (nothing re-applied or replaced
          checkpointing, autocast or compile after ``prepare_model``);
        * ``checkpointing``: the blocks meant to be checkpointed re-run their forward during
          backward (observed with hooks on their submodules), and no others do; the FLOPs the
          backward spends recomputing (``torch.utils.flop_counter``), which selective checkpointing
          keeps below full checkpointing's (else no op of its save list ran: a FAIL);
        * ``precision``: under mixed precision, Linear layers compute in the autocast dtype and
          the loss comes back in fp32;
        * ``gradients``: every parameter with ``requires_grad`` received a finite gradient - but one the
          loss cannot give a gradient (its module's output leads to it, the loss's graph does not: LLaVA's
          vision ``post_layernorm``) is a note to freeze it, not a failure
          (:mod:`hf_memstack.measure.grad_reach`);
        * ``compile``: the compiled graphs were called in a compiled step (a second pass);
        * ``loss`` (chunked loss head): the chunked loss equals the model's own on the first sample;
        * ``quant`` (4-bit base weights): which parameters are 4-, 16- and 32-bit; the 4-bit layers
          still are (nothing dequantized or upcast them after ``prepare_model``) and the adapters on
          them got gradients.
        * ``mlp`` (tiled MLP): each tiled MLP ran in tiles in the forward and recomputed them in the backward;
        * ``packing`` (a packed batch: ``position_ids`` restarting inside a row): the per-token
          losses of the packed rows equal those of each sample run alone (its first 8 samples).
        * ``sequence parallel`` (``sp:N``): the sharded step's loss (summed over the sequence group)
          and gradients (reduced as training reduces them) equal the same step on the whole rows with
          the attention unsharded (fp32: 1e-3 relative; bf16/fp16: 5e-2). Every rank of a group passes
          the same whole rows; the other checks then observe this rank's slice of them.

    An optimizer stepping in the backward (``make_optimizer`` with ``optim:in_backward``) is
    paused meanwhile. ``model`` may be the prepared model or a DDP, PEFT or ``torch.compile`` wrapper around it.
    The model's parameters are not updated (no optimizer step); gradients that were there before
    and the RNG state are restored afterwards.

    Under FSDP or DDP every rank must call it (its forward and backward hold collectives); an error
    on one rank - a batch without labels, a model that was not prepared, a failed check with
    ``raise_on_failure`` - is then raised on every rank, naming that rank and its message.

    Raises:
        ValueError: ``model`` was not prepared by :func:`prepare_model`; a bad ``batch``, before any
            forward (:func:`hf_memstack.measure.batch_checks.check_batch`): a tensor with 0 rows or 0
            tokens, labels or an attention mask of another shape than ``input_ids``, ids outside the
            vocabulary. A batch whose every label is -100 runs, and fails the ``gradients`` check (its
            loss is nan, its gradients 0: nothing trains on it), as any loss that is not finite does.
        TypeError: ``input_ids`` that are not integers.
        RuntimeError: with ``raise_on_failure=True``, when a check fails (the report is in the message).
        DistributedMismatchError: under FSDP/DDP or sp:N, on the other ranks when one rank raised.
    """
    # sp:N's all-to-alls are collectives of every step, whatever wraps the model.
    shared = runs_collectives(model) or sequence_parallel_size(model) > 1
    # The checks of the model and the batch that each rank makes alone, agreed before any collective:
    # a rank that raised here while the others went on into the forward would leave them waiting.
    record = on_every_rank("verify: the model and the batch", lambda: _record(model, batch), shared=shared)
    report = VerifyReport()
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    paused = optimizer_paused(model)
    error: BaseException | None = None
    try:
        # An optimizer stepping in the backward would update the weights: verify must not.
        with preserved_rng(device_of(model)), paused:
            _verify_into(report, model, batch, loss_fn, record, params, shared=shared)
    except Exception as e:  # noqa: BLE001 - shared with the other ranks below, then re-raised
        error = e
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    if error is None and raise_on_failure and not report.ok:
        error = RuntimeError(f"hf_memstack.measure.verify found problems:\n{report}")
    if shared:
        share_error("verify", error)  # the other ranks raise too, instead of training on without this one
    elif error is not None:
        reraise(error)
    return report


def _record(model: nn.Module, batch: object) -> MemstackRecord:
    """The model's record, once the model and the batch passed the checks this rank makes alone."""
    record = record_of(model)
    if record is None:
        raise ValueError(
            f"verify needs a model returned by prepare_model; this {type(model).__name__} has no model.memstack record"
        )
    # Before any forward: a bad batch is named here, not in torch's words deep in the model.
    check_batch(model, batch, where="verify")
    return record


def _verify_into(
    report: VerifyReport,
    model: nn.Module,
    batch: object,
    loss_fn: LossFn | None,
    record: MemstackRecord,
    params: list[nn.Parameter],
    *,
    shared: bool,
) -> None:
    for p in params:
        p.grad = None
    report.checks.append(_check_policy(model, record))
    sequence_check, whole = None, batch
    if record.policy.sequence_parallel.size > 1:
        # First, on the whole rows; the checks below observe the step a training loop runs: this rank's slice.
        sequence_check = _check_sequence_parallel(model, batch, loss_fn, record, params)
        if isinstance(batch, Mapping):
            batch = shard_for_rank(model, dict(batch))
    # Observe the eager computation: under a compiled model, hooks and autocast run inside the graph.
    stance = torch.compiler.set_stance("force_eager") if record.compile.regions else contextlib.nullcontext()
    with stance:
        observed = observe_step(model, batch, loss_fn, record, shared=shared)
        loss_check = (
            Check("loss", *verify_loss_head(model, batch, loss_fn, mixed=record.precision.mixed, shared=shared))
            if record.loss.mode == "chunked"
            else None
        )
        packing_check = _check_packing(model, batch, record, shared=shared)
    report.saved_activation_bytes = observed.saved_bytes
    report.recomputed_blocks = observed.recomputed
    report.forward_flops, report.backward_flops = observed.flops.forward, observed.flops.backward
    report.recompute_flops = observed.flops.recompute
    # The checks in the report's order. Each feature's check sits beside its apply_* in transforms/
    # (verify only composes them); the gradients and packing checks are the step's own.
    checks: list[Check | None] = [
        _check_checkpointing(model, record, observed),
        Check(
            "precision",
            *verify_precision(record.precision, record.autocast_by, observed.linear_dtypes, observed.loss_dtype),
        ),
        _check_gradients(
            model, params, record, observed, None if loss_fn is not None else no_labelled_token(model, whole)
        ),
        Check("quant", *verify_quant(model, record.quant))
        if record.quant.layers or record.policy.quant.mode != "none"
        else None,
        loss_check,
        Check("mlp", *verify_tiled_mlp(record.mlp, observed.tiles, observed.backward_error))
        if record.mlp.mode == "tiled"
        else None,
        packing_check,
        sequence_check,
    ]
    report.checks += [c for c in checks if c is not None]
    if record.compile.regions and observed.backward_error is None:
        for p in params:
            p.grad = None
        report.checks.append(_check_compile(report, model, batch, loss_fn, record, shared=shared))


def _check_policy(model: nn.Module, record: MemstackRecord) -> Check:
    """Compare what runs now with what the record says was applied (each feature says what it sees)."""
    inner = unwrap_model(model)
    problems = [
        *precision_policy_problems(inner, record.precision, record.autocast_by),
        *checkpointing_policy_problems(record.blocks, record.checkpointing, record.policy.checkpointing),
        *compile_policy_problems(model, inner, record.compile, record.policy.compile),
    ]
    if problems:
        return Check(
            "policy",
            False,
            "; ".join(problems) + ". Prepare a fresh model with the policy you want and leave "
            "these settings to it (hf_memstack.integrations.trainer.training_arguments does for Trainer)",
        )
    return Check("policy", True, f"what runs matches model.memstack ({record.policy.to_string()})")


def _check_checkpointing(model: nn.Module, record: MemstackRecord, observed: Observed) -> Check:
    ok, detail = verify_checkpointing(
        record.checkpointing,
        model,
        recomputed=observed.recomputed,
        saved_bytes=observed.saved_bytes,
        flops=observed.flops,
        selective_saved_nothing=observed.selective_saved_nothing,
        backward_error=observed.backward_error,
    )
    return Check("checkpointing", ok, detail)


def _check_packing(model: nn.Module, batch: object, record: MemstackRecord, *, shared: bool) -> Check | None:
    """A packed batch's rows against each of their first samples run alone (None: not a packed
    batch, or a model whose forward is a collective: each rank's rows hold other samples, so the
    per-sample forwards would not pair up across ranks; compare on one process)."""

    if shared or not isinstance(batch, dict) or not is_packed(batch.get("position_ids"), batch.get("attention_mask")):
        return None  # (under sp:N shared: the sequence parallel line compares the packed rows unsharded)
    # fp32: the same arithmetic in other kernels (masked against causal attention); bf16/fp16: their rounding.
    tolerance = 5e-2 if record.precision.mixed else 5e-3
    comparison = compare_packed_to_separate(model, batch, tolerance=tolerance)
    return Check("packing", comparison.ok, comparison.describe())


def _check_sequence_parallel(
    model: nn.Module,
    batch: object,
    loss_fn: LossFn | None,
    record: MemstackRecord,
    params: list[nn.Parameter],
) -> Check:
    if not isinstance(batch, Mapping):
        return Check(
            "sequence parallel",
            False,
            f"not compared: sp:{record.policy.sequence_parallel.size} shards a batch given as a mapping (input_ids, labels, "
            f"position_ids), not a {type(batch).__name__}; pass verify the rows as a dict",
        )
    if loss_fn is not None:
        return Check(
            "sequence parallel",
            False,
            "not compared: a loss_fn sees one rank's slice of the rows, and only the model's own loss (over "
            "shard_batch's shifted labels and token count) adds up over the sequence group; verify without loss_fn",
        )
    rows = dict(batch)
    return Check("sequence parallel", *verify_sequence_parallel(model, rows, params, mixed=record.precision.mixed))


def _check_gradients(
    model: nn.Module, params: list[nn.Parameter], record: MemstackRecord, observed: Observed, unlabelled: str | None
) -> Check:
    """Every trainable parameter got a finite gradient from a finite loss; ``unlabelled``: why the
    batch trains nothing (every label -100), when it does not (its gradients, all 0, would pass)."""
    if not params:
        return Check(
            "gradients",
            False,
            "no parameter requires grad: nothing would train. Unfreeze some (requires_grad_(True)) "
            "or check the PEFT config (every adapter frozen?)",
        )
    if observed.backward_error is not None:
        return Check("gradients", False, f"{observed.backward_error}. {_frozen_input_hint(record)}")
    names = {id(p): n for n, p in model.named_parameters()}
    unreached = observed.unreached
    unused = [names.get(id(p), "?") for p in params if p.grad is None and id(p) in unreached.unused]
    missing = [names.get(id(p), "?") for p in params if p.grad is None and id(p) not in unreached.unused]
    bad = [
        names.get(id(p), "?")
        for p in params
        if p.grad is not None and not torch.isfinite(p.grad.detach().float()).all()
    ]
    got = len(params) - len(unused) - len(missing) - len(bad)
    detail = f"{got}/{len(params)} trainable parameters got finite gradients"
    if missing:
        detail += f"; no gradient: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        if unreached.cut:
            detail += (
                f". The output of {list(unreached.cut)[:3]} needs no gradient although it holds trainable parameters: "
                "a hook or its forward detached it (or ran it under torch.no_grad), so nothing before it trains"
            )
        if len(missing) + len(unused) == len(params) or record.policy.checkpointing.use_reentrant:
            detail += f". {_frozen_input_hint(record)}"
    if bad:
        detail += f"; non-finite: {bad[:5]}"
    if unused:
        detail += f"; {_unused_note(unused)}"
    if unlabelled is not None:
        detail += f"; {unlabelled}"
    elif not observed.loss_finite:  # its gradients can still be finite (all 0 when no token counts): no [ok] for them
        detail += (
            "; the loss is not finite (nan or inf), so no gradient of this step means anything: check the weights "
            "(torch.isfinite on each parameter), the labels (a batch or rank whose labels are all -100) and loss_fn"
        )
    return Check("gradients", not missing and not bad and observed.loss_finite and unlabelled is None, detail)


def _unused_note(unused: list[str]) -> str:
    """Not a failure: the unprepared model gives these no gradient either (LLaVA's vision post_layernorm)."""
    return (
        f"note: {len(unused)} trainable parameter(s) the loss does not use: {unused[:5]}{' ...' if len(unused) > 5 else ''}"
        " - the model's forward computes nothing from them that reaches the loss; freeze them "
        "(requires_grad_(False)) to save their optimizer state"
    )


def _frozen_input_hint(record: MemstackRecord) -> str:
    if record.policy.checkpointing.mode != "none" and record.policy.checkpointing.use_reentrant:
        return (
            "Likely cause: reentrant checkpointing with block inputs that do not require grad (frozen embeddings, "
            "LoRA) drops the gradients; fix: use_reentrant=False (the default), or model.enable_input_require_grads()"
        )
    return "Check which parameters are frozen (requires_grad) and that the loss depends on them"


def _check_compile(
    report: VerifyReport,
    model: nn.Module,
    batch: object,
    loss_fn: LossFn | None,
    record: MemstackRecord,
    *,
    shared: bool,
) -> Check:
    def compiled_step() -> None:
        loss = on_every_rank("verify: the compiled forward", lambda: forward_loss(model, batch, loss_fn), shared=shared)
        with watching("verify: the compiled backward", shared=shared):
            loss.backward()

    ok, detail, report.compiled_calls = verify_compile(record.compile, compiled_step)
    return Check("compile", ok, detail)
