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

Mixture-of-experts models (Mixtral, Qwen2/3-MoE, OLMoE, GraniteMoE, Jamba, ...) add their routers'
load-balancing loss to the language-model loss when ``output_router_logits`` is on (per call or in
the config): ``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts,
num_experts_per_tok, attention_mask)``, with ``aux_loss`` in the output. The chunked loss adds the
same term with the model's own ``load_balancing_loss_func``; a model whose auxiliary loss it cannot
reproduce (another signature, a missing coefficient, a result that differs from the model's) is
refused by ``prepare_model``, so routers never silently lose their gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from torch.utils.checkpoint import checkpoint

from .._device import module_mode, preserved_rng
from ..distributed._ranks import on_every_rank, runs_collectives
from ..policy import LossConfig
from ._wrappers import _ForwardWrapper

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
    router_aux_loss: bool = False
    """A mixture-of-experts model whose forward adds its routers' load-balancing loss (with
    ``output_router_logits``): the chunked loss adds it too, with the model's own function."""
    compiled: bool = False
    """Each chunk's softmax, loss and logit gradient run compiled (``loss:chunked:compiled``)."""

    def describe(self) -> str:
        if self.mode == "default":
            return "the model's own"
        extras = (
            (f", softcap {self.softcap:g}" if self.softcap else "")
            + (f", logits x{self.logit_multiplier:g}" if self.logit_multiplier != 1.0 else "")
            + (", + the router load-balancing loss when output_router_logits" if self.router_aux_loss else "")
        )
        return f"chunked, {self.chunk_tokens} tokens per chunk, {self.path} path{', compiled chunks' if self.compiled else ''}{extras}"


@dataclass(frozen=True, kw_only=True, slots=True)
class _HeadPlan:
    """What the checks found; applying it cannot fail."""

    target: nn.Module
    """The causal LM whose forward gets wrapped (inside a PEFT wrapper, the model PEFT wraps)."""
    result: LossHeadResult
    router_loss: Callable[..., Any] | None = None
    """The model's own ``load_balancing_loss_func`` (a mixture-of-experts model), or None."""
    cache_default: bool = False
    """The model's ``config.use_cache`` before ``prepare_model`` turned it off for training: whether
    its own tuple output has a cache slot when the caller does not pass ``use_cache``."""


# ---------------------------------------------------------------------------------------- checks
def check_loss_head(model: nn.Module, cfg: LossConfig) -> _HeadPlan | None:
    """Raise before the model is touched when ``cfg`` cannot run on ``model``; None when there is nothing to do.

    With real weights, the chunked loss is compared with the model's own on a few tokens, so a head
    that transforms its logits in a way this module does not reproduce is refused, not trained wrongly.

    Raises:
        ValueError: the model is not a causal LM with an output head, adds a router auxiliary loss
            (MoE ``output_router_logits``) this module cannot reproduce, or its chunked loss (or
            auxiliary loss) differs from its own.
    """
    if cfg.mode == "default":
        return None
    from .._unwrap import unwrap_model

    target = unwrap_model(model)
    _check_causal_lm(target)
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    router_loss = _router_loss_function(target)
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    multiplier = float(getattr(target, "logit_scale", None) or getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        multiplier /= float(config.logits_scaling)
    head = target.get_output_embeddings()
    chunk = cfg.chunk_tokens or auto_chunk_tokens(_vocab_size(head, config))
    result = LossHeadResult(
        mode="chunked",
        path="fused" if _plain_linear(head) is not None else "checkpointed",
        chunk_tokens=chunk,
        softcap=float(softcap) if softcap else None,
        logit_multiplier=multiplier,
        router_aux_loss=router_loss is not None,
        compiled=cfg.compiled,
    )
    plan = _HeadPlan(
        target=target,
        result=result,
        router_loss=router_loss,
        cache_default=bool(getattr(target.config, "use_cache", False)),
    )
    if _has_values(target):
        _check_matches_model(plan)
    return plan


def supports_chunked_loss(model: nn.Module) -> bool:
    """Whether ``loss:chunked`` applies to ``model`` (a causal LM with an output head and a backbone)."""
    from .._unwrap import unwrap_model

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
        why = (
            "it is not a causal language model"
            if not causal
            else "it has no output head (get_output_embeddings() is None)"
            if head is None
            else "its backbone cannot be run without the head (base_model is the model itself)"
        )
        raise ValueError(
            f"policy.loss.mode='chunked' needs a causal language model (a *ForCausalLM: backbone, output head over the "
            f"vocabulary, next-token loss); {name} cannot use it: {why}. Its loss has no vocabulary-sized logits to chunk: "
            "drop loss:chunked from the policy"
        )


# The one signature every Transformers causal LM with a router loss calls it with (Mixtral's pattern):
# load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask).
_ROUTER_LOSS_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


def _router_loss_function(target: nn.Module) -> Callable[..., Any] | None:
    """The model's own ``load_balancing_loss_func`` (from its modeling module, through subclasses),
    or None for a model without a router loss; refuse one called another way (Doge's extra argument)."""
    modules = (sys.modules.get(cls.__module__) for cls in type(target).__mro__)
    function = next((m.load_balancing_loss_func for m in modules if hasattr(m, "load_balancing_loss_func")), None)
    if function is None:
        return None  # no router loss in this family (DeepSeek-V3, Llama-4, ... train without one)
    name = type(target).__name__
    parameters = tuple(inspect.signature(function).parameters)
    if parameters != _ROUTER_LOSS_PARAMETERS:
        raise ValueError(
            f"policy.loss.mode='chunked': {name} adds a router load-balancing loss through load_balancing_loss_func"
            f"{parameters}, not the {_ROUTER_LOSS_PARAMETERS} form the chunked loss reproduces; drop loss:chunked for this "
            "model (its own loss then trains the routers)"
        )
    missing = [
        what
        for what, value in zip(("num_experts", "num_experts_per_tok", "router_aux_loss_coef"), _router_numbers(target))
        if value is None
    ]
    if missing:
        raise ValueError(
            f"policy.loss.mode='chunked': {name} adds a router load-balancing loss, but hf_memstack cannot find its "
            f"{', '.join(missing)} (on the model or its config) to reproduce it; drop loss:chunked for this model"
        )
    return function


def _router_numbers(model: nn.Module) -> tuple[Any, Any, Any]:
    """``(num_experts, top_k, coefficient)`` as the model's forward reads them (its own attributes,
    set from the config at init; JetMoE calls the coefficient ``aux_loss_coef``), else the config's."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

    def first(*names: str, sources: tuple[Any, ...] = (model, config)) -> Any:
        return next((getattr(o, n) for o in sources for n in names if getattr(o, n, None) is not None), None)

    return (
        first("num_experts", "num_local_experts"),
        first("num_experts_per_tok"),
        first("router_aux_loss_coef", "aux_loss_coef"),
    )


def _router_logits_on(model: nn.Module, arguments: dict[str, Any]) -> bool | None:
    """``output_router_logits`` as the model's forward resolves it (the call's, else the config's);
    None for a model that has no such option."""
    if arguments.get("output_router_logits") is not None:
        return bool(arguments["output_router_logits"])
    return getattr(model.config, "output_router_logits", None)


def _check_matches_model(plan: _HeadPlan) -> None:
    """The chunked loss and the model's own, on eight tokens in three chunks, in eval mode (no dropout)."""
    target = plan.target
    head = target.get_output_embeddings()
    vocab = _vocab_size(head, target.config)
    device = next(target.parameters()).device
    ids = (torch.arange(8, device=device).unsqueeze(0) * 7919 + 3) % max(vocab, 1)
    labels = ids.clone()
    labels[0, 2] = -100  # a masked position (prompt masking) inside the window
    probe = ChunkedLossForward(
        target,
        chunk_tokens=3,
        softcap=plan.result.softcap,
        logit_multiplier=plan.result.logit_multiplier,
        router_loss=plan.router_loss,
    )
    # A mixture-of-experts model is compared with its router loss on: the per-call flag must be
    # reproduced whatever the config says.
    arguments: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if "output_router_logits" in inspect.signature(type(target).forward).parameters:
        arguments["output_router_logits"] = True
    with torch.no_grad(), preserved_rng(device), module_mode(target, training=False), _hooks_restored(target):
        expected = target(**arguments)
        got = probe.loss_from(dict(arguments))
    tolerance = 1e-4 if next(target.parameters()).dtype == torch.float32 else 2e-2
    name = type(target).__name__
    for what, ours, theirs in (
        ("loss", got.loss, expected.loss),
        ("aux_loss", getattr(got, "aux_loss", None), getattr(expected, "aux_loss", None)),
    ):
        if theirs is None and ours is None:
            continue
        if (
            theirs is None
            or ours is None
            or not torch.isfinite(torch.as_tensor(ours))
            or (abs(float(ours) - float(theirs)) > tolerance * max(1.0, abs(float(theirs))))
        ):
            raise ValueError(
                f"policy.loss.mode='chunked': on {name} the chunked {what} ({_show(ours)}) differs from the model's own "
                f"({_show(theirs)}): its forward transforms the logits or adds a loss in a way hf_memstack does not reproduce "
                "(known: final-logit soft-capping, logit scaling, the routers' load_balancing_loss_func). Drop loss:chunked "
                "for this model"
            )


@contextlib.contextmanager
def _hooks_restored(model: nn.Module) -> Iterator[None]:
    """Within: forward hooks installed on ``model`` are removed on exit. Transformers installs its
    output-capturing hooks (local functions: the model no longer pickles) on the first forward that
    asks for router logits, and marks each model it hooked; the probe's forward must not leave them
    on a model that never asked (the marks go too, so a later forward installs them again)."""
    flag = "_output_capturing_hooks_installed"
    before = {id(m): (set(m._forward_hooks), m.__dict__.get(flag)) for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            hooks, installed = before.get(id(m), (set(), None))
            for key in set(m._forward_hooks) - hooks:
                for table in (m._forward_hooks, m._forward_hooks_with_kwargs, m._forward_hooks_always_called):
                    table.pop(key, None)
            if installed is None:
                m.__dict__.pop(flag, None)
            else:
                m.__dict__[flag] = installed


def _show(value: Any) -> str:
    return "none" if value is None else f"{float(value):.6f}"


# ------------------------------------------------------------------------------------------ apply
def apply_loss_head(plan: _HeadPlan | None) -> LossHeadResult:
    """Install the chunked loss on the model :func:`check_loss_head` planned for (in place)."""
    if plan is None:
        return LossHeadResult(mode="default")
    r = plan.result
    plan.target.forward = ChunkedLossForward(  # type: ignore[method-assign]
        plan.target,
        chunk_tokens=r.chunk_tokens,
        softcap=r.softcap,
        logit_multiplier=r.logit_multiplier,
        router_loss=plan.router_loss,
        cache_default=plan.cache_default,
        compiled=r.compiled,
    )
    return r


class ChunkedLossForward(_ForwardWrapper):
    """A causal LM's forward that, with labels and gradients on, computes the loss chunk by chunk
    from the backbone's hidden states, and returns ``logits=None``; otherwise the model's own forward."""

    def __init__(
        self,
        module: nn.Module,
        *,
        chunk_tokens: int,
        softcap: float | None = None,
        logit_multiplier: float = 1.0,
        router_loss: Callable[..., Any] | None = None,
        cache_default: bool = False,
        compiled: bool = False,
    ) -> None:
        super().__init__(module)
        self.cache_default = cache_default
        self.compiled = compiled
        self.chunk_tokens = chunk_tokens
        self.softcap = softcap
        self.logit_multiplier = logit_multiplier
        self.router_loss = router_loss
        self._without_gradients = False
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
        """The backbone, then the chunked head and loss (plus the routers' load-balancing loss, as the
        model's forward adds it); ``arguments`` are the forward's, by name."""
        model = self.module
        head = model.get_output_embeddings()
        ignore_index = arguments.get("ignore_index", -100)
        # Under FSDP/DDP a rank that refused its ids here would leave the others waiting in the
        # backbone's first all-gather: the refusal is shared first, so every rank ends with it.
        # (Looked up per call: the model is sharded after this wrapper is installed. One rank: no walk.)
        on_every_rank(
            "loss:chunked: the batch's token ids",
            lambda: _check_token_ids(arguments, head, model, ignore_index),
            shared=not torch.compiler.is_compiling() and runs_collectives(model),
        )
        backbone_args = {k: v for k, v in arguments.items() if k not in ("labels", "logits_to_keep", "return_dict")}
        routed = _router_logits_on(model, arguments)
        if routed is not None:
            backbone_args["output_router_logits"] = routed
        outputs = model.base_model(**backbone_args, return_dict=True)
        loss = _chunked_lm_loss(
            outputs[0],
            head,
            labels=arguments.get("labels"),
            shift_labels=arguments.get("shift_labels"),
            num_items_in_batch=arguments.get("num_items_in_batch"),
            ignore_index=ignore_index,
            chunk_tokens=self.chunk_tokens,
            softcap=self.softcap,
            logit_multiplier=self.logit_multiplier,
            compiled=self.compiled,
        )
        aux_loss = None
        if routed and self.router_loss is not None:
            # As the model's forward: aux_loss in the output, coefficient x aux_loss added to the loss.
            experts, top_k, coefficient = _router_numbers(model)
            aux_loss = self.router_loss(outputs.router_logits, experts, top_k, arguments.get("attention_mask"))
            loss = loss + coefficient * (aux_loss.to(loss.device) if torch.is_tensor(aux_loss) else aux_loss)
        result = _output(outputs, loss=loss, aux_loss=aux_loss, moe=routed is not None or self.router_loss is not None)
        return_dict = arguments.get("return_dict")
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        if not return_dict:
            return _as_tuple(
                result,
                cache_slot=self.cache_default
                if arguments.get("use_cache") is None
                else bool(arguments.get("use_cache")),
            )
        return result

    def _options(self) -> dict[str, Any]:
        return {
            "chunk_tokens": self.chunk_tokens,
            "softcap": self.softcap,
            "logit_multiplier": self.logit_multiplier,
            "router_loss": self.router_loss,
            "cache_default": self.cache_default,
        }


def _as_tuple(result: Any, *, cache_slot: bool) -> tuple[Any, ...]:
    """The model's own tuple (to_tuple: the fields that are not None), at its positions: the logits'
    slot stays, as None, so out[1] (out[2] after aux_loss) is still the logits; and so does the
    cache's when the unprepared model would have returned one for this call (``use_cache`` as passed,
    else its config's default, which prepare_model turned off: training never reads the cache), so
    a mixture-of-experts model's router_logits stay at their index."""
    kept = {"logits", *(("cache", "past_key_values") if cache_slot else ())}
    return tuple(
        getattr(result, f.name)
        for f in dataclasses.fields(result)
        if f.name in kept or getattr(result, f.name) is not None
    )


def _output(outputs: Any, *, loss: torch.Tensor, aux_loss: Any, moe: bool) -> Any:
    """The model's output record, with the chunked loss and no logits (a mixture-of-experts model's
    has ``aux_loss`` and ``router_logits``)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    cls = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    fields = cls.__dataclass_fields__
    cache = next((getattr(outputs, n, None) for n in ("cache", "past_key_values") if n in fields), None)
    extra: dict[str, Any] = {n: cache for n in ("cache", "past_key_values") if n in fields}
    if moe:
        extra.update(aux_loss=aux_loss, router_logits=getattr(outputs, "router_logits", None))
    return cls(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **extra,
    )


def _check_token_ids(arguments: dict[str, Any], head: nn.Module, model: nn.Module, ignore_index: int) -> None:
    """Refuse ids outside the vocabulary before the forward: the embedding's and the loss's index
    errors name neither the id nor the vocabulary (on CUDA they are device-side asserts)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    checks: list[tuple[str, Any, int, int | None]] = []
    if isinstance(getattr(embedding, "num_embeddings", None), int):
        checks.append(("input_ids", arguments.get("input_ids"), embedding.num_embeddings, None))
    vocab = _vocab_size(head, model.config)
    checks += [(name, arguments.get(name), vocab, ignore_index) for name in ("labels", "shift_labels")]
    _check_ids_in_range(checks, model_name=type(model).__name__)


def _check_ids_in_range(checks: list[tuple[str, Any, int, int | None]], *, model_name: str) -> None:
    """``(name, ids, vocabulary size, ignored id)``: one host sync for all of them together (a min/max
    per step, not per chunk); skipped while compiling, where it would break the graph."""
    checks = [c for c in checks if torch.is_tensor(c[1]) and not c[1].is_floating_point() and c[1].numel()]
    # Fake and meta tensors (the estimator's trace) hold no values to check.
    if not checks or torch.compiler.is_compiling() or any(is_fake(t) or t.is_meta for _, t, _, _ in checks):
        return
    # The smallest and largest id of each tensor (ignored labels counted as 0), fetched together.
    device = checks[0][1].device
    ranges = torch.stack(
        [
            torch.stack(torch.aminmax(t if ignored is None else t.masked_fill(t == ignored, 0))).to(device)
            for _, t, _, ignored in checks
        ]
    ).tolist()
    failing = [c for c, (low, high) in zip(checks, ranges) if low < 0 or high >= c[2]]
    if not failing:
        return
    name, ids, size, ignored = failing[0]
    mask = (ids < 0) | (ids >= size)
    if ignored is not None:
        mask &= ids != ignored
    offending = ids[mask]
    hint = (
        f"; {ignored} (ignore_index) is the one label outside it, for positions without a loss"
        if ignored is not None
        else ""
    )
    raise ValueError(
        f"loss:chunked: {name} holds id {int(offending.flatten()[0])} ({offending.numel()} id(s) in all) outside the "
        f"vocabulary of {model_name} ({size} ids: 0-{size - 1}){hint}. The tokenizer and the model disagree (after adding "
        "tokens, call model.resize_token_embeddings(len(tokenizer)) before prepare_model), or make_batch/the collator "
        f"builds ids >= {size}"
    )


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

    Raises:
        ValueError: a label (other than ``ignore_index``) outside the head's vocabulary.
    """
    vocab = _head_outputs(head)
    if vocab is not None:
        _check_ids_in_range(
            [(name, t, vocab, ignore_index) for name, t in (("labels", labels), ("shift_labels", shift_labels))],
            model_name=type(head).__name__,
        )
    return _chunked_lm_loss(
        hidden,
        head,
        labels=labels,
        shift_labels=shift_labels,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        chunk_tokens=chunk_tokens,
        softcap=softcap,
        logit_multiplier=logit_multiplier,
        compiled=compiled,
    )


def _chunked_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    *,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    ignore_index: int,
    chunk_tokens: int,
    softcap: float | None,
    logit_multiplier: float,
    compiled: bool = False,
) -> torch.Tensor:
    if shift_labels is None:
        # As ForCausalLMLoss: position i predicts labels[i + 1]; the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    linear = _plain_linear(head)
    if linear is not None:
        weight, bias = _full(linear.weight), _full(linear.bias) if linear.bias is not None else None
        total = _FusedLinearCrossEntropy.apply(
            flat,
            weight,
            bias,
            targets,
            chunk_tokens,
            logit_multiplier,
            softcap,
            _compute_dtype(flat, weight),
            ignore_index,
            compiled,
        )
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
    def forward(
        ctx: Any,
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
            # The head's gradient accumulates in the compute dtype, chunk after chunk, inside the
            # matmul (addmm_: fp32 within a chunk, one rounding per chunk); an fp32 accumulator was
            # measured no more accurate next to bf16's own rounding and up to 1.7x slower on CPU.
            grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if wants_w else None
            grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if wants_b else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            # Eager under a dispatch mode (the meter's MemTracker, the estimator's fake tensors: Dynamo
            # cannot compile there, and the peak is the same) and inside a compiled model (its graph has it).
            eager = is_in_torch_dispatch_mode() or torch.compiler.is_compiling()
            step = _compiled_chunk_step if compiled and not eager else _chunk_step
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
                )
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
) -> torch.Tensor:
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
) -> torch.Tensor:
    """:func:`_chunk_step` with the work between the matmuls compiled (one fused function)."""
    raw = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()
    loss, g_low, g_bias = _compiled_softmax_xent()(
        raw, y, multiplier, softcap, ignore_index, wants_grad, grad_b is not None
    )
    if g_low is not None:
        if grad_h is not None:
            grad_h[rows] = g_low @ w
        if grad_w is not None:
            grad_w.addmm_(g_low.t(), h)
        if grad_b is not None:
            grad_b += g_bias
    return loss


def _softmax_xent(
    raw: torch.Tensor,
    y: torch.Tensor,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
    wants_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
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


def _chunk_logits(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, multiplier: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's fp32 logits after the head's transform, and ``tanh`` of the soft-cap (None without one)."""
    raw = torch.addmm(b, h, w.t()) if b is not None else h @ w.t()  # the matmul in the compute dtype
    z = raw.float()
    if multiplier != 1.0:
        z.mul_(multiplier)
    if softcap is None:
        return z, None
    squash = torch.tanh(z / softcap)
    return squash * softcap, squash


def _checkpointed_chunks(
    flat: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    chunk: int,
    multiplier: float,
    softcap: float | None,
    ignore_index: int,
) -> torch.Tensor:
    total = flat.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk):
        total = total + checkpoint(
            _head_chunk_loss,
            head,
            flat[start : start + chunk],
            targets[start : start + chunk],
            multiplier,
            softcap,
            ignore_index,
            use_reentrant=False,
        )
    return total


def _head_chunk_loss(
    head: nn.Module, h: torch.Tensor, y: torch.Tensor, multiplier: float, softcap: float | None, ignore_index: int
) -> torch.Tensor:
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
    return _head_outputs(head) or int(getattr(config, "vocab_size", 0) or 32000)


def _head_outputs(head: nn.Module | None) -> int | None:
    """The head's number of outputs (through PEFT's wrappers: a LoRA layer's base layer), or None."""
    linear = _plain_linear(head)
    if linear is not None:
        return int(linear.out_features)
    base = getattr(head, "base_layer", head)
    out = getattr(base, "out_features", None)
    return out if isinstance(out, int) else None


def _has_values(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(p.is_meta or isinstance(p, FakeTensor) for p in model.parameters())


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk when ``chunk_tokens`` is None: about 16M logits per chunk."""
    return max(1, _AUTO_CHUNK_LOGITS // max(1, vocab_size))
