"""verify: run one forward + backward and check that the policy really took effect.

Many failures here are silent: checkpointing set but not active (a model left in eval mode,
set after ``accelerator.prepare``), a compile that runs eager, autocast that never reaches the
matmuls, trainable parameters that never get gradients. This module observes each of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._device import device_of, preserved_rng
from .prepare import MemstackRecord
from .step import LossFn, forward_loss

__all__ = ["Check", "VerifyReport", "verify"]


@dataclass(frozen=True, slots=True)
class Check:
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

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def __str__(self) -> str:
        return "\n".join(f"[{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks)


def verify(model: nn.Module, batch: Any, *, loss_fn: LossFn | None = None, raise_on_failure: bool = False) -> VerifyReport:
    """Run one forward + backward on ``batch`` and check what ``prepare_model`` promised.

    Checks:
        * ``checkpointing``: the blocks meant to be checkpointed re-run their forward during
          backward (observed with hooks on their submodules), and no others do;
        * ``precision``: under mixed precision, Linear layers compute in the autocast dtype and
          the loss comes back in fp32;
        * ``compile``: the compiled graphs were called in a compiled step (a second pass);
        * ``gradients``: every parameter with ``requires_grad`` received a finite gradient.

    The model's parameters are not updated (no optimizer step); gradients that were there before
    and the RNG state are restored afterwards.

    Raises:
        RuntimeError: with ``raise_on_failure=True``, when a check fails (the report is in the message).
    """
    record = getattr(model, "memstack", None)
    if not isinstance(record, MemstackRecord):
        raise ValueError(f"verify needs a model returned by prepare_model; this {type(model).__name__} has no model.memstack record")
    report = VerifyReport()
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    with preserved_rng(device_of(model)):
        for p in params:
            p.grad = None
        # Observe the eager computation: under a compiled model, hooks and autocast run inside the graph.
        stance = torch.compiler.set_stance("force_eager") if record.compile.regions else contextlib.nullcontext()
        with stance:
            observed = _observe_step(model, batch, loss_fn, record)
        report.saved_activation_bytes = observed["saved_bytes"]
        report.recomputed_blocks = observed["recomputed"]
        _check_checkpointing(report, record, model)
        _check_precision(report, record, observed)
        _check_gradients(report, model, params)
        if record.compile.regions:
            for p in params:
                p.grad = None
            before = record.compile.graph_calls
            breaks_before = dict(_graph_breaks())
            forward_loss(model, batch, loss_fn).backward()
            report.compiled_calls = record.compile.graph_calls - before
            breaks = {k: v - breaks_before.get(k, 0) for k, v in _graph_breaks().items() if v > breaks_before.get(k, 0)}
            n = len(record.compile.regions)
            # Each region's forward is at least one compiled call; fewer means a region ran eager.
            ok = report.compiled_calls >= n
            detail = (f"{report.compiled_calls} calls into compiled graphs for {n} compiled region(s) "
                      f"({record.compile.graphs_compiled} graph(s) compiled so far)")
            if not ok:
                detail += ": some compiled code did not run, part of the model ran eager"
            if breaks:
                reasons = "; ".join(f"{r.splitlines()[0][:160]} (x{c})" for r, c in list(breaks.items())[:3])
                detail += f"; graph breaks: {reasons}"
            report.checks.append(Check("compile", ok, detail))
    for p, g in zip(params, saved_grads):
        p.grad = g
    if raise_on_failure and not report.ok:
        raise RuntimeError(f"hf_memstack.verify found problems:\n{report}")
    return report


def _observe_step(model: nn.Module, batch: Any, loss_fn: LossFn | None, record: MemstackRecord) -> dict[str, Any]:
    in_backward = False
    blocks = record.blocks.modules if record.blocks is not None else ()
    backward_calls = [0] * len(blocks)
    linear_dtypes: set[torch.dtype] = set()
    handles = []

    def block_hook(i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if in_backward:
                backward_calls[i] += 1
        return hook

    def linear_hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_tensor(output):
            linear_dtypes.add(output.dtype)

    for i, block in enumerate(blocks):
        # Submodules, not the block itself: Transformers checkpoints the block's forward and keeps
        # the block's own hooks outside the checkpoint, so only inner modules re-run visibly.
        for sub in block.modules():
            handles.append(sub.register_forward_hook(block_hook(i)))
    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            handles.append(sub.register_forward_hook(linear_hook))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward_loss(model, batch, loss_fn)
        in_backward = True
        loss.backward()
    finally:
        in_backward = False
        for h in handles:
            h.remove()
    return {
        "saved_bytes": saved,
        "recomputed": [i for i, n in enumerate(backward_calls) if n],
        "linear_dtypes": linear_dtypes,
        "loss_dtype": loss.dtype,
    }


def _check_checkpointing(report: VerifyReport, record: MemstackRecord, model: nn.Module) -> None:
    expected = record.checkpointing["checkpointed"] if record.checkpointing["method"] != "none" else []
    got = report.recomputed_blocks
    if not expected:
        ok = not got
        detail = "off, and no block recomputed" if ok else f"off, yet blocks {got} recomputed in backward"
    else:
        ok = got == expected
        detail = f"blocks {got} recomputed in backward (expected {expected}); {report.saved_activation_bytes / 2**20:.2f} MiB saved for backward outside checkpoints"
        if not got and not model.training:
            detail += ": the model is in eval mode, and checkpointing only runs in training; call model.train()"
        elif not ok:
            detail += ": checkpointing is not doing what the policy says"
    report.checks.append(Check("checkpointing", ok, detail))


def _check_precision(report: VerifyReport, record: MemstackRecord, observed: dict[str, Any]) -> None:
    p = record.precision
    dtypes = observed["linear_dtypes"]
    if not dtypes:
        report.checks.append(Check("precision", True, f"{p.name}: the model has no nn.Linear to observe"))
        return
    if p.mixed:
        ok = p.dtype in dtypes and observed["loss_dtype"] == torch.float32
        if record.autocast_by == "accelerator.prepare" and p.dtype not in dtypes:
            detail = f"Linear outputs {sorted(map(str, dtypes))}: autocast comes from accelerator.prepare(model); verify after it"
        else:
            detail = f"Linear outputs in {sorted(map(str, dtypes))}, loss in {observed['loss_dtype']}"
    else:
        ok = dtypes == {torch.float32}
        detail = f"fp32: Linear outputs in {sorted(map(str, dtypes))}"
    report.checks.append(Check("precision", ok, detail))


def _check_gradients(report: VerifyReport, model: nn.Module, params: list[torch.Tensor]) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [names.get(id(p), "?") for p in params if p.grad is None]
    bad = [names.get(id(p), "?") for p in params if p.grad is not None and not torch.isfinite(p.grad.detach().float()).all()]
    ok = not missing and not bad
    detail = f"{len(params) - len(missing) - len(bad)}/{len(params)} trainable parameters got finite gradients"
    if missing:
        detail += f"; no gradient: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
    if bad:
        detail += f"; non-finite: {bad[:5]}"
    report.checks.append(Check("gradients", ok, detail))


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])

