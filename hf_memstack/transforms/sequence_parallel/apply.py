"""``sp:N`` in ``prepare_model``: :func:`check_sequence_parallel` refuses, before anything changes, a
model or launch Ulysses cannot shard (each refusal naming the fix), and
:func:`apply_sequence_parallel` creates the group and switches the model's attention to
``hf_memstack_ulysses``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from ..._unwrap import unwrap_model
from ...policy import SequenceParallelConfig
from .attention import ULYSSES_ATTENTION, kv_replication, register_ulysses_attention, set_active_group
from .exchange import register_group
from .group import check_process_group, sequence_parallel_group
from .guard import install_forward_guard

__all__ = ["SequenceParallelPlan", "SequenceParallelResult", "apply_sequence_parallel", "check_sequence_parallel"]

# Layer kinds whose attention is Transformers' (full or windowed) SDPA; any other (linear attention,
# Mamba, convolutions, chunked attention) mixes tokens in a way the head exchange does not shard.
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")
# Model types whose attention adds a bias by position (ALiBi, T5's relative buckets): the bias is
# made for the local tokens, not for the whole row the heads see after the exchange.
_POSITION_BIAS_TYPES = ("bloom", "mpt", "t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano")


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallelPlan:
    """What the check found: the size and the heads' arithmetic."""

    size: int
    heads: int
    kv_heads: int
    kv_replication: int
    previous: str


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallelResult:
    """What ``prepare_model`` did for ``sp:N`` (``size`` 1: nothing)."""

    size: int = 1
    """Ranks in the sequence-parallel group."""
    rank: int = 0
    """This rank's place in it: it holds the ``rank``-th of ``size`` equal slices of every row."""
    heads: int = 0
    kv_heads: int = 0
    kv_replication: int = 1
    """Each key/value head repeated this many times before the exchange (N does not divide them)."""
    previous: str | None = None
    """The attention implementation the model had (now :data:`ULYSSES_ATTENTION`)."""

    @property
    def applied(self) -> bool:
        return self.size > 1

    def describe(self) -> str:
        if not self.applied:
            return "off"
        kv = f", key/value heads {self.kv_heads}" + (
            f" (each repeated {self.kv_replication}x)" if self.kv_replication > 1 else ""
        )
        return (
            f"Ulysses over {self.size} ranks ({ULYSSES_ATTENTION}, was {self.previous}); this rank holds slice "
            f"{self.rank} of {self.size} of every row; heads {self.heads} -> {self.heads // self.size} per rank{kv}"
        )


def check_sequence_parallel(model: nn.Module, cfg: SequenceParallelConfig) -> SequenceParallelPlan | None:
    """None for ``size`` 1; else the plan, or the refusal (touching nothing) of what cannot shard."""
    if cfg.size == 1:
        return None
    n = cfg.size
    check_process_group(n)
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(
            f"sp:{n} shards a Transformers model's attention (through its AttentionInterface); "
            f"{type(inner).__name__} has no Transformers config: drop sp:{n}"
        )
    _refuse_architecture(config, n)
    _refuse_headless(inner, n)
    _refuse_inexact(inner, config, n)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"sp:{n}: {type(config).__name__} names no num_attention_heads to shard; drop sp:{n}")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    replication = kv_replication(heads, kv_heads, n)
    _refuse_unswitchable(inner, config, n)
    return SequenceParallelPlan(
        size=n, heads=heads, kv_heads=kv_heads, kv_replication=replication, previous=config._attn_implementation
    )


def _refuse_headless(inner: nn.Module, n: int) -> None:
    """sp:N trains a causal LM's next-token loss over slices of its rows; a model without an LM head
    (a sequence classifier pools one token of the whole row; a bare backbone) has no such loss."""
    get = getattr(inner, "get_output_embeddings", None)
    if not callable(get) or get() is None:
        raise ValueError(
            f"sp:{n} shards a causal LM's rows (its next-token loss is summed over each rank's slice); "
            f"{type(inner).__name__} has no LM head (a classifier pools its row's last token, which one rank holds): "
            f"load it as ...ForCausalLM, or drop sp:{n}"
        )


def _refuse_architecture(config: Any, n: int) -> None:
    kind = getattr(config, "model_type", type(config).__name__)
    why = None
    if getattr(config, "is_encoder_decoder", False):
        why = "is an encoder-decoder (its cross-attention and bidirectional encoder are not sharded)"
    elif (
        kind in _POSITION_BIAS_TYPES
        or getattr(config, "alibi", False)
        or hasattr(config, "relative_attention_num_buckets")
    ):
        why = "adds a position bias (ALiBi or relative buckets) made for each rank's own tokens"
    elif getattr(config, "attn_logit_softcapping", None) is not None:
        why = "soft-caps its attention logits, which SDPA (the attention after the exchange) does not"
    elif getattr(config, "attention_chunk_size", None):
        why = "attends in chunks (attention_chunk_size)"
    elif any(t not in _ATTENTION_LAYERS for t in getattr(config, "layer_types", None) or ()):
        others = sorted({t for t in config.layer_types if t not in _ATTENTION_LAYERS})
        why = f"has layers of kind {', '.join(others)} (layer_types), which mix tokens outside the attention"
    elif any(getattr(config, key, None) is not None for key in getattr(config, "sub_configs", None) or {}):
        why = "is composite (sub-models with attention of their own, such as a vision tower)"
    if why is not None:
        raise ValueError(
            f"sp:{n}: the model ({kind}) {why}; Ulysses sequence parallelism shards decoder-only models whose "
            f"attention is full or sliding-window SDPA: drop sp:{n} (use ckpt, loss:chunked, mlp:tiled or fsdp for memory)"
        )


# RoPE types whose scaling is picked from the longest position the forward sees (Transformers'
# ``dynamic_rope_update``): each rank sees its own slice's, so the ranks would rotate by other angles.
_SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


def _refuse_inexact(model: nn.Module, config: Any, n: int) -> None:
    """Models that run under the head exchange but would train on another loss than their own:
    bidirectional attention (made causal), a router loss over each slice, RoPE scaled by each slice."""
    flags = [
        (type(m).__name__, m.is_causal) for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    bidirectional = sorted({name for name, causal in flags if not causal})
    if bidirectional or not flags:
        found = f"{', '.join(bidirectional)} has is_causal=False" if bidirectional else "no module has is_causal=True"
        raise ValueError(
            f"sp:{n}: {type(model).__name__}'s attention is not causal ({found}); Ulysses attends causally, so "
            f"a bidirectional model (an encoder, a masked LM) would train on another loss: sp:{n} shards causal "
            f"LMs only; drop sp:{n}"
        )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"sp:{n}: {type(config).__name__}.output_router_logits is True: the router's load-balancing loss is a "
            f"product of means over the whole rows' tokens, and each rank would compute it over its own slice; set "
            f"config.output_router_logits=False (no auxiliary loss) to train with sp:{n}, or drop sp:{n}"
        )
    for where, rope in _rope_types(config):
        if rope in _SEQUENCE_DEPENDENT_ROPE:
            raise ValueError(
                f"sp:{n}: {where} has rope_type {rope!r}, which scales the rotary angles by the longest position a "
                "forward sees - each rank would pick it from its own slice; use a static rope type ('linear', "
                f"'yarn', 'llama3' or the default), or drop sp:{n}"
            )


def _rope_types(config: Any) -> list[tuple[str, str]]:
    """Every ``rope_type`` in ``rope_parameters`` (Transformers 5; one dict, or one per layer kind) and
    ``rope_scaling`` (the older name), as (where, type)."""
    found = []
    for attr in ("rope_parameters", "rope_scaling"):
        value = getattr(config, attr, None)
        if not isinstance(value, dict):
            continue
        nested = [(f"{attr}[{k!r}]", v) for k, v in value.items() if isinstance(v, dict)]
        for where, params in [(attr, value), *nested]:
            rope = params.get("rope_type", params.get("type"))
            if isinstance(rope, str):
                found.append((f"{type(config).__name__}.{where}", rope))
    return found


def _refuse_unswitchable(model: nn.Module, config: Any, n: int) -> None:
    compatible = getattr(model, "is_backend_compatible", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not (
        getattr(model, "_supports_sdpa", False)
        and callable(compatible)
        and compatible()
        and callable(can_set)
        and can_set()
    ):
        raise ValueError(
            f"sp:{n}: {type(model).__name__}'s attention cannot be switched to {ULYSSES_ATTENTION!r}: the model does not "
            "run SDPA, or its attention does not dispatch through Transformers' AttentionInterface (it is loaded "
            f"{config._attn_implementation!r}); use a model that supports attn_implementation='sdpa', or drop sp:{n}"
        )


def apply_sequence_parallel(
    model: nn.Module, plan: SequenceParallelPlan | None, *, group: dist.ProcessGroup | None = None
) -> SequenceParallelResult:
    """Create the sequence-parallel group (``group``: one made elsewhere, e.g. a device mesh's ``"sp"``
    dimension) and switch the model's attention to :data:`ULYSSES_ATTENTION` (every rank calls it)."""
    if plan is None:
        return SequenceParallelResult()
    register_ulysses_attention()
    sp = register_group(group if group is not None else sequence_parallel_group(plan.size))
    if sp.size != plan.size:
        raise ValueError(f"sp:{plan.size}: the group given has {sp.size} ranks; pass a group of {plan.size} ranks")
    set_active_group(sp)
    inner = unwrap_model(model)
    inner.set_attn_implementation(ULYSSES_ATTENTION)  # type: ignore[operator]
    install_forward_guard(inner)  # once per forward: the group's ranks got the same shape, no router loss
    return SequenceParallelResult(
        size=sp.size,
        rank=sp.rank,
        heads=plan.heads,
        kv_heads=plan.kv_heads,
        kv_replication=plan.kv_replication,
        previous=plan.previous,
    )
