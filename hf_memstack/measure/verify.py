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
import gc
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._device import device_of, module_mode, preserved_rng
from ..distributed._ranks import on_every_rank, reraise, runs_collectives, share_error
from ..record import MemstackRecord, record_of, unwrap_model
from ..transforms._wrappers import forward_wrapper
from ..transforms.quant_verify import verify_quant
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


@dataclass(slots=True)
class _Observed:
    """What the hooks saw during one forward + backward."""

    saved_bytes: int = 0
    recomputed: list[int] = field(default_factory=list)
    linear_dtypes: set[torch.dtype] = field(default_factory=set)
    loss_dtype: torch.dtype | None = None
    selective_saved_nothing: bool = False
    """Selective checkpointing warned that no op of its save list ran in a checkpointed block."""
    backward_error: str | None = None
    """Why the backward could not run (the loss needs no gradient), or None."""
    flops: _Flops = field(default_factory=lambda: _Flops())
    tiles: dict[int, list[int]] = field(default_factory=dict)
    """Per tiled MLP (block index): the calls of its first submodule in the forward and in the backward."""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensors hook: counts what the forward saves for the backward (outside checkpoints)."""
        self.saved_bytes += t.numel() * t.element_size()
        return t


def verify(
    model: nn.Module, batch: Any, *, loss_fn: LossFn | None = None, raise_on_failure: bool = False
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
        * ``gradients``: every parameter with ``requires_grad`` received a finite gradient;
        * ``compile``: the compiled graphs were called in a compiled step (a second pass);
        * ``loss`` (chunked loss head): the chunked loss equals the model's own on the first sample;
        * ``quant`` (4-bit base weights): which parameters are 4-, 16- and 32-bit; the 4-bit layers
          still are (nothing dequantized or upcast them after ``prepare_model``) and the adapters on
          them got gradients.
        * ``mlp`` (tiled MLP): each tiled MLP ran in tiles in the forward and recomputed them in the backward;
        * ``packing`` (a packed batch: ``position_ids`` restarting inside a row): the per-token
          losses of the packed rows equal those of each sample run alone (its first 8 samples).

    An optimizer stepping in the backward (``make_optimizer`` with ``optim:in_backward``) is
    paused meanwhile. ``model`` may be the prepared model or a DDP, PEFT or ``torch.compile`` wrapper around it.
    The model's parameters are not updated (no optimizer step); gradients that were there before
    and the RNG state are restored afterwards.

    Under FSDP or DDP every rank must call it (its forward and backward hold collectives); an error
    on one rank - a batch without labels, a model that was not prepared, a failed check with
    ``raise_on_failure`` - is then raised on every rank, naming that rank and its message.

    Raises:
        ValueError: ``model`` was not prepared by :func:`prepare_model`; an empty ``batch`` (a
            tensor with 0 rows or 0 tokens).
        RuntimeError: with ``raise_on_failure=True``, when a check fails (the report is in the message).
        DistributedMismatchError: under FSDP/DDP, on the other ranks when one rank raised.
    """
    from ..transforms.optim_in_backward import optimizer_in_backward_of

    shared = runs_collectives(model)
    record = on_every_rank("verify: the model's record", lambda: _record(model), shared=shared)
    report = VerifyReport()
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    stepping = optimizer_in_backward_of(model)
    error: BaseException | None = None
    try:
        # An optimizer stepping in the backward would update the weights: verify must not.
        with preserved_rng(device_of(model)), stepping.paused() if stepping is not None else contextlib.nullcontext():
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


def _record(model: nn.Module) -> MemstackRecord:
    record = record_of(model)
    if record is None:
        raise ValueError(
            f"verify needs a model returned by prepare_model; this {type(model).__name__} has no model.memstack record"
        )
    return record


def _verify_into(
    report: VerifyReport,
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None,
    record: MemstackRecord,
    params: list[nn.Parameter],
    *,
    shared: bool,
) -> None:
    _refuse_empty(batch)
    for p in params:
        p.grad = None
    report.checks.append(_check_policy(model, record))
    # Observe the eager computation: under a compiled model, hooks and autocast run inside the graph.
    stance = torch.compiler.set_stance("force_eager") if record.compile.regions else contextlib.nullcontext()
    with stance:
        observed = _observe_step(model, batch, loss_fn, record, shared=shared)
        loss_check = (
            _check_loss_head(model, batch, loss_fn, record, shared=shared) if record.loss.mode == "chunked" else None
        )
        packing_check = _check_packing(model, batch, record, shared=shared)
    report.saved_activation_bytes = observed.saved_bytes
    report.recomputed_blocks = observed.recomputed
    report.forward_flops, report.backward_flops = observed.flops.forward, observed.flops.backward
    report.recompute_flops = observed.flops.recompute
    report.checks.append(_check_checkpointing(report, record, model, observed))
    report.checks.append(_check_precision(record, observed))
    report.checks.append(_check_gradients(model, params, record, observed))
    if record.quant.layers or record.policy.quant.mode != "none":
        report.checks.append(Check("quant", *verify_quant(model, record.quant)))
    if loss_check is not None:
        report.checks.append(loss_check)
    if record.mlp.mode == "tiled":
        report.checks.append(_check_tiles(record, observed))
    if packing_check is not None:
        report.checks.append(packing_check)
    if record.compile.regions and observed.backward_error is None:
        for p in params:
            p.grad = None
        report.checks.append(_check_compile(report, model, batch, loss_fn, record, shared=shared))


def _refuse_empty(batch: Any) -> None:
    """An empty batch (0 rows or 0 tokens) runs no step to check: the model's own forward fails
    deep inside (a reshape), so say which field is empty instead."""
    from collections.abc import Mapping

    if isinstance(batch, Mapping):
        fields = [(f"batch[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (list, tuple)):
        fields = [(f"batch[{i}]", v) for i, v in enumerate(batch)]
    else:
        fields = [("batch", batch)]
    for name, value in fields:
        if torch.is_tensor(value) and value.ndim > 0 and value.numel() == 0:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}: an empty batch (0 rows or 0 tokens) runs no step to "
                "verify; pass a batch of at least one sample with at least one token"
            )


def _observe_step(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, record: MemstackRecord, *, shared: bool
) -> _Observed:
    from torch.utils.flop_counter import FlopCounterMode

    observed = _Observed()
    phase = _Phase()
    counter = FlopCounterMode(display=False)
    handles, backward_calls = _watch(model, record, observed, counter, phase)
    try:
        # Selective checkpointing says, when a block's contexts are done with (after its forward if it
        # kept nothing, else after its backward), whether the block kept anything: listen throughout.
        with _selective_warnings() as caught:
            with counter, torch.autograd.graph.saved_tensors_hooks(observed.pack, lambda t: t):
                # Agreed before the backward, whose collectives a rank that failed here would never reach.
                loss = on_every_rank("verify: the forward", lambda: forward_loss(model, batch, loss_fn), shared=shared)
            observed.flops.forward = counter.get_total_flops()
            observed.loss_dtype = loss.dtype
            phase.backward = True
            every_rank_needs_grad = (
                share_error("verify: the loss needs gradients", None, values=(int(loss.requires_grad),))[0]
                if shared
                else loss.requires_grad
            )
            if every_rank_needs_grad:
                with counter:
                    loss.backward()
                observed.flops.backward = counter.get_total_flops()  # entering the counter again reset it
            elif loss.requires_grad:
                observed.backward_error = (
                    "the loss does not require grad on another rank, so no rank runs the backward "
                    "(its collectives need every rank)"
                )
            else:
                observed.backward_error = "the loss does not require grad: no trainable parameter contributes to it"
            del loss  # the checkpoints' frames sit in reference cycles: free them while listening
            gc.collect()
        observed.selective_saved_nothing = bool(caught)
    finally:
        phase.backward = False
        for h in handles:
            h.remove()
    observed.recomputed = [i for i, n in enumerate(backward_calls) if n]
    return observed


class _Phase:
    """Whether the observed step is in its backward (read by the hooks)."""

    backward = False


def _watch(
    model: nn.Module, record: MemstackRecord, observed: _Observed, counter: Any, phase: _Phase
) -> tuple[list[Any], list[int]]:
    """Forward hooks counting each block's runs in the backward (its recompute), each tiled MLP's
    tiles in the forward and the backward, and the Linear outputs' dtypes; the FLOP watch on the
    checkpointed blocks. Returns the handles and the per-block backward run counts."""
    blocks = record.blocks.modules if record.blocks is not None else ()
    backward_calls = [0] * len(blocks)
    checkpointed = set(record.checkpointing.checkpointed)

    def block_hook(i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if phase.backward:
                backward_calls[i] += 1

        return hook

    def linear_hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_tensor(output):
            observed.linear_dtypes.add(output.dtype)

    def tile_hook(i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training:  # not the packed-batch guard's probe (it runs in eval mode)
                observed.tiles.setdefault(i, [0, 0])[int(phase.backward)] += 1

        return hook

    # Submodules, not the block itself: checkpointing re-runs the block's forward function, not
    # its __call__, so only inner modules re-run visibly (their hooks fire during backward). A tiled
    # MLP recomputes its tiles in the backward on its own: its modules are watched apart.
    mlps = _tiled_mlps(record)
    inside_mlps = {id(m) for mlp in mlps.values() for m in mlp.modules()}
    handles = [
        sub.register_forward_hook(block_hook(i))
        for i, block in enumerate(blocks)
        for sub in block.modules()
        if id(sub) not in inside_mlps
    ]
    handles += [next(mlp.children(), mlp).register_forward_hook(tile_hook(i)) for i, mlp in mlps.items()]
    handles += [sub.register_forward_hook(linear_hook) for sub in model.modules() if isinstance(sub, nn.Linear)]
    handles += observed.flops.watch(
        [b for i, b in enumerate(blocks) if i in checkpointed], counter, lambda: phase.backward
    )
    return handles, backward_calls


@contextlib.contextmanager
def _selective_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Collect selective checkpointing's "nothing saved" warnings (each recompute would give one);
    every other warning is passed on as it came."""
    from ..transforms.checkpointing import SelectiveCheckpointingWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours: list[warnings.WarningMessage] = []
        yield ours
    for w in caught:
        if issubclass(w.category, SelectiveCheckpointingWarning):
            ours.append(w)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


@dataclass(slots=True)
class _Flops:
    """FLOPs of the step, and those spent inside checkpointed blocks (forward, and recompute in backward)."""

    forward: int = 0
    backward: int = 0
    checkpointed_forward: int = 0
    """FLOPs of the checkpointed blocks' forward: what full checkpointing recomputes."""
    recompute: int = 0
    _depth: int = 0
    _start: int = 0

    def watch(self, blocks: list[nn.Module], counter: Any, in_backward: Any) -> list[Any]:
        """Hooks on the blocks' submodules that add the counter's FLOPs while one of them runs."""

        def enter(module: nn.Module, args: Any) -> None:
            if self._depth == 0:
                self._start = counter.get_total_flops()
            self._depth += 1

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            self._depth -= 1
            if self._depth == 0:
                spent = counter.get_total_flops() - self._start
                if in_backward():
                    self.recompute += spent
                else:
                    self.checkpointed_forward += spent

        subs = [sub for block in blocks for sub in block.children()]
        # always_call: a recompute stops early (once it has what the backward needs) by raising
        # through the module that runs; its FLOPs so far still count, and the depth stays right.
        return [
            h
            for sub in subs
            for h in (sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave, always_call=True))
        ]


def _check_policy(model: nn.Module, record: MemstackRecord) -> Check:
    """Compare what runs now with what the record says was applied."""
    inner = unwrap_model(model)
    problems = []
    if (
        "_original_forward" in inner.__dict__
        and record.autocast_by != "accelerator.prepare"
        and record.precision.name != "fp16"
    ):
        # Accelerate's prepare sets _original_forward when it wraps the forward in its own autocast.
        if not record.precision.mixed:
            problems.append(
                "accelerator.prepare (e.g. Trainer with bf16=True/fp16=True) added autocast to a model whose policy "
                "is fp32: it trains in mixed precision while model.memstack says fp32"
            )
    if record.blocks is not None and record.checkpointing.method == "transformers":
        flags = [i for i, b in enumerate(record.blocks.modules) if getattr(b, "gradient_checkpointing", False)]
        if flags != list(record.checkpointing.checkpointed):
            problems.append(
                f"Transformers checkpointing is on for blocks {flags}, but the policy checkpointed "
                f"{list(record.checkpointing.checkpointed)} (gradient_checkpointing_enable/disable was called after prepare_model)"
            )
        reentrant = {_reentrant(b) for i, b in enumerate(record.blocks.modules) if i in flags} - {None}
        if reentrant and reentrant != {record.policy.checkpointing.use_reentrant}:
            problems.append(
                f"blocks checkpoint with use_reentrant={sorted(reentrant)} but the policy says "
                f"use_reentrant={record.policy.checkpointing.use_reentrant}"
            )
    compiled_outside = type(model).__name__ == "OptimizedModule" or (
        record.policy.compile.mode != "full" and getattr(inner, "_compiled_call_impl", None) is not None
    )
    if compiled_outside and not record.compile.regions:
        problems.append(
            "the model was compiled after prepare_model (e.g. TrainingArguments(torch_compile=True)) but the "
            "policy has no compile: put compile in the policy instead, so it is placed after checkpointing"
        )
    elif compiled_outside:
        problems.append(
            f"the model was compiled again after prepare_model (e.g. TrainingArguments(torch_compile=True)) on top of "
            f"the policy's {record.policy.compile.mode} compile: set torch_compile=False"
        )
    if problems:
        return Check(
            "policy",
            False,
            "; ".join(problems) + ". Prepare a fresh model with the policy you want and leave "
            "these settings to it (hf_memstack.integrations.trainer.training_arguments does for Trainer)",
        )
    return Check("policy", True, f"what runs matches model.memstack ({record.policy.to_string()})")


def _reentrant(block: nn.Module) -> bool | None:
    func = getattr(block, "_gradient_checkpointing_func", None)
    keywords = getattr(func, "keywords", None)
    return keywords.get("use_reentrant") if isinstance(keywords, dict) else None


def _check_checkpointing(report: VerifyReport, record: MemstackRecord, model: nn.Module, observed: _Observed) -> Check:
    expected = list(record.checkpointing.checkpointed)
    got = report.recomputed_blocks
    if observed.backward_error is not None:
        return Check("checkpointing", not expected, f"not observed: {observed.backward_error}")
    if not expected:
        ok = not got
        return Check(
            "checkpointing",
            ok,
            "off, and no block recomputed" if ok else f"off, yet blocks {got} recomputed in backward",
        )
    ok = got == expected
    detail = (
        f"blocks {got} recomputed in backward (expected {expected}); {report.saved_activation_bytes / 2**20:.2f} MiB "
        f"saved for backward outside checkpoints; {_recompute_summary(observed.flops)}"
    )
    if observed.selective_saved_nothing:
        ok = False
        detail += (
            ": selective checkpointing recomputed all of the blocks' matmuls, as full checkpointing does - no op in "
            "its save list (hf_memstack.transforms.checkpointing.SAVED_OPS) ran; use checkpointing mode 'full'"
        )
    if not got and not all(m.training for m in model.modules()):
        # A PEFT wrapper made around a model from from_pretrained is in training mode, its model not.
        detail += (
            ": the model (or a module inside it, e.g. the model a PEFT wrapper holds) is in eval mode, and "
            "checkpointing only runs in training; call model.train()"
        )
    elif not ok:
        detail += ": checkpointing is not doing what the policy says"
    return Check("checkpointing", ok, detail)


def _recompute_summary(flops: _Flops) -> str:
    grads = max(1, flops.backward - flops.recompute)
    return (
        f"backward recomputed {flops.recompute / 1e9:.3g} GFLOP, {flops.recompute / grads:+.1%} over the gradients' "
        f"{grads / 1e9:.3g} GFLOP (the checkpointed blocks' forward: {flops.checkpointed_forward / 1e9:.3g} GFLOP)"
    )


def _check_loss_head(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, record: MemstackRecord, *, shared: bool
) -> Check:
    """The chunked loss against the model's own, on the first sample (the model's own forward
    materialises its logits: one sample keeps that small)."""
    from ..transforms.loss_forward import ChunkedLossForward

    one = _first_sample(batch)
    chunked = forward_wrapper(unwrap_model(model), ChunkedLossForward)
    # In eval mode: the check compares the head's arithmetic, so no dropout draws different masks
    # in the two forwards (nor per chunk, for a LoRA head with dropout).
    with torch.no_grad(), module_mode(model, training=False):
        # without gradients, the model's own forward runs
        theirs = on_every_rank("verify: the model's own loss", lambda: forward_loss(model, one, loss_fn), shared=shared)
        with chunked.without_gradients() if chunked is not None else contextlib.nullcontext():
            ours = on_every_rank("verify: the chunked loss", lambda: forward_loss(model, one, loss_fn), shared=shared)
    a, b = float(ours.detach()), float(theirs)
    # fp32: the same sums in another order; bf16/fp16: the head's matmul rounds differently per chunk.
    tolerance = 2e-2 if record.precision.mixed else 1e-4
    ok = abs(a - b) <= tolerance * max(1.0, abs(b))
    detail = f"chunked loss {a:.5f}, the model's own {b:.5f} on the first sample"
    if not ok:
        detail += ": they differ; prepare the model without loss:chunked"
    return Check("loss", ok, detail)


def _tiled_mlps(record: MemstackRecord) -> dict[int, nn.Module]:
    if record.mlp.mode != "tiled" or record.blocks is None:
        return {}
    blocks = record.blocks.modules
    return {i: blocks[i].get_submodule(record.mlp.module_name) for i in record.mlp.tiled}


def _check_tiles(record: MemstackRecord, observed: _Observed) -> Check:
    """Each tiled MLP ran more than one tile in the forward and re-ran every tile in the backward."""
    if observed.backward_error is not None:
        return Check("mlp", False, f"not observed: {observed.backward_error}")
    counts = [observed.tiles.get(i, [0, 0]) for i in record.mlp.tiled]
    forward, backward = min(c[0] for c in counts), min(c[1] for c in counts)
    detail = (
        f"{len(counts)} tiled MLP(s), tiles of {record.mlp.tile_tokens} tokens: at least {forward} tile(s) each in the "
        f"forward, {backward} recomputed in the backward"
    )
    if forward <= 1:
        return Check(
            "mlp",
            True,
            detail + f": this batch fits one tile per row set (<= {record.mlp.tile_tokens} tokens), so "
            "the MLPs ran whole; longer batches run in tiles",
        )
    ok = backward >= forward
    return Check(
        "mlp",
        ok,
        detail
        if ok
        else detail + ": some tiles were not recomputed in the backward - the tiles' "
        "intermediates were kept; prepare the model without mlp:tiled and report it",
    )


def _check_packing(model: nn.Module, batch: Any, record: MemstackRecord, *, shared: bool) -> Check | None:
    """A packed batch's rows against each of their first samples run alone (None: not a packed
    batch, or a model whose forward is a collective: each rank's rows hold other samples, so the
    per-sample forwards would not pair up across ranks; compare on one process)."""
    from ..data.boundaries import compare_packed_to_separate, is_packed

    if shared or not isinstance(batch, dict) or not is_packed(batch.get("position_ids"), batch.get("attention_mask")):
        return None
    # fp32: the same arithmetic in other kernels (masked against causal attention); bf16/fp16: their rounding.
    tolerance = 5e-2 if record.precision.mixed else 5e-3
    comparison = compare_packed_to_separate(model, batch, tolerance=tolerance)
    return Check("packing", comparison.ok, comparison.describe())


def _first_sample(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: v[:1] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(v[:1] if torch.is_tensor(v) and v.dim() > 0 else v for v in batch)
    return batch[:1] if torch.is_tensor(batch) else batch


def _check_precision(record: MemstackRecord, observed: _Observed) -> Check:
    p = record.precision
    dtypes = observed.linear_dtypes
    if not dtypes:
        return Check("precision", True, f"{p.name}: the model has no nn.Linear to observe")
    if not p.mixed:
        return Check("precision", dtypes == {torch.float32}, f"fp32: Linear outputs in {sorted(map(str, dtypes))}")
    ok = p.dtype in dtypes and observed.loss_dtype == torch.float32
    if record.autocast_by == "accelerator.prepare" and p.dtype not in dtypes:
        return Check(
            "precision",
            ok,
            f"Linear outputs {sorted(map(str, dtypes))}: autocast comes from accelerator.prepare(model); verify after it",
        )
    detail = f"Linear outputs in {sorted(map(str, dtypes))}, loss in {observed.loss_dtype}"
    if p.dtype not in dtypes:
        detail += (
            f": no Linear computed in {p.name}; model.forward was probably replaced after prepare_model, dropping "
            "hf_memstack's autocast (with Trainer/TRL set bf16/fp16 in TrainingArguments to match the policy)"
        )
    return Check("precision", ok, detail)


def _check_gradients(
    model: nn.Module, params: list[nn.Parameter], record: MemstackRecord, observed: _Observed
) -> Check:
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
    missing = [names.get(id(p), "?") for p in params if p.grad is None]
    bad = [
        names.get(id(p), "?")
        for p in params
        if p.grad is not None and not torch.isfinite(p.grad.detach().float()).all()
    ]
    detail = f"{len(params) - len(missing) - len(bad)}/{len(params)} trainable parameters got finite gradients"
    if missing:
        detail += f"; no gradient: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        if len(missing) == len(params) or record.policy.checkpointing.use_reentrant:
            detail += f". {_frozen_input_hint(record)}"
    if bad:
        detail += f"; non-finite: {bad[:5]}"
    return Check("gradients", not missing and not bad, detail)


def _frozen_input_hint(record: MemstackRecord) -> str:
    if record.policy.checkpointing.mode != "none" and record.policy.checkpointing.use_reentrant:
        return (
            "Likely cause: reentrant checkpointing with block inputs that do not require grad (frozen embeddings, "
            "LoRA) drops the gradients; fix: use_reentrant=False (the default), or model.enable_input_require_grads()"
        )
    return "Check which parameters are frozen (requires_grad) and that the loss depends on them"


def _check_compile(
    report: VerifyReport, model: nn.Module, batch: Any, loss_fn: LossFn | None, record: MemstackRecord, *, shared: bool
) -> Check:
    before = record.compile.graph_calls
    breaks_before = dict(_graph_breaks())
    on_every_rank("verify: the compiled forward", lambda: forward_loss(model, batch, loss_fn), shared=shared).backward()
    report.compiled_calls = record.compile.graph_calls - before
    breaks = {k: v - breaks_before.get(k, 0) for k, v in _graph_breaks().items() if v > breaks_before.get(k, 0)}
    n = len(record.compile.regions)
    # Each region's forward is at least one compiled call; fewer means a region ran eager.
    ok = report.compiled_calls >= n
    detail = (
        f"{report.compiled_calls} calls into compiled graphs for {n} compiled region(s) "
        f"({record.compile.graphs_compiled} graph(s) compiled so far)"
    )
    if not ok:
        detail += ": some compiled code did not run, part of the model ran eager"
    if breaks:
        detail += "; graph breaks: " + "; ".join(
            f"{r.splitlines()[0][:160]} (x{c})" for r, c in list(breaks.items())[:3]
        )
    return Check("compile", ok, detail)


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])
