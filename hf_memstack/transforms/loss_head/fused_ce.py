"""The fused path of the chunked loss (a plain ``nn.Linear`` head): each chunk's logits, softmax,
loss and gradients computed in the forward, eagerly or with the work between the matmuls compiled,
so no logits are saved and nothing is recomputed in the backward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

if TYPE_CHECKING:

    class _Context(Protocol):
        """The autograd context as this function uses it: torch's ``FunctionCtx``, and the dtypes it keeps."""

        saved_tensors: tuple[torch.Tensor | None, ...]
        dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None]

        def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy of ``hidden @ weight.T + bias`` over the rows whose target is not
    ``ignore_index``, chunk by chunk, with the gradients of ``hidden``, ``weight`` and ``bias``
    computed in the forward: no logits are saved and nothing is recomputed. What is saved is the
    input's gradient and the head's (in the compute dtype, like the weight copy autocast saves)."""

    @staticmethod
    def forward(
        ctx: _Context,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        multiplier: float,
        softcap: float | None,
        dtype: torch.dtype,
        ignore_index: int,
        compiled: bool = False,
    ) -> torch.Tensor:
        wants_h, wants_w = hidden.requires_grad, weight.requires_grad
        wants_b = bias is not None and bias.requires_grad
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # once per step: a per-chunk upcast of the weight is the trl#6863 trap
            b = bias.to(dtype) if bias is not None else None
            h = hidden.to(dtype)
            grad_h = torch.empty_like(h) if wants_h else None
            # The head's gradient accumulates chunk after chunk inside the matmul (addmm_: fp32
            # within a chunk, one rounding per chunk). In bf16, in bf16: an fp32 accumulator cannot
            # take a bf16 matmul on a CPU, and an fp32 matmul was 3.5x slower at vocab 128k; the
            # rounding error grows with the number of chunks (docs/loss-head.md). In fp16, in fp32:
            # the sum over a step's tokens, unscaled, overflows fp16's 65504 where the model's own
            # (its loss-scaled mean) does not, and GradScaler would skip every step.
            # Not zeroed: the first chunk writes it (beta=0), which saves a pass over the head's size.
            accumulate = torch.float32 if dtype == torch.float16 else dtype
            grad_w = torch.empty(weight.shape, dtype=accumulate, device=weight.device) if wants_w else None
            grad_b = (
                torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                if wants_b and bias is not None
                else None
            )
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            # Eager under a dispatch mode (the meter's MemTracker, the estimator's fake tensors: Dynamo
            # cannot compile there, and the peak is the same) and inside a compiled model (its graph has it).
            eager = is_in_torch_dispatch_mode() or torch.compiler.is_compiling()
            step = _compiled_chunk_step if compiled and not eager else _chunk_step
            # The eager chunks reuse one step's scratch (not inside a compiled graph, which plans its own).
            # The compiled chunks use it only where the transposed gradient is copied (see _add_grads).
            eager_step = step is _chunk_step
            scratch = (
                _Scratch.for_chunks(min(chunk, h.shape[0]), w, fp32_logits=eager_step)
                if not torch.compiler.is_compiling() and (eager_step or _copies_transposed(w))
                else None
            )
            for start in range(0, h.shape[0], chunk):
                rows = slice(start, start + chunk)
                total += step(
                    h[rows],
                    w,
                    b,
                    targets[rows],
                    multiplier,
                    softcap,
                    ignore_index,
                    grad_h,
                    grad_w,
                    grad_b,
                    rows,
                    wants_h or wants_w or wants_b,
                    scratch,
                )
        # Saved: the input's and the head's gradients, in the compute dtype (the head's in fp32 under
        # fp16) - the head's takes the bytes of the weight copy that the unchunked path saves.
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx: _Context, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        scale = grad_total.float()
        out_h = grad_h.to(h_dtype).mul_(scale) if grad_h is not None else None
        out_w = grad_w.to(w_dtype).mul_(scale) if grad_w is not None else None
        out_b = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None, None


@dataclass
class _Scratch:
    """One step's buffers for the eager chunks, reused chunk after chunk: a fresh ``[chunk, vocab]``
    tensor per chunk costs its page faults every time on a CPU (glibc maps buffers over 32 MiB anew
    per allocation), about a quarter of the head's time at vocab 128k. Their bytes are those one chunk
    held at its peak before (its fp32 logits and their compute-dtype copy)."""

    logits: torch.Tensor
    """``[chunk, vocab]`` fp32: the logits, their softmax and gradient in place; then the bytes of the
    transposed compute-dtype gradient (see :func:`_add_grads`). The compiled chunks': ``low``."""
    low: torch.Tensor | None
    """``[chunk, vocab]`` in the compute dtype: the raw logits, then their gradient (None in fp32)."""

    @staticmethod
    def for_chunks(rows: int, w: torch.Tensor, *, fp32_logits: bool = True) -> _Scratch:
        """``fp32_logits=False`` for the compiled chunks (a reduced compute dtype), whose fused function
        keeps no fp32 logits and returns the gradient in its own buffer: one buffer then holds the
        raw logits, then the transposed gradient (``logits`` is ``low``)."""
        shape = (rows, w.shape[0])
        low = None if w.dtype == torch.float32 else torch.empty(shape, dtype=w.dtype, device=w.device)
        if not fp32_logits and low is not None:
            return _Scratch(low, low)
        return _Scratch(torch.empty(shape, dtype=torch.float32, device=w.device), low)

    def transposed(self, g_low: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``g_low.t()`` made contiguous (in ``dtype``, by default its own), in the logits' bytes (done
        with by then) where they hold it, else in a new tensor."""
        n, vocab = g_low.shape
        dtype = dtype or g_low.dtype
        if self.logits.numel() * self.logits.element_size() < n * vocab * dtype.itemsize:
            return g_low.t().to(dtype, memory_format=torch.contiguous_format)
        out = self.logits.view(dtype).view(-1)[: n * vocab].view(vocab, n)
        return out.copy_(g_low.t())


def _chunk_step(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    y: torch.Tensor,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    rows: slice,
    wants_grad: bool,
    scratch: _Scratch | None = None,
) -> torch.Tensor:
    """One chunk: its summed loss; its gradients written into ``grad_h[rows]`` and added to ``grad_w``/``grad_b``."""
    z, squash = _chunk_logits(h, w, b, multiplier, softcap, scratch)
    valid = (y != ignore_index).to(z.dtype).unsqueeze(1)
    safe = torch.where(y != ignore_index, y, 0).unsqueeze(1)
    # log-sum-exp by hand, so that one exp pass gives both the loss and the softmax (the gradient).
    top = z.amax(dim=-1, keepdim=True)
    picked = z.gather(1, safe)
    z.sub_(top).exp_()
    norm = z.sum(dim=-1, keepdim=True)
    loss = ((norm.log() + top - picked) * valid).sum()
    if not wants_grad:
        return loss
    # d loss / d logits = softmax - one_hot(target) on counted rows (0 elsewhere), then back through
    # the soft-cap and the multiplier to the head's raw output.
    g = z.mul_(valid / norm)
    g.scatter_add_(1, safe, -valid)
    if squash is not None:
        g.mul_(1 - squash * squash)
    if multiplier != 1.0:
        g.mul_(multiplier)
    if scratch is not None and scratch.low is not None:
        g_low = scratch.low[: g.shape[0]].copy_(g)
    else:
        g_low = g.to(w.dtype)
    if grad_b is not None:
        grad_b += g.sum(0)
    del z, g, squash  # the fp32 chunk is done with: its bytes are free before the head's gradient needs any
    _add_grads(g_low, w, h, grad_h, grad_w, rows, scratch)
    return loss


def _compiled_chunk_step(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    y: torch.Tensor,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    rows: slice,
    wants_grad: bool,
    scratch: _Scratch | None = None,
) -> torch.Tensor:
    """:func:`_chunk_step` with the work between the matmuls compiled (one fused function; the
    compiled function allocates its gradient output; the raw logits and the transposed gradient
    go into ``scratch``)."""
    if scratch is None or scratch.low is None:
        raw = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()
    else:
        raw = scratch.low[: h.shape[0]]
        torch.addmm(b, h, w.t(), out=raw) if b is not None else torch.mm(h, w.t(), out=raw)
    loss, g_low, g_bias = _compiled_softmax_xent()(
        raw, y, multiplier, softcap, ignore_index, wants_grad, grad_b is not None
    )
    del raw  # as in the eager step: the chunk's logits are free before the head's gradient
    if g_low is not None:
        if grad_b is not None and g_bias is not None:  # g_bias is computed exactly when grad_b is given
            grad_b += g_bias
        _add_grads(g_low, w, h, grad_h, grad_w, rows, scratch)
    return loss


def _add_grads(
    g_low: torch.Tensor,
    w: torch.Tensor,
    h: torch.Tensor,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    rows: slice,
    scratch: _Scratch | None = None,
) -> None:
    """A chunk's logit gradient ``g_low`` ``[chunk, vocab]`` through the head's matmul: written into
    ``grad_h[rows]``, added into ``grad_w`` (written by the first chunk, ``rows.start == 0``)."""
    if grad_h is not None:
        grad_h[rows] = g_low @ w
    if grad_w is None:
        return
    left = g_low.t()
    if grad_w.dtype != left.dtype:  # fp16: an fp32 accumulator (see the forward) and an fp32 matmul
        left = scratch.transposed(g_low, grad_w.dtype) if scratch is not None else left.to(grad_w.dtype)
        h = h.to(grad_w.dtype)
    elif _copies_transposed(left):
        # oneDNN's bf16 matmul is about 2x slower with a transposed left operand of few columns (a
        # chunk's tokens): on an AMX Xeon at vocab 128k, 1.38 s against 0.72 s per 2,048 tokens with
        # the copy counted (fp16 is assumed alike). MKL's fp32 path showed no such cost, and a GPU's
        # BLAS takes either layout, so neither copies. The copy takes the bytes of the chunk's fp32
        # logits, done with by now.
        left = scratch.transposed(g_low) if scratch is not None else left.contiguous()
    grad_w.addmm_(left, h, beta=0 if rows.start == 0 else 1)


_XentResult = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""A chunk's summed loss, and the loss's gradient on its raw logits and its bias (None when not asked for)."""


def _softmax_xent(
    raw: torch.Tensor,
    y: torch.Tensor,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
    wants_grad: bool,
    bias_grad: bool,
) -> _XentResult:
    """One chunk's summed loss and the loss's gradient on the raw logits (in their dtype; its fp32
    column sums for a bias), written out of place: Inductor fuses it into a few passes over the chunk."""
    z = raw.float()
    if multiplier != 1.0:
        z = z * multiplier
    squash: torch.Tensor | None = None
    if softcap is not None:
        squash = torch.tanh(z / softcap)
        z = squash * softcap
    valid = (y != ignore_index).unsqueeze(1)
    safe = torch.where(valid.squeeze(1), y, 0).unsqueeze(1)
    top = z.amax(dim=-1, keepdim=True)
    e = (z - top).exp()
    norm = e.sum(dim=-1, keepdim=True)
    loss = ((norm.log() + top - z.gather(1, safe)) * valid).sum()
    if not wants_grad:
        return loss, None, None
    one_hot = torch.zeros_like(z).scatter_(1, safe, 1.0)
    g = (e / norm - one_hot) * valid
    if squash is not None:
        g = g * (1 - squash * squash)
    if multiplier != 1.0:
        g = g * multiplier
    return loss, g.to(raw.dtype), g.sum(0) if bias_grad else None


_COMPILED: list[Callable[..., _XentResult]] = []


def _compiled_softmax_xent() -> Callable[..., _XentResult]:
    # Compiled once per process, for every chunk shape (dynamic): the last, shorter chunk reuses it.
    if not _COMPILED:
        _COMPILED.append(torch.compile(_softmax_xent, dynamic=True))
    return _COMPILED[0]


def _chunk_logits(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    multiplier: float,
    softcap: float | None,
    scratch: _Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits after the head's transform (in ``scratch`` when given), and ``tanh``
    of the soft-cap (None without one)."""
    if scratch is None:
        raw = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()  # the matmul in the compute dtype
        z = raw.float()
    else:
        n = h.shape[0]
        z = scratch.logits[:n]
        raw = z if scratch.low is None else scratch.low[:n]
        if b is not None:
            torch.addmm(b, h, w.t(), out=raw)
        else:
            torch.mm(h, w.t(), out=raw)
        if raw is not z:
            z.copy_(raw)
    if multiplier != 1.0:
        z.mul_(multiplier)
    if softcap is None:
        return z, None
    squash = torch.tanh(z / softcap)
    return squash * softcap, squash


def _copies_transposed(t: torch.Tensor) -> bool:
    """Whether the head's gradient matmul gets its left operand as a contiguous copy (see _add_grads)."""
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)
