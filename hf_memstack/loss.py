"""apply_loss_head: a causal language model's training loss computed a chunk of tokens at a time,
so the full ``[batch, seq, vocab]`` logits - and the fp32 copy Transformers' loss makes of them -
never exist.

The model's forward is wrapped on the instance (signature, pickling and compile kept, like every
hf_memstack wrapper): with labels and gradients on, it runs the model's backbone, then the output
head and the cross-entropy chunk by chunk; otherwise (generation, evaluation under ``no_grad``)
the model's own forward runs unchanged. ``outputs.logits`` is None when the chunked loss ran.

Two ways to run a chunk, chosen per head (measured on CPU with a 128k vocabulary, 2,048 tokens,
bf16; see the README): PyTorch 2.13's ``F.linear_cross_entropy`` ran 6.6x slower than the plain
head here and returns its loss in bf16, so it is not used. A plain ``nn.Linear`` head (also inside
PEFT's ``modules_to_save``) takes the *fused* path: each chunk's gradients are computed in the
forward (as Liger's and PyTorch's kernels do, here in plain PyTorch), so nothing is recomputed
(0.95x the plain head's time). Any other head (a LoRA layer on the head, a quantized or custom
module) takes the *checkpointed* path: each chunk runs under ``torch.utils.checkpoint`` and is
recomputed in the backward (1.18x). Both keep the head's matmul in the compute dtype: the weight is
cast once per step, never upcast per chunk (trl#6863).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._device import module_mode, preserved_rng
from ._wrappers import _ForwardWrapper
from .policy import LossConfig

__all__ = ["ChunkedLossForward", "LossHeadResult", "apply_loss_head", "check_loss_head", "chunked_lm_loss"]

HeadPath = Literal["fused", "checkpointed"]

# Logits per chunk when chunk_tokens is None: about 16M (a 64 MiB fp32 chunk; with the
# compute-dtype copies about 130 MiB in flight, 4 bytes per logit more with a soft-cap): a few
# chunks for a batch worth chunking. Fewer, larger chunks are faster on CPU (each chunk adds one
# pass over the head's gradient), smaller ones hold less.
_AUTO_CHUNK_LOGITS = 2**24


@dataclass(frozen=True, kw_only=True, slots=True)
class LossHeadResult:
    """What :func:`apply_loss_head` did."""

    mode: Literal["default", "chunked"]
    """``chunked``: the model's forward computes the training loss chunk by chunk; ``default``: untouched."""
    path: HeadPath | None = None
    """``fused`` (a plain linear head: gradients computed in the forward, nothing recomputed) or
    ``checkpointed`` (any other head: each chunk recomputed in the backward)."""
    chunk_tokens: int = 0
    """Tokens per chunk."""
    softcap: float | None = None
    """Final-logit soft-capping reproduced from the config (Gemma-style), or None."""
    logit_multiplier: float = 1.0
    """Factor on the logits reproduced from the model (Cohere's ``logit_scale``, 1/Granite's ``logits_scaling``)."""

    def describe(self) -> str:
        if self.mode == "default":
            return "the model's own"
        extras = (f", softcap {self.softcap:g}" if self.softcap else "") + (
            f", logits x{self.logit_multiplier:g}" if self.logit_multiplier != 1.0 else "")
        return f"chunked, {self.chunk_tokens} tokens per chunk, {self.path} path{extras}"


@dataclass(frozen=True, kw_only=True, slots=True)
class _HeadPlan:
    """What the checks found; applying it cannot fail."""

    target: nn.Module
    """The causal LM whose forward gets wrapped (inside a PEFT wrapper, the model PEFT wraps)."""
    result: LossHeadResult


# ---------------------------------------------------------------------------------------- checks
def check_loss_head(model: nn.Module, cfg: LossConfig) -> _HeadPlan | None:
    """Raise before the model is touched when ``cfg`` cannot run on ``model``; None when there is nothing to do.

    With real weights, the chunked loss is compared with the model's own on a few tokens, so a head
    that transforms its logits in a way this module does not reproduce is refused, not trained wrongly.

    Raises:
        ValueError: the model is not a causal LM with an output head, trains a router auxiliary
            loss (MoE ``output_router_logits``), or its chunked loss differs from its own.
    """
    if cfg.mode == "default":
        return None
    from .record import unwrap_model

    target = unwrap_model(model)
    _check_causal_lm(target)
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"policy.loss.mode='chunked': {type(target).__name__} adds a router load-balancing loss (output_router_logits=True) "
            "that the chunked loss does not compute; set config.output_router_logits=False, or drop loss:chunked"
        )
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    multiplier = float(getattr(target, "logit_scale", None) or getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        multiplier /= float(config.logits_scaling)
    head = target.get_output_embeddings()
    chunk = cfg.chunk_tokens or auto_chunk_tokens(_vocab_size(head, config))
    result = LossHeadResult(mode="chunked", path="fused" if _plain_linear(head) is not None else "checkpointed",
                            chunk_tokens=chunk, softcap=float(softcap) if softcap else None, logit_multiplier=multiplier)
    plan = _HeadPlan(target=target, result=result)
    if _has_values(target):
        _check_matches_model(plan)
    return plan


def supports_chunked_loss(model: nn.Module) -> bool:
    """Whether ``loss:chunked`` applies to ``model`` (a causal LM with an output head and a backbone)."""
    from .record import unwrap_model

    try:
        _check_causal_lm(unwrap_model(model))
    except ValueError:
        return False
    return True


def _check_causal_lm(target: nn.Module) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(target).__name__
    causal = name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or name.endswith("ForCausalLM")
    get_head = getattr(target, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    backbone = getattr(target, "base_model", target)
    if not causal or head is None or backbone is target:
        why = ("it is not a causal language model" if not causal else "it has no output head (get_output_embeddings() is None)"
               if head is None else "its backbone cannot be run without the head (base_model is the model itself)")
        raise ValueError(
            f"policy.loss.mode='chunked' needs a causal language model (a *ForCausalLM: backbone, output head over the "
            f"vocabulary, next-token loss); {name} cannot use it: {why}. Its loss has no vocabulary-sized logits to chunk: "
            "drop loss:chunked from the policy"
        )


def _check_matches_model(plan: _HeadPlan) -> None:
    """The chunked loss and the model's own, on eight tokens in three chunks, in eval mode (no dropout)."""
    target = plan.target
    head = target.get_output_embeddings()
    vocab = _vocab_size(head, target.config)
    device = next(target.parameters()).device
    ids = (torch.arange(8, device=device).unsqueeze(0) * 7919 + 3) % max(vocab, 1)
    labels = ids.clone()
    labels[0, 2] = -100  # a masked position (prompt masking) inside the window
    probe = ChunkedLossForward(target, chunk_tokens=3, softcap=plan.result.softcap, logit_multiplier=plan.result.logit_multiplier)
    with torch.no_grad(), preserved_rng(device), module_mode(target, training=False):
        expected = target(input_ids=ids, labels=labels).loss
        got = probe.loss_from({"input_ids": ids, "labels": labels}).loss
    tolerance = 1e-4 if next(target.parameters()).dtype == torch.float32 else 2e-2
    if not torch.isfinite(got) or abs(float(got) - float(expected)) > tolerance * max(1.0, abs(float(expected))):
        raise ValueError(
            f"policy.loss.mode='chunked': on {type(target).__name__} the chunked loss ({float(got):.6f}) differs from the "
            f"model's own ({float(expected):.6f}): its forward transforms the logits or the loss in a way hf_memstack does not "
            "reproduce (known: final-logit soft-capping, logit scaling). Drop loss:chunked for this model"
        )


# ------------------------------------------------------------------------------------------ apply
def apply_loss_head(plan: _HeadPlan | None) -> LossHeadResult:
    """Install the chunked loss on the model :func:`check_loss_head` planned for (in place)."""
    if plan is None:
        return LossHeadResult(mode="default")
    r = plan.result
    plan.target.forward = ChunkedLossForward(  # type: ignore[method-assign]
        plan.target, chunk_tokens=r.chunk_tokens, softcap=r.softcap, logit_multiplier=r.logit_multiplier)
    return r


class ChunkedLossForward(_ForwardWrapper):
    """A causal LM's forward that, with labels and gradients on, computes the loss chunk by chunk
    from the backbone's hidden states, and returns ``logits=None``; otherwise the model's own forward."""

    def __init__(self, module: nn.Module, *, chunk_tokens: int, softcap: float | None = None, logit_multiplier: float = 1.0) -> None:
        super().__init__(module)
        self.chunk_tokens = chunk_tokens
        self.softcap = softcap
        self.logit_multiplier = logit_multiplier
        self._without_gradients = False
        import inspect

        # Positional parameter names, to read arguments by name without binding a signature per call
        # (a plain dict is also what dynamo traces without a graph break).
        parameters = inspect.signature(self.__wrapped__).parameters.values()
        self._positional = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = dict(zip(self._positional, args))
        arguments.update(kwargs)
        # As the model's own forward: a loss only with labels (shift_labels, when given, replaces their shift).
        labelled = arguments.get("labels") is not None
        keeps_all = isinstance(arguments.get("logits_to_keep", 0), int) and arguments.get("logits_to_keep", 0) == 0
        chunked = torch.is_grad_enabled() or self._without_gradients
        if not (labelled and keeps_all and chunked) or len(args) > len(self._positional):
            return self.__wrapped__(*args, **kwargs)
        return self.loss_from(arguments)

    @contextlib.contextmanager
    def without_gradients(self) -> Iterator[None]:
        """Within: the chunked loss also runs under ``torch.no_grad()`` (to compare it with the model's
        own, as verify does, without a forward that no backward follows - FSDP2 expects one)."""
        previous, self._without_gradients = self._without_gradients, True
        try:
            yield
        finally:
            self._without_gradients = previous

    def loss_from(self, arguments: dict[str, Any]) -> Any:
        """The backbone, then the chunked head and loss; ``arguments`` are the forward's, by name."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        model = self.module
        backbone_args = {k: v for k, v in arguments.items() if k not in ("labels", "logits_to_keep", "return_dict")}
        outputs = model.base_model(**backbone_args, return_dict=True)
        hidden = outputs[0]
        loss = chunked_lm_loss(
            hidden, model.get_output_embeddings(), labels=arguments.get("labels"), shift_labels=arguments.get("shift_labels"),
            num_items_in_batch=arguments.get("num_items_in_batch"), ignore_index=arguments.get("ignore_index", -100),
            chunk_tokens=self.chunk_tokens, softcap=self.softcap, logit_multiplier=self.logit_multiplier)
        fields = CausalLMOutputWithPast.__dataclass_fields__
        cache = next((getattr(outputs, n, None) for n in ("cache", "past_key_values") if n in fields), None)
        extra = {n: cache for n in ("cache", "past_key_values") if n in fields}
        result = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                                        attentions=getattr(outputs, "attentions", None), **extra)
        if arguments.get("return_dict") is False:
            # The model's own tuple keeps its positions (loss, logits, cache, ...): the logits' slot
            # stays, as None, so that out[1] is still the logits and out[2] the cache.
            return (loss, None, *result.to_tuple()[1:])
        return result

    def _options(self) -> dict[str, Any]:
        return {"chunk_tokens": self.chunk_tokens, "softcap": self.softcap, "logit_multiplier": self.logit_multiplier}


# ------------------------------------------------------------------------------------------- loss
def chunked_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_tokens: int,
    softcap: float | None = None,
    logit_multiplier: float = 1.0,
    compiled: bool = False,
) -> torch.Tensor:
    """Next-token cross-entropy of ``head(hidden)`` without the full logits; equal to Transformers'
    ``ForCausalLMLoss`` (labels shifted left, ``ignore_index`` skipped, ``sum / num_items_in_batch``
    when given - gradient accumulation, as Trainer passes it - else the mean over counted tokens).

    Args:
        hidden: the backbone's last hidden states, ``[batch, seq, hidden]``.
        head: the output head (``model.get_output_embeddings()``).
        labels: ``[batch, seq]`` token ids (shifted here), or ``shift_labels`` already aligned with ``hidden``.
        chunk_tokens: tokens per chunk.
        softcap, logit_multiplier: the head's transform of its logits (``softcap * tanh(m * z / softcap)``).
        compiled: each chunk's softmax, loss and logit gradient run as one ``torch.compile``d function
            (Inductor fuses the passes over the ``[chunk, vocab]`` logits; the matmuls stay eager). A
            plain linear head only; the first call compiles (seconds).
    """
    if shift_labels is None:
        # As ForCausalLMLoss: position i predicts labels[i + 1]; the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    linear = _plain_linear(head)
    if linear is not None:
        weight, bias = _full(linear.weight), _full(linear.bias) if linear.bias is not None else None
        total = _FusedLinearCrossEntropy.apply(flat, weight, bias, targets, chunk_tokens, logit_multiplier, softcap,
                                               _compute_dtype(flat, weight), ignore_index, compiled)
    else:
        total = _checkpointed_chunks(flat, head, targets, chunk_tokens, logit_multiplier, softcap, ignore_index)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Sum of the cross-entropy of ``hidden @ weight.T + bias`` over the rows whose target is not
    ``ignore_index``, chunk by chunk, with the gradients of ``hidden``, ``weight`` and ``bias``
    computed in the forward: no logits are saved and nothing is recomputed. What is saved is the
    input's gradient and the head's (in the compute dtype, like the weight copy autocast saves)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunk: int, multiplier: float, softcap: float | None, dtype: torch.dtype, ignore_index: int,
                compiled: bool = False) -> torch.Tensor:
        wants_h, wants_w = hidden.requires_grad, weight.requires_grad
        wants_b = bias is not None and bias.requires_grad
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # once per step: a per-chunk upcast of the weight is the trl#6863 trap
            b = bias.to(dtype) if bias is not None else None
            h = hidden.to(dtype)
            grad_h = torch.empty_like(h) if wants_h else None
            # The head's gradient accumulates in the compute dtype, chunk after chunk, inside the
            # matmul (addmm_: fp32 within a chunk, one rounding per chunk); an fp32 accumulator was
            # measured no more accurate next to bf16's own rounding and up to 1.7x slower on CPU.
            grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if wants_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if wants_b else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            step = _compiled_chunk_step if compiled else _chunk_step
            for start in range(0, h.shape[0], chunk):
                rows = slice(start, start + chunk)
                total += step(h[rows], w, b, targets[rows], multiplier, softcap, ignore_index, grad_h, grad_w, grad_b,
                              rows, wants_h or wants_w or wants_b)
        # Saved: the input's and the head's gradients, in the compute dtype - the head's takes the
        # bytes of the weight copy that the unchunked path saves for its backward.
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        scale = grad_total.float()
        out_h = grad_h.to(h_dtype).mul_(scale) if grad_h is not None else None
        out_w = grad_w.to(w_dtype).mul_(scale) if grad_w is not None else None
        out_b = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None, None


def _chunk_step(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, multiplier: float,
                softcap: float | None, ignore_index: int, grad_h: torch.Tensor | None, grad_w: torch.Tensor | None,
                grad_b: torch.Tensor | None, rows: slice, wants_grad: bool) -> torch.Tensor:
    """One chunk: its summed loss; its gradients written into ``grad_h[rows]`` and added to ``grad_w``/``grad_b``."""
    z, squash = _chunk_logits(h, w, b, multiplier, softcap)
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
    g_low = g.to(w.dtype)
    if grad_h is not None:
        grad_h[rows] = g_low @ w
    if grad_w is not None:
        grad_w.addmm_(g_low.t(), h)
    if grad_b is not None:
        grad_b += g.sum(0)
    return loss


def _compiled_chunk_step(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, multiplier: float,
                         softcap: float | None, ignore_index: int, grad_h: torch.Tensor | None, grad_w: torch.Tensor | None,
                         grad_b: torch.Tensor | None, rows: slice, wants_grad: bool) -> torch.Tensor:
    """:func:`_chunk_step` with the work between the matmuls compiled (one fused function)."""
    raw = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()
    loss, g_low, g_bias = _compiled_softmax_xent()(raw, y, multiplier, softcap, ignore_index, wants_grad, grad_b is not None)
    if g_low is not None:
        if grad_h is not None:
            grad_h[rows] = g_low @ w
        if grad_w is not None:
            grad_w.addmm_(g_low.t(), h)
        if grad_b is not None:
            grad_b += g_bias
    return loss


def _softmax_xent(raw: torch.Tensor, y: torch.Tensor, multiplier: float, softcap: float | None, ignore_index: int,
                  wants_grad: bool, bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One chunk's summed loss and the loss's gradient on the raw logits (in their dtype; its fp32
    column sums for a bias), written out of place: Inductor fuses it into a few passes over the chunk."""
    z = raw.float()
    if multiplier != 1.0:
        z = z * multiplier
    squash = torch.tanh(z / softcap) if softcap is not None else None
    if squash is not None:
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


_COMPILED: list[Any] = []


def _compiled_softmax_xent() -> Any:
    # Compiled once per process, for every chunk shape (dynamic): the last, shorter chunk reuses it.
    if not _COMPILED:
        _COMPILED.append(torch.compile(_softmax_xent, dynamic=True))
    return _COMPILED[0]


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, multiplier: float,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits after the head's transform, and ``tanh`` of the soft-cap (None without one)."""
    raw = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()  # the matmul in the compute dtype
    z = raw.float()
    if multiplier != 1.0:
        z.mul_(multiplier)
    if softcap is None:
        return z, None
    squash = torch.tanh(z / softcap)
    return squash * softcap, squash


def _checkpointed_chunks(flat: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int, multiplier: float,
                         softcap: float | None, ignore_index: int) -> torch.Tensor:
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk):
        total = total + checkpoint(_head_chunk_loss, head, flat[start:start + chunk], targets[start:start + chunk],
                                   multiplier, softcap, ignore_index, use_reentrant=False)
    return total


def _head_chunk_loss(head: nn.Module, h: torch.Tensor, y: torch.Tensor, multiplier: float, softcap: float | None,
                     ignore_index: int) -> torch.Tensor:
    z = head(h).float()  # the head runs under the caller's autocast: its matmul stays in the compute dtype
    if multiplier != 1.0:
        z = z * multiplier
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, y, ignore_index=ignore_index, reduction="sum")


# ---------------------------------------------------------------------------------------- helpers
def _plain_linear(head: nn.Module | None) -> nn.Linear | None:
    """The ``nn.Linear`` that computes the head's output (through PEFT's ``modules_to_save`` copy), or None."""
    if type(head).__name__ == "ModulesToSaveWrapper":
        # As ModulesToSaveWrapper.forward: the active adapter's copy, else the original module.
        active = list(getattr(head, "active_adapters", []) or [])
        off = head.disable_adapters or not active or any(a not in head.modules_to_save for a in active)
        head = head.original_module if off else head.modules_to_save[active[0]]
    return head if type(head) is nn.Linear else None


def _full(t: torch.Tensor) -> torch.Tensor:
    # A head sharded on its own (a DTensor outside its FSDP unit's forward): gather it once per step.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _vocab_size(head: nn.Module | None, config: Any) -> int:
    linear = _plain_linear(head)
    if linear is not None:
        return int(linear.out_features)
    return int(getattr(config, "vocab_size", 0) or getattr(head, "out_features", 0) or 32000)


def _has_values(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(p.is_meta or isinstance(p, FakeTensor) for p in model.parameters())


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk when ``chunk_tokens`` is None: about 16M logits per chunk."""
    return max(1, _AUTO_CHUNK_LOGITS // max(1, vocab_size))

