"""apply_fsdp: shard a model with PyTorch's FSDP2 (``fully_shard``) - each block, then the root -
with a mixed-precision policy derived from the memory policy's precision."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..policy import FSDPConfig
from ..transforms.blocks import Blocks
from ..transforms.precision import ResolvedPrecision
from ._ranks import on_every_rank
from ._safe_dcp import UntrustedCheckpointError

__all__ = [
    "FSDPResult",
    "UntrustedCheckpointError",
    "accelerate_fsdp_plugin",
    "apply_fsdp",
    "agree_before_sharding",
    "check_accelerate_fsdp",
    "check_checkpoint_folder",
    "check_hybrid_shard",
    "from_pretrained_for_fsdp",
    "load_sharded_checkpoint",
    "require_process_group",
    "save_pretrained_full",
    "save_sharded_checkpoint",
]

_HOW_TO_LAUNCH = (
    "launch with several processes, e.g. `torchrun --nproc_per_node 2 train.py` or "
    "`accelerate launch --config_file recipes/configs/fsdp.yaml train.py`, and call "
    "torch.distributed.init_process_group() (or create an Accelerator) before prepare_model; "
    "or drop fsdp from the policy (e.g. 'bf16+ckpt')"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPResult:
    """How the model was sharded."""

    mode: str
    """The policy's ``fsdp.mode``."""
    by: Literal["fully_shard", "accelerator.prepare"]
    """``fully_shard`` (hf_memstack sharded it) or ``accelerator.prepare`` (Accelerate's FSDP2 plugin will)."""
    world_size: int = 1
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    weights_from: Literal["each rank", "rank 0 broadcast", "accelerate"] = "each rank"
    """Where the weights in the shards came from."""

    def describe(self) -> str:
        if self.by == "accelerator.prepare":
            return f"{self.mode} by accelerator.prepare (Accelerate's FSDP2 plugin)"
        return (
            f"{self.mode} by fully_shard over {self.world_size} ranks, reshard_after_forward={self.reshard_after_forward}, "
            f"cpu_offload={self.cpu_offload}, weights from {self.weights_from}"
        )


def require_process_group(cfg: FSDPConfig) -> None:
    """Raise RuntimeError when FSDP is asked for without an initialised process group."""
    if cfg.mode != "none" and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"policy.fsdp.mode={cfg.mode!r} needs a torch.distributed process group, and none is initialised: {_HOW_TO_LAUNCH}"
        )


@dataclass(frozen=True, slots=True)
class _RankReport:
    """What one rank tells the others before sharding (one all-gather)."""

    error: str | None
    """This rank's pre-flight error (type and message), or None."""
    policy: dict[str, Any] | None
    model: list[tuple[str, tuple[int, ...], str]]
    """(name, shape, dtype) of every parameter."""
    meta: bool
    """This rank holds the model on the meta device (from_pretrained_for_fsdp)."""
    local_world_size: str | None = None
    """``LOCAL_WORLD_SIZE`` as this rank sees it: hybrid sharding builds its mesh from it."""


def agree_before_sharding(
    policy: dict[str, Any] | None, model: nn.Module | None, local_error: BaseException | None
) -> bool:
    """The ranks agree, with one all-gather, that every rank passed its pre-flight checks and holds
    the same policy and the same model, before any sharding collective could wait forever on a rank
    that failed or shards differently. Every rank raises if any rank failed or differs.

    Returns:
        True when some rank holds ``model`` on the meta device (see :func:`from_pretrained_for_fsdp`):
        rank 0's weights are then broadcast into every rank's shards after sharding.

    Raises:
        The rank's own pre-flight error on the rank that failed; :class:`DistributedMismatchError`
        on every other rank (naming the failed rank and its error), and on every rank when the
        policies or models differ, or rank 0 is on the meta device.
    """
    from ..errors import DistributedMismatchError

    error = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    mine = _RankReport(
        error, policy, _signature(model), model is not None and _on_meta(model), os.environ.get("LOCAL_WORLD_SIZE")
    )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = tuple(r for r, e in enumerate(everyone) if e.error is not None)
    if local_error is not None:
        raise local_error
    if failed:
        raise DistributedMismatchError(
            f"prepare_model failed on rank(s) {list(failed)} before sharding, so no rank shards: "
            + "; ".join(f"rank {r}: {everyone[r].error}" for r in failed),
            failed_ranks=failed,
        )
    differing = tuple(r for r, e in enumerate(everyone) if e.policy != everyone[0].policy)
    if differing:
        fields = "; ".join(
            f"rank {r}: " + ", ".join(_policy_differences(everyone[0].policy, everyone[r].policy)) for r in differing
        )
        raise DistributedMismatchError(
            f"the ranks were given different memory policies ({fields}); pass the same policy on every rank (e.g. from one "
            "config file)",
            failed_ranks=differing,
        )
    _agree_on_nodes(everyone)
    for r, e in enumerate(everyone):
        if e.model != everyone[0].model:
            first = next((a, b) for a, b in zip([*everyone[0].model, None], [*e.model, None]) if a != b)
            raise DistributedMismatchError(
                f"rank {r} holds a different model from rank 0 (first difference: rank 0 has {first[0]}, rank {r} has "
                f"{first[1]}; entries are (name, shape, dtype)): load the same checkpoint with the same dtype on every rank",
                failed_ranks=(r,),
            )
    if everyone[0].meta:
        raise DistributedMismatchError(
            "rank 0's model is on the meta device: under FSDP, rank 0 must hold the real weights, which it broadcasts "
            "to the ranks that built the model on the meta device; load it with hf_memstack.from_pretrained_for_fsdp",
            failed_ranks=(0,),
        )
    return any(e.meta for e in everyone)


def _agree_on_nodes(everyone: list[_RankReport]) -> None:
    """Hybrid sharding splits the world into nodes of LOCAL_WORLD_SIZE ranks: ranks that see different
    sizes build different meshes and wait in each other's collectives until the group times out."""
    from ..errors import DistributedMismatchError

    if (everyone[0].policy or {}).get("fsdp", {}).get("mode") != "hybrid_shard":
        return
    differing = tuple(r for r, e in enumerate(everyone) if e.local_world_size != everyone[0].local_world_size)
    if differing:
        seen = "; ".join(f"rank {r}: LOCAL_WORLD_SIZE={e.local_world_size!r}" for r, e in enumerate(everyone))
        raise DistributedMismatchError(
            f"policy.fsdp.mode='hybrid_shard' needs the same processes per node on every rank, and the ranks see different "
            f"LOCAL_WORLD_SIZE values ({seen}): launch with torchrun or accelerate launch, which set it, or set it to the "
            "same number on every rank",
            failed_ranks=differing,
        )


def _policy_differences(reference: dict[str, Any], other: dict[str, Any], prefix: str = "policy") -> list[str]:
    """``policy.precision='fp32' where rank 0 has 'bf16'``, one per differing field."""
    out = []
    for key in sorted(set(reference) | set(other)):
        a, b = reference.get(key), other.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _policy_differences(a, b, f"{prefix}.{key}")
        elif a != b:
            out.append(f"{prefix}.{key}={b!r} where rank 0 has {a!r}")
    return out


def check_hybrid_shard(cfg: FSDPConfig) -> None:
    """Raise ValueError when hybrid sharding cannot split this world into nodes."""
    if cfg.mode != "hybrid_shard":
        return
    local = _local_world_size()
    if dist.get_world_size() % local:
        raise ValueError(
            f"policy.fsdp.mode='hybrid_shard': world size {dist.get_world_size()} is not a multiple of the "
            f"processes per node (LOCAL_WORLD_SIZE={local}); set LOCAL_WORLD_SIZE to the processes on each node, "
            "or use mode='full_shard'"
        )


def _signature(model: nn.Module | None) -> list[tuple[str, tuple[int, ...], str]]:
    if model is None:
        return []
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()]


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def apply_fsdp(
    model: nn.Module,
    cfg: FSDPConfig,
    *,
    blocks: Blocks,
    precision: ResolvedPrecision,
    broadcast_from_rank0: bool = False,
) -> FSDPResult:
    """Shard ``model`` in place with ``fully_shard``: each block, then the root.

    Parameters are gathered in the policy's dtype for compute (bf16/fp16) while gradients are
    reduced in fp32; the sharded master parameters stay fp32. With ``broadcast_from_rank0`` (some
    rank built the model on the meta device), rank 0's weights fill every rank's shards afterwards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = _reshard_after_forward(cfg)
    mp = _mixed_precision_policy(precision)
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    mesh = _mesh(cfg, precision.device_type)
    # Rank 0 keeps references to its full tensors through sharding: they are what it broadcasts.
    full_state = model.state_dict() if broadcast_from_rank0 and dist.get_rank() == 0 else None
    for block in blocks.modules:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    # The root keeps the embeddings and head; it is not resharded after forward because its
    # parameters are needed again at the start of backward.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    _reshard_after_no_grad_forward(model)
    if broadcast_from_rank0:
        _load_from_rank0(model, full_state, device=mesh.device_type)
    return FSDPResult(
        mode=cfg.mode,
        by="fully_shard",
        world_size=dist.get_world_size(),
        reshard_after_forward=reshard,
        cpu_offload=cfg.cpu_offload,
        weights_from="rank 0 broadcast" if broadcast_from_rank0 else "each rank",
    )


def _reshard_after_no_grad_forward(model: nn.Module) -> None:
    """A forward without gradients (evaluation, ``verify``, ``generate``) would leave the root's
    parameters unsharded (its ``reshard_after_forward=False`` keeps them for the backward, which
    never comes), and until the next backward ``model.parameters()`` then yields the unsharded
    tensors, not the DTensor shards: an optimizer built after an evaluation (measured on 2 gloo
    ranks) updated those and training went wrong from its first step. The root reshards after
    every forward without gradients (generation gathers its few root parameters once a token)."""

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            module.reshard()

    model.register_forward_hook(after)


def _reshard_after_forward(cfg: FSDPConfig) -> bool:
    # shard_grad_op (ZeRO-2) keeps the gathered parameters from forward to backward.
    return cfg.reshard_after_forward if cfg.reshard_after_forward is not None else cfg.mode != "shard_grad_op"


def _mixed_precision_policy(precision: ResolvedPrecision) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # Compute in the policy's dtype, reduce gradients in fp32: summing bf16 gradients over many
    # ranks loses precision (Accelerate's default FSDP2 policy reduces in the compute dtype).
    return MixedPrecisionPolicy(param_dtype=precision.dtype if precision.mixed else None, reduce_dtype=torch.float32)


def accelerate_fsdp_plugin(policy: Any, model: nn.Module) -> Any:
    """Accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2)`` built from the policy, for
    ``Accelerator(fsdp_plugin=...)`` on GPUs: ``accelerator.prepare`` then shards the same blocks,
    with the same mixed precision (fp32 gradient reduction), offload and resharding as
    :func:`apply_fsdp`, and Accelerate's ``backward``, ``clip_grad_norm_`` and ``save_state`` (sharded)
    work as usual. Checkpointing stays with ``prepare_model`` (Transformers' own), so the plugin's
    ``activation_checkpointing`` is off.

    Raises:
        ValueError: the policy has no fsdp, asks for hybrid_shard (use torchrun and the direct path),
            or the model's blocks cannot be found.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    from ..policy import MemoryPolicy
    from ..transforms.blocks import find_blocks
    from ..transforms.precision import resolve_precision

    policy = MemoryPolicy.coerce(policy)
    cfg = policy.fsdp
    if cfg.mode == "none":
        raise ValueError("policy.fsdp.mode='none': an FSDP plugin needs a sharding policy, e.g. 'bf16+ckpt+fsdp'")
    if cfg.mode == "hybrid_shard":
        raise ValueError(
            "policy.fsdp.mode='hybrid_shard' is not built into an Accelerate plugin here (Accelerate needs a "
            "ParallelismConfig for it); launch with torchrun so prepare_model shards directly, or use 'fsdp' (full_shard)"
        )
    blocks = find_blocks(model, policy.checkpointing.block_classes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(blocks.class_names),
        reshard_after_forward=_reshard_after_forward(cfg),
        mixed_precision_policy=_mixed_precision_policy(resolve_precision(policy.precision, device)),
        cpu_offload=cfg.cpu_offload,
        state_dict_type="SHARDED_STATE_DICT",
        activation_checkpointing=False,
        cpu_ram_efficient_loading=False,
    )


def check_accelerate_fsdp(policy: Any, accelerator: Any) -> bool:
    """True when ``accelerator`` will shard the model itself (Accelerate's FSDP); then its plugin
    must be FSDP2 and agree with the policy.

    Raises:
        ValueError: the Accelerator shards but the policy has no fsdp, or its plugin disagrees.
    """
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    if accelerator is None or accelerator.distributed_type != DistributedType.FSDP:
        return False
    plugin = accelerator.state.fsdp_plugin
    fix = "build the plugin from the policy: Accelerator(fsdp_plugin=hf_memstack.accelerate_fsdp_plugin(policy, model))"
    if policy.fsdp.mode == "none":
        raise ValueError(
            "the Accelerator shards the model with FSDP (an FSDP launch config or plugin) but policy.fsdp.mode='none'; "
            "add fsdp to the policy (e.g. 'bf16+ckpt+fsdp') so checkpointing and compile are placed inside the shards, "
            "or launch with a DDP config (recipes/configs/multi-gpu-ddp.yaml)"
        )
    problems = []
    if plugin.fsdp_version != 2:
        problems.append(f"fsdp_version={plugin.fsdp_version} (hf_memstack composes with FSDP2 only: fsdp_version: 2)")
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) != policy.fsdp.cpu_offload:
        problems.append(
            f"cpu_offload={type(plugin.cpu_offload).__name__} but policy.fsdp.cpu_offload={policy.fsdp.cpu_offload}"
        )
    if plugin.fsdp_version == 2 and plugin.reshard_after_forward != _reshard_after_forward(policy.fsdp):
        problems.append(
            f"reshard_after_forward={plugin.reshard_after_forward} but policy.fsdp gives {_reshard_after_forward(policy.fsdp)}"
        )
    if problems:
        raise ValueError(f"the Accelerator's FSDP plugin disagrees with the policy: {'; '.join(problems)}; {fix}")
    return True


def _load_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, device: str) -> None:
    """Fill each rank's shards from rank 0's full state dict, one tensor at a time (PyTorch's
    ``broadcast_from_rank0``), then the non-persistent buffers, which no state dict carries
    (rotary ``inv_freq``: meta on the other ranks, and recomputing them needs each model's code)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    for module in model.modules():
        for leaf, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[leaf] = torch.empty_like(buf, device=device)
    set_model_state_dict(
        model, full_state or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for module in model.modules():
        for leaf in sorted(module._non_persistent_buffers_set):
            buf = module._buffers.get(leaf)
            if buf is not None:
                dist.broadcast(buf, src=0)


def from_pretrained_for_fsdp(model_class: Any, pretrained: str, **kwargs: Any) -> nn.Module:
    """Load a pretrained model for FSDP without a full copy on every rank.

    Rank 0 calls ``model_class.from_pretrained(pretrained, **kwargs)``; every other rank builds the
    same architecture, in rank 0's dtype, on the meta device (no memory). ``prepare_model`` with an
    ``fsdp`` policy then broadcasts rank 0's weights into each rank's shards. Call it on every rank,
    after the process group is initialised; without one it is plain ``from_pretrained``.

    ``model_class`` is an ``AutoModelFor*`` class or a model class.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model_class.from_pretrained(pretrained, **kwargs)
    model, dtype = _load_on_rank0(model_class, pretrained, kwargs)
    return model if model is not None else _meta_skeleton(model_class, pretrained, dtype, kwargs)


def _load_on_rank0(model_class: Any, pretrained: str, kwargs: dict[str, Any]) -> tuple[nn.Module | None, torch.dtype]:
    """Rank 0 loads; every rank learns the dtype it loaded in ("auto" may pick the checkpoint's),
    or that it failed - then every rank raises, instead of waiting for weights that never come."""
    from ..errors import DistributedMismatchError

    model, error = None, None
    if dist.get_rank() == 0:
        try:
            model = model_class.from_pretrained(pretrained, **kwargs)
        except Exception as e:  # noqa: BLE001 - told to the other ranks (waiting in the broadcast), then re-raised
            error = e
    if error is not None:
        outcome = f"{type(error).__name__}: {error}"
    else:
        outcome = next((str(p.dtype) for p in model.parameters()), "torch.float32") if model is not None else None
    message = [outcome]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if not str(message[0]).startswith("torch."):
        raise DistributedMismatchError(
            f"rank 0 could not load {pretrained!r}, so no rank can shard it: {message[0]}", failed_ranks=(0,)
        )
    return model, getattr(torch, message[0].removeprefix("torch."))


def _meta_skeleton(model_class: Any, pretrained: str, dtype: torch.dtype, kwargs: dict[str, Any]) -> nn.Module:
    """The architecture rank 0 loaded, on the meta device, in its dtype."""
    from transformers import AutoConfig

    trust = kwargs.get("trust_remote_code", False)
    config = kwargs.get("config") or AutoConfig.from_pretrained(
        pretrained, trust_remote_code=trust, revision=kwargs.get("revision")
    )
    # Loading options (dtype: rank 0's, revision, use_safetensors...) do not go to the config;
    # those that shape the architecture (num_labels, ...) go to the config, as from_pretrained does.
    config.update(
        {
            k: v
            for k, v in kwargs.items()
            if k not in ("config", "attn_implementation", "dtype", "torch_dtype") and hasattr(config, k)
        }
    )
    extra = {"attn_implementation": kwargs["attn_implementation"]} if kwargs.get("attn_implementation") else {}
    with torch.device("meta"):
        if hasattr(model_class, "_model_mapping"):  # an AutoModelFor* class
            return model_class.from_config(config, dtype=dtype, trust_remote_code=trust, **extra)
        return model_class._from_config(config, dtype=dtype, **extra)


def _local_world_size() -> int:
    """Processes per node, from ``LOCAL_WORLD_SIZE`` (torchrun and Accelerate set it), else the world size.

    Raises:
        ValueError: the variable is not a positive whole number.
    """

    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return dist.get_world_size()
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"policy.fsdp.mode='hybrid_shard' reads the processes per node from the environment variable "
            f"LOCAL_WORLD_SIZE={raw!r}, which is not a positive whole number; launch with torchrun or accelerate launch "
            "(they set it), set it to the number of processes on each node, or unset it (one node)"
        )
    return value


def _mesh(cfg: FSDPConfig, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if cfg.mode == "hybrid_shard":
        local = _local_world_size()
        return init_device_mesh(device_type, (world // local, local), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))


def save_pretrained_full(model: nn.Module, save_directory: str, **kwargs: Any) -> None:
    """Gather the full state dict on rank 0 (in CPU memory) and write it with ``save_pretrained``
    (safetensors, mode ``0o666 & ~umask`` like the other files), loadable by ``from_pretrained`` in
    one process. Call it on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from ..files import weights_follow_umask

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        original = type(model)
        # FSDP2 swaps the class for a generated `FSDP<Class>`: save under the model's own class name.
        model.__class__ = next(c for c in original.__mro__ if not c.__name__.startswith("FSDP"))
        try:
            # safetensors writes its files mode 0600: they get the umask's mode, like config.json (see files.py).
            with weights_follow_umask(save_directory):
                model.save_pretrained(save_directory, state_dict=state, safe_serialization=True, **kwargs)
        finally:
            model.__class__ = original
    dist.barrier()


MANIFEST = "hf_memstack_checkpoint.json"


def save_sharded_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str) -> None:
    """Each rank writes its own shards of the model and optimizer (torch.distributed.checkpoint);
    then rank 0 writes a manifest (every file's size, the metadata file's SHA-256), last, so that a
    directory without it is incomplete or was not written here. Call it on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    dist.barrier()  # every rank's files are written before rank 0 describes them
    # A manifest rank 0 cannot write (a full disk) ends every rank with its error, not a wait.
    on_every_rank(
        "save_sharded_checkpoint: the manifest",
        lambda: _write_manifest(Path(checkpoint_dir)) if dist.get_rank() == 0 else None,
    )


def load_sharded_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str, *, trusted: bool = False
) -> None:
    """Load what :func:`save_sharded_checkpoint` wrote into an already sharded model and optimizer.
    Call it on every rank.

    Security: torch.distributed.checkpoint unpickles the checkpoint's ``.metadata`` and loads its
    non-tensor items with ``torch.load(weights_only=False)``, and unpickling can run code; a
    manifest whose sizes and hash match proves only that the folder is self-consistent, not where
    it came from. So without ``trusted=True`` nothing from the folder is unpickled as is: the
    manifest must be there and match, ``.metadata`` is read by an unpickler that builds only DCP's
    metadata types, the data files it names must be inside the folder, and every item is loaded
    weights-only. ``trusted=True`` loads the folder as DCP does, also one written some other way:
    only for checkpoints you made yourself.

    Raises:
        ValueError: no manifest (an incomplete or foreign checkpoint), files that differ from it, or
            (``UntrustedCheckpointError``) metadata or items that are not plain data - the message
            says how to trust a folder you made. Raised on every rank when any rank finds it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(checkpoint_dir)
    # Every rank reads the folder before DCP's collectives: one that fails stops them all.
    reader, planner = on_every_rank(
        "load_sharded_checkpoint: checking the folder", lambda: (None, None) if trusted else _vetted_reader(directory)
    )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir, storage_reader=reader, planner=planner)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def check_checkpoint_folder(checkpoint_dir: str | Path) -> None:
    """Check, without unpickling anything as is, that a torch.distributed.checkpoint folder holds
    only plain data: its ``.metadata`` only DCP's metadata types, its data files inside the folder,
    its non-tensor items loadable with ``torch.load(weights_only=True)``. A folder that passes can
    then be loaded by another reader (e.g. Accelerate's ``load_state`` under FSDP) without running
    code from it.

    Raises:
        UntrustedCheckpointError: (a ``ValueError``) what is not plain data, and how to trust the folder.
    """
    from ._safe_dcp import vet_checkpoint

    vet_checkpoint(checkpoint_dir)


def _vetted_reader(directory: Path) -> tuple[Any, Any]:
    """A DCP reader that hands out the metadata already read safely, and a planner that loads
    non-tensor items weights-only (DefaultLoadPlanner's own ``load_bytes`` does not)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from ._safe_dcp import vet_checkpoint, weights_only_load

    _check_manifest(directory)
    metadata = vet_checkpoint(directory)  # refuses here, clearly, what the planner below would refuse inside DCP

    class VettedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # Never the file again (nor DCP's fallback, a rank-local __N.metadata): the object read safely.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            super().load_bytes(read_item, weights_only_load(value))

    return VettedReader(str(directory)), WeightsOnlyPlanner()


def _write_manifest(directory: Path) -> None:
    import json

    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {
        "format": "hf_memstack sharded checkpoint 1",
        "files": files,
        "metadata_sha256": _sha256(directory / ".metadata") if (directory / ".metadata").is_file() else None,
    }
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, directory / MANIFEST)


def _check_manifest(directory: Path) -> None:
    import json

    from ._safe_dcp import plain_file_name

    path = directory / MANIFEST
    fix = (
        "a directory written by hf_memstack.distributed.fsdp.save_sharded_checkpoint has it; a checkpoint written some other way "
        "loads with trusted=True - only for a checkpoint you made (torch.distributed.checkpoint unpickles its files)"
    )
    if not path.is_file():
        raise ValueError(
            f"checkpoint {str(directory)!r} has no {MANIFEST} (incomplete, or not written by hf_memstack); {fix}"
        )
    try:
        manifest = json.loads(path.read_text())
        files = dict(manifest["files"])
        odd = [name for name, size in files.items() if not plain_file_name(name) or not isinstance(size, int)]
        if odd:
            raise ValueError(f"it lists {odd[:3]}, which are not (file name in the folder, size) entries")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(directory)!r}: {MANIFEST} is unreadable ({e}); {fix}") from None
    problems = [f"{name} is a symlink (a save writes files)" for name in files if (directory / name).is_symlink()]
    problems += [
        f"{name} is missing"
        if not (directory / name).is_file()
        else f"{name} has {(directory / name).stat().st_size} bytes, the manifest says {size}"
        for name, size in files.items()
        if not (directory / name).is_file() or (directory / name).stat().st_size != size
    ]
    if not problems and manifest.get("metadata_sha256") != _sha256(directory / ".metadata"):
        problems.append(".metadata differs from the one the manifest describes")
    if problems:
        raise ValueError(f"checkpoint {str(directory)!r} does not match its manifest ({'; '.join(problems)}); {fix}")


def _sha256(path: Path) -> str | None:
    import hashlib

    if not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()
