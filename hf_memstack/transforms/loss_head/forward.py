"""ChunkedLossForward: the causal LM's forward that ``loss:chunked`` installs - the backbone, then the
chunked head and loss (and the routers' loss), in the model's own output record and tuple layout;
the model's own forward whenever no training loss is asked for."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...distributed._ranks import on_every_rank, runs_collectives
from .._wrappers import _ForwardWrapper
from .chunked import _check_ids_in_range, _chunked_lm_loss, _vocab_size
from .router_loss import RouterLoss, _router_logits_on, _router_numbers

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

__all__ = ["ChunkedLossForward"]


class ChunkedLossForward(_ForwardWrapper):
    """A causal LM's forward that, with labels and gradients on, computes the loss chunk by chunk
    from the backbone's hidden states, and returns ``logits=None``; otherwise the model's own forward."""

    module: PreTrainedModel
    """The causal LM (``loss_head`` checked it is one)."""

    def __init__(
        self,
        module: PreTrainedModel,
        *,
        chunk_tokens: int,
        softcap: float | None = None,
        logit_multiplier: float = 1.0,
        router_loss: RouterLoss | None = None,
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
        own = not (labelled and keeps_all and chunked) or len(args) > len(self._positional)
        # Under FSDP/DDP a rank that refused its ids would leave the others waiting in the backbone's
        # first all-gather: the refusal is shared first, so every rank ends with it. On every call,
        # whichever path this rank takes: the path depends on this rank's batch (a rank without
        # labels takes the model's own forward), and an agreement that only some ranks reach leaves
        # them waiting for the others until the group's timeout. (Looked up per call: the model is
        # sharded after this wrapper is installed. One rank: no walk.)
        shared = not torch.compiler.is_compiling() and runs_collectives(self.module)
        if shared:
            model = self.module
            on_every_rank(
                "loss:chunked: the batch's token ids",
                lambda: _check_token_ids(
                    arguments, model.get_output_embeddings(), model, arguments.get("ignore_index", -100)
                ),
            )
        if own:
            return self.__wrapped__(*args, **kwargs)
        return self.loss_from(arguments, ids_checked=shared)

    @contextlib.contextmanager
    def without_gradients(self) -> Iterator[None]:
        """Within: the chunked loss also runs under ``torch.no_grad()`` (to compare it with the model's
        own, as verify does, without a forward that no backward follows - FSDP2 expects one)."""
        previous, self._without_gradients = self._without_gradients, True
        try:
            yield
        finally:
            self._without_gradients = previous

    def loss_from(self, arguments: dict[str, Any], *, ids_checked: bool = False) -> Any:
        """The backbone, then the chunked head and loss (plus the routers' load-balancing loss, as the
        model's forward adds it); ``arguments`` are the forward's, by name (``ids_checked``: the
        token ids were checked already, on every rank)."""
        model = self.module
        head = model.get_output_embeddings()
        ignore_index = arguments.get("ignore_index", -100)
        if not ids_checked:
            _check_token_ids(arguments, head, model, ignore_index)
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
            coefficient = cast(float, coefficient)  # found: the head was refused at prepare_model otherwise
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

    def _options(self) -> dict[str, object]:
        return {
            "chunk_tokens": self.chunk_tokens,
            "softcap": self.softcap,
            "logit_multiplier": self.logit_multiplier,
            "router_loss": self.router_loss,
            "cache_default": self.cache_default,
        }


def _as_tuple(result: CausalLMOutputWithPast | MoeCausalLMOutputWithPast, *, cache_slot: bool) -> tuple[object, ...]:
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


def _output(
    outputs: object, *, loss: torch.Tensor, aux_loss: object, moe: bool
) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
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


def _check_token_ids(
    arguments: Mapping[str, object], head: nn.Module, model: PreTrainedModel, ignore_index: int
) -> None:
    """Refuse ids outside the vocabulary before the forward: the embedding's and the loss's index
    errors name neither the id nor the vocabulary (on CUDA they are device-side asserts)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    checks: list[tuple[str, Any, int, int | None]] = []
    num_embeddings = getattr(embedding, "num_embeddings", None)
    if isinstance(num_embeddings, int):
        checks.append(("input_ids", arguments.get("input_ids"), num_embeddings, None))
    vocab = _vocab_size(head, model.config)
    checks += [(name, arguments.get(name), vocab, ignore_index) for name in ("labels", "shift_labels")]
    _check_ids_in_range(checks, model_name=type(model).__name__)
