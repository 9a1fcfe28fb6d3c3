"""apply_loss_head: a causal language model's training loss computed a chunk of tokens at a time,
so the full ``[batch, seq, vocab]`` logits - and the fp32 copy Transformers' loss makes of them -
never exist.

The model's forward is wrapped on the instance (signature, pickling and compile kept, like every
hf_memstack wrapper): with labels and gradients on, it runs the model's backbone, then the output
head and the cross-entropy chunk by chunk; otherwise (generation, evaluation under ``no_grad``)
the model's own forward runs unchanged. ``outputs.logits`` is None when the chunked loss ran.

Two ways to run a chunk, chosen per head (measured on CPU with a 128k vocabulary, 2,048 tokens,
bf16; see docs/loss-head.md): PyTorch 2.13's ``F.linear_cross_entropy`` ran 6.6x slower than the plain
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
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..._device import module_mode, preserved_rng
from ..._unwrap import unwrap_model
from ...policy import LossConfig
from .chunked import _plain_linear, _vocab_size, auto_chunk_tokens
from .forward import ChunkedLossForward
from .result import LossHeadResult
from .router_loss import RouterLoss, _router_loss_function

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["apply_loss_head", "check_loss_head", "supports_chunked_loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _HeadPlan:
    """What the checks found; applying it cannot fail."""

    target: PreTrainedModel
    """The causal LM whose forward gets wrapped (inside a PEFT wrapper, the model PEFT wraps)."""
    result: LossHeadResult
    router_loss: RouterLoss | None = None
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

    target = _check_causal_lm(unwrap_model(model))
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    router_loss = _router_loss_function(target)
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    multiplier = float(getattr(target, "logit_scale", None) or getattr(config, "logit_scale", None) or 1.0)
    logits_scaling = getattr(config, "logits_scaling", None)
    if logits_scaling:
        multiplier /= float(logits_scaling)
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

    try:
        _check_causal_lm(unwrap_model(model))
    except ValueError:
        return False
    return True


def _check_causal_lm(target: nn.Module) -> PreTrainedModel:
    """``target``, seen as the causal LM (a Transformers ``*ForCausalLM``) it was checked to be."""
    name = type(target).__name__
    causal = _next_token_lm(target)
    get_head = getattr(target, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    backbone = getattr(target, "base_model", target)
    if not causal or head is None or backbone is target:
        why = (
            "it is not a causal language model (nor a decoder-only vision-language one): its loss has no "
            "vocabulary-sized logits to chunk"
            if not causal
            else "it has no output head (get_output_embeddings() is None)"
            if head is None
            else "its backbone cannot be run without the head (base_model is the model itself), and the chunked loss "
            "runs the backbone, then the head a chunk of tokens at a time"
        )
        raise ValueError(
            f"policy.loss.mode='chunked' needs a causal language model (a *ForCausalLM or a decoder-only vision-language "
            f"model: backbone, output head over the vocabulary, next-token loss); {name} cannot use it: {why}; drop "
            "loss:chunked from the policy"
        )
    return cast("PreTrainedModel", target)


def _next_token_lm(target: nn.Module) -> bool:
    """Whether ``target``'s loss is the next-token cross-entropy of its head over its backbone's last
    hidden states: a causal LM, or a decoder-only vision- or audio-language model (Qwen2-VL, LLaVA,
    Idefics3, Mllama, ...: the backbone takes the pixels, the head's logits are over the vocabulary).
    Encoder-decoders (Florence-2, Pix2Struct) are not: their decoder is not the backbone's last stage.
    ``check_loss_head`` then compares the losses on real weights, so an architecture that only looks
    like one is refused, not trained wrongly."""
    from transformers.models.auto import modeling_auto as auto

    name = type(target).__name__
    if name in set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or name.endswith("ForCausalLM"):
        return True
    config = getattr(target, "config", None)
    multimodal = {
        *auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values(),
        *auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.values(),
    }
    return name in multimodal and not getattr(config, "is_encoder_decoder", False)


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
    arguments: dict[str, object] = {"input_ids": ids, "labels": labels}
    if "output_router_logits" in inspect.signature(type(target).forward).parameters:
        arguments["output_router_logits"] = True
    name = type(target).__name__
    with torch.no_grad(), preserved_rng(device), module_mode(target, training=False), _hooks_restored(target):
        try:
            expected = target(**arguments)
            got = probe.loss_from(dict(arguments))
        except (TypeError, ValueError, RuntimeError, IndexError, AttributeError) as e:
            # A multimodal model whose forward needs its images (BLIP-2): nothing to compare on text alone.
            raise ValueError(
                f"policy.loss.mode='chunked': {name} could not be run on 8 text tokens to compare the chunked loss "
                f"with its own ({type(e).__name__}: {e}), so hf_memstack cannot tell that it computes the same loss. "
                "Drop loss:chunked for this model"
            ) from e
    tolerance = 1e-4 if next(target.parameters()).dtype == torch.float32 else 2e-2
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


def _show(value: torch.Tensor | float | None) -> str:
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


def _has_values(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(p.is_meta or isinstance(p, FakeTensor) for p in model.parameters())
