"""prepare_model: validate a policy against a model and the machine, then apply 4-bit base weights,
checkpointing, the loss head, precision, compile and sharding in one fixed order."""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ._device import device_of, shard_device
from ._model_checks import (
    TrainingInEvalModeCheck,
    base_before_adapters,
    check_not_prepared,
    check_not_set_by_hand,
    check_weights,
    find_policy_blocks,
    warn_on_training_setup,
)
from .data.guard import install_packing_guard
from .distributed.accelerate import check_accelerate_fsdp
from .distributed.preflight import agree_before_sharding, check_hybrid_shard, require_process_group
from .policy import MemoryPolicy
from .record import AutocastBy, MemstackRecord, record_of, unwrap_model
from .transforms.blocks import Blocks
from .transforms.checkpointing.apply import (
    apply_checkpointing,
    check_checkpointing,
    install_checkpointing_guard,
    uses_transformers_checkpointing,
)
from .transforms.compile import apply_compile, check_backend
from .transforms.fsdp import FSDPResult, apply_fsdp
from .transforms.loss_head.apply import _HeadPlan, apply_loss_head, check_loss_head, supports_chunked_loss
from .transforms.optim.optimizer import check_optimizer_policy
from .transforms.packed_attention import PackedAttentionResult, apply_packed_attention
from .transforms.precision.apply import (
    ResolvedPrecision,
    apply_precision,
    check_accelerator_precision,
    resolve_precision,
)
from .transforms.precision.master_weights import (
    MasterWeightsPlan,
    MasterWeightsResult,
    apply_master_weights,
    check_master_weights,
    mark_pure_bf16,
)
from .transforms.quant.apply import QuantPlan, apply_quant, check_quant
from .transforms.sequence_parallel.apply import (
    SequenceParallelPlan,
    SequenceParallelResult,
    apply_sequence_parallel,
    check_sequence_parallel,
)
from .transforms.sequence_parallel.group import check_process_group
from .transforms.tiled_mlp import _TilePlan, apply_tiled_mlp, check_tiled_mlp

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PretrainedConfig

    from .policy.memory_policy import PolicyDict

__all__ = ["describe", "prepare_model"]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Plan:
    """Everything the pre-flight checks decided; applying it cannot fail on bad input."""

    policy: MemoryPolicy
    precision: ResolvedPrecision
    blocks: Blocks | None
    sharded_by_accelerate: bool
    """Accelerate's FSDP2 plugin shards in ``accelerator.prepare``; prepare_model does not."""
    autocast_here: bool
    """prepare_model wraps the forward in autocast (else ``accelerator.prepare`` does, or fp32)."""
    broadcast_from_rank0: bool = False
    """Some rank built the model on the meta device: rank 0's weights fill the shards."""
    loss_head: _HeadPlan | None = None
    """Where and how the chunked loss goes (None: the model's own loss)."""
    quant: QuantPlan | None = None
    """Which linear layers become 4-bit, and which came 4-bit."""
    tiles: _TilePlan | None = None
    """Which MLPs run over tiles of tokens (None: none)."""
    master: MasterWeightsPlan | None = None
    """Which trainable parameters are cast to the master weights' dtype."""
    sequence_parallel: SequenceParallelPlan | None = None
    """Ulysses over N ranks (``sp:N``; None: off)."""


def prepare_model(
    model: nn.Module,
    policy: MemoryPolicy | str | PolicyDict | None = None,
    *,
    accelerator: Accelerator | None = None,
) -> nn.Module:
    """Apply a memory policy to ``model`` in place and return it.

    Args:
        model: a Transformers ``PreTrainedModel``, a PEFT model, or any ``nn.Module``, already on its device.
        policy: a :class:`MemoryPolicy`, a string such as ``"bf16+compile+ckpt"`` (a ladder preset
            or ``+``-joined features), a dict, or a YAML path. ``None`` means fp32. It is copied:
            changing it afterwards changes nothing.
        accelerator: an ``accelerate.Accelerator`` the model will go through. Its
            ``mixed_precision`` must match the policy; ``accelerator.prepare(model)`` then applies
            autocast (and fp16's GradScaler) and this function does not. If the Accelerator
            shards (Accelerate's FSDP, e.g. ``fsdp_plugin=accelerate_fsdp_plugin(policy, model)``),
            ``accelerator.prepare`` shards too; its plugin must be FSDP2 and agree with the policy.
            Under an fsdp policy with an Accelerator that does not shard (CPU, torchrun), this
            function shards and autocasts, and the model must not go through ``accelerator.prepare``.

    Returns:
        The same model, with ``model.memstack`` (:class:`MemstackRecord`) saying what was applied.

    Raises:
        PolicyError (ValueError): the policy is invalid.
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: the model was prepared already (also inside a DDP, compile or PEFT wrapper);
            the device, compile backend or launch (FSDP without a process group) cannot run the policy.
        ValueError: blocks are needed and cannot be found, or the model has 0 blocks (a config with 0
            layers) under a token that works per block (ckpt, mlp:tiled, compile:regional, ...); a
            ``torch.compile`` wrapper around or inside the model; the accelerator's precision differs;
            the model has no weights (meta device), integer weights other than 4-bit ones, or
            4-bit weights that train; ``quant:nf4`` cannot quantize its targets (see
            :func:`hf_memstack.transforms.quant.apply.check_quant`).
        DistributedMismatchError (ValueError): under FSDP, another rank failed its checks or
            holds a different policy or model (raised on every rank, before any sharding collective).

    Every check runs before the model is changed: on error the model is untouched.
    """
    start = time.perf_counter()
    policy = _coerce_policy(policy)
    plan = _preflight_on_every_rank(model, policy, accelerator)
    record = _apply(model, plan, accelerator, start)
    model.memstack = record  # type: ignore[assignment]
    return model


def _coerce_policy(policy: MemoryPolicy | str | PolicyDict | None) -> MemoryPolicy:
    """A private, validated copy of the policy."""
    import torch.distributed as dist

    try:
        return copy.deepcopy(MemoryPolicy.coerce(policy))
    except (ValueError, TypeError, FileNotFoundError) as e:
        # A rank whose policy does not parse cannot know whether the others shard: when the
        # policy asks for FSDP, it still joins their pre-flight all-gather, so they fail too
        # instead of waiting for it.
        if "fsdp" in repr(policy) and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            agree_before_sharding(None, None, e)
        raise


def _preflight_on_every_rank(model: nn.Module, policy: MemoryPolicy, accelerator: Accelerator | None) -> _Plan:
    """The checks, agreed across ranks under FSDP or sp:N (whose groups are made together): one rank's failure fails every rank."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module (e.g. from AutoModel*.from_pretrained), got {type(model).__name__}"
        )
    require_process_group(policy.fsdp)
    if policy.sequence_parallel.size == 1 and policy.fsdp.mode == "none":
        return _preflight(model, policy, accelerator)
    if policy.sequence_parallel.size > 1:
        check_process_group(policy.sequence_parallel.size)
    error, plan = None, None
    try:
        plan = _preflight(model, policy, accelerator)
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = e
    broadcast = agree_before_sharding(policy.to_dict(), model, error)
    assert plan is not None
    if broadcast and plan.quant is not None and plan.quant.targets:
        raise ValueError(
            "a rank holds the model on the meta device, and the policy quantizes it (quant:nf4): rank 0's weights are broadcast "
            "after sharding, when they are 4-bit already; load the model with from_pretrained on every rank"
        )
    if broadcast and plan.sharded_by_accelerate:
        raise ValueError(
            "a rank holds the model on the meta device, but the Accelerator shards it (Accelerate's FSDP loads "
            "weights its own way): load the model with from_pretrained on every rank, or launch with torchrun"
        )
    return dataclasses.replace(plan, broadcast_from_rank0=broadcast)


def _preflight(model: nn.Module, policy: MemoryPolicy, accelerator: Accelerator | None) -> _Plan:
    """Every check that can fail, before the model is touched."""
    check_not_prepared(model)
    check_weights(model, policy)
    check_not_set_by_hand(model)
    sharded_by_accelerate = check_accelerate_fsdp(policy, accelerator)
    if policy.fsdp.mode != "none":
        check_hybrid_shard(policy.fsdp)
    precision = resolve_precision(policy.precision, shard_device() if policy.fsdp.mode != "none" else device_of(model))
    if accelerator is not None:
        check_accelerator_precision(precision, accelerator)
    check_backend(policy.compile)
    ck = policy.checkpointing
    check_checkpointing(model, ck)
    needs_blocks = (
        (ck.mode != "none" and not uses_transformers_checkpointing(model, ck))
        or policy.compile.mode == "regional"
        or policy.fsdp.mode != "none"
        or policy.mlp.mode != "default"
    )
    blocks = find_policy_blocks(model, policy, needed=needs_blocks)
    loss_head = check_loss_head(model, policy.loss)
    tiles = check_tiled_mlp(model, policy.mlp, blocks)
    check_optimizer_policy(policy.optimizer)
    sequence_parallel = check_sequence_parallel(model, policy.sequence_parallel)
    quant = check_quant(
        model,
        policy.quant,
        dtype=precision.dtype,
        blocks=blocks,
        shards=_shards(policy),
        fsdp=policy.fsdp.mode != "none",
    )
    warn_on_training_setup(model, policy, blocks, quant)
    master = check_master_weights(
        model,
        policy,
        mixed=precision.mixed,
        precision_name=precision.name,
        before_adapters=base_before_adapters(model, quant),
    )
    # An Accelerator applies autocast in accelerator.prepare, except to a model sharded here,
    # which does not go through accelerator.prepare.
    autocast_here = precision.mixed and (
        accelerator is None or (policy.fsdp.mode != "none" and not sharded_by_accelerate)
    )
    return _Plan(
        policy=policy,
        precision=precision,
        blocks=blocks,
        sharded_by_accelerate=sharded_by_accelerate,
        autocast_here=autocast_here,
        loss_head=loss_head,
        quant=quant,
        tiles=tiles,
        master=master,
        sequence_parallel=sequence_parallel,
    )


def _apply(model: nn.Module, plan: _Plan, accelerator: Accelerator | None, start: float) -> MemstackRecord:
    """The transformations, in the one order that composes (torchtitan's and Accelerate's FSDP2 order)."""
    policy = plan.policy
    # Training never reads the KV cache: building it costs memory and, under compile, a recompile
    # of the first block. Transformers only turns it off in checkpointed layers.
    kv_cache_disabled = _disable_kv_cache(model)
    # 0. 4-bit base weights before anything wraps the layers: checkpointing's recompute, the loss
    #    head, compile and FSDP2 (which shards NF4 weights with their own all-gather) all see them.
    assert plan.quant is not None
    quant = apply_quant(model, plan.quant)
    # 0b. the trainable parameters in the master weights' dtype (fp32 under mixed precision, or pure
    #     bf16), before anything wraps them: FSDP2 then shards and all-gathers them in that dtype.
    assert plan.master is not None
    master = apply_master_weights(plan.master, model, sharded=policy.fsdp.mode != "none" or plan.sharded_by_accelerate)
    # 1. checkpointing first, so compile and FSDP wrap the checkpointed blocks: a recompute then
    #    re-runs the compiled block, and FSDP's all-gather stays outside the checkpoint (else every
    #    recompute gathers the parameters again).
    checkpointing = apply_checkpointing(model, policy.checkpointing, blocks=plan.blocks)
    install_checkpointing_guard(model, policy.checkpointing, checkpointing, policy.to_string())
    if policy.checkpointing.mode != "none":
        model.register_forward_pre_hook(TrainingInEvalModeCheck(type(model).__name__))
    # 1b. the MLPs over tiles of tokens, inside the (checkpointed) blocks: before compile traces
    #     them and FSDP shards them; a tile's checkpoint nests inside the block's.
    mlp = apply_tiled_mlp(plan.tiles)
    # 2. the loss head, on the causal LM's own forward: inside the autocast that step 3 wraps around
    #    it (the head's matmul runs in the compute dtype), traced by a whole-model compile, and run
    #    within FSDP's root forward (the head's weight gathered, as for the model's own head).
    loss = apply_loss_head(plan.loss_head)
    # 2b/2c. the packed-batch guard and the attention (see _attention)
    packing_guard, attention, sequence_parallel = _attention(model, plan)
    # 3. precision: autocast goes around the root forward before compile, so a whole-model compile
    #    traces it instead of running outside the autocast region.
    if plan.autocast_here:
        apply_precision(model, plan.precision)
    # 4. compile, per block or whole, after checkpointing and before sharding.
    compile_stats = apply_compile(model, policy.compile, blocks=plan.blocks)
    # 5. sharding last: FSDP2 shards each (checkpointed, compiled) block, then the root; or
    #    accelerator.prepare does, with the plugin built from this policy (accelerate_fsdp_plugin).
    fsdp = _shard(model, plan, master)
    return _record(
        model,
        plan,
        start,
        kv_cache_disabled=kv_cache_disabled,
        quant=quant,
        master_weights=master,
        checkpointing=checkpointing,
        mlp=mlp,
        loss=loss,
        packing_guard=packing_guard,
        attention=attention,
        sequence_parallel=sequence_parallel,
        compile=compile_stats,
        fsdp=fsdp,
    )


def _attention(model: nn.Module, plan: _Plan) -> tuple[bool, PackedAttentionResult, SequenceParallelResult]:
    """_apply's steps 2b and 2c."""
    policy, sp = plan.policy, plan.sequence_parallel
    # 2b. the packed-batch guard on the root forward, outside the loss head and inside autocast: it
    #     sees the batch as the caller passes it (the mask, use_cache) before anything runs on it.
    #     Its probe (a forward on one rank) would wait on the other ranks under FSDP or sp:N.
    packing_guard = install_packing_guard(unwrap_model(model), probe=policy.fsdp.mode == "none" and sp is None)
    # 2c. the attention, switched before compile traces it: Ulysses under sp:N (the heads exchanged
    #     across the group; it attends per sample itself), else SDPA per sample on packed rows (the
    #     same numbers, sum(L_i^2) instead of (sum L_i)^2) for a model that can take them.
    sequence_parallel = apply_sequence_parallel(model, sp)
    attention = (
        apply_packed_attention(unwrap_model(model), compiled=policy.compile.mode != "none")
        if packing_guard and sp is None
        else PackedAttentionResult()
    )
    return packing_guard, attention, sequence_parallel


def _disable_kv_cache(model: nn.Module) -> bool:
    """Turn the model's ``config.use_cache`` off; whether it was on."""
    on = bool(getattr(getattr(model, "config", None), "use_cache", False))
    if on:  # a config with use_cache: a Transformers config
        cast("PretrainedConfig", model.config).use_cache = False
    return on


def _shard(model: nn.Module, plan: _Plan, master: MasterWeightsResult) -> FSDPResult | None:
    """Step 5's sharding: FSDP2 here, or said to be accelerator.prepare's; None without FSDP."""
    policy = plan.policy
    if plan.sharded_by_accelerate:
        return FSDPResult(mode=policy.fsdp.mode, by="accelerator.prepare", weights_from="accelerate")
    if policy.fsdp.mode == "none":
        return None
    assert plan.blocks is not None
    fsdp = apply_fsdp(
        model,
        policy.fsdp,
        blocks=plan.blocks,
        precision=plan.precision,
        broadcast_from_rank0=plan.broadcast_from_rank0,
    )
    if master.mode == "bf16":  # the sharded parameters are new objects: tag them for the step check
        mark_pure_bf16(p for p in model.parameters() if p.requires_grad)
    return fsdp


def _record(model: nn.Module, plan: _Plan, start: float, **applied: Any) -> MemstackRecord:
    """What was applied, with the loss scaler fp16 needs and who autocasts; ``applied``: each step's result."""
    # fp16 needs a loss scaler. On FSDP2's sharded gradients (DTensors) torch.amp.GradScaler's
    # inf check is reduced over the mesh, so every rank skips the same steps (tested on 2 ranks).
    grad_scaler = (
        torch.amp.GradScaler(plan.precision.device_type)
        if plan.precision.name == "fp16" and plan.autocast_here
        else None
    )
    autocast_by: AutocastBy = (
        "hf_memstack" if plan.autocast_here else ("accelerator.prepare" if plan.precision.mixed else "none")
    )
    return MemstackRecord(
        policy=plan.policy,
        precision=plan.precision,
        autocast_by=autocast_by,
        grad_scaler=grad_scaler,
        blocks=plan.blocks,
        prepare_seconds=time.perf_counter() - start,
        chunkable_loss=supports_chunked_loss(model),
        **applied,
    )


def _shards(policy: MemoryPolicy) -> int:
    """How many pieces FSDP2 cuts each weight into (at most the world size; 1 without FSDP)."""
    import torch.distributed as dist

    return dist.get_world_size() if policy.fsdp.mode != "none" and dist.is_available() and dist.is_initialized() else 1


def describe(model: nn.Module) -> str:
    """A few lines saying what ``prepare_model`` applied to ``model`` (seen through DDP/compile/PEFT wrappers)."""
    record = record_of(model)
    if record is None:
        return f"{type(model).__name__}: not prepared by hf_memstack"
    return record.describe()
