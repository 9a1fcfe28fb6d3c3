"""Pre-flight for FSDP: the checks every rank passes, and agrees it passed, before the first
sharding collective, so that a rank that failed or shards differently ends every rank with its
message instead of leaving the others waiting in an all-gather until the group times out."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import DistributedMismatchError
from ..policy import FSDPConfig

__all__ = ["agree_before_sharding", "check_hybrid_shard", "local_world_size", "require_process_group"]

_HOW_TO_LAUNCH = (
    "launch with several processes, e.g. `torchrun --nproc_per_node 2 train.py` or "
    "`accelerate launch --config_file recipes/configs/fsdp.yaml train.py`, and call "
    "torch.distributed.init_process_group() (or create an Accelerator) before prepare_model; "
    "or drop fsdp from the policy (e.g. 'bf16+ckpt')"
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
            "to the ranks that built the model on the meta device; load it with hf_memstack.distributed.from_pretrained_for_fsdp",
            failed_ranks=(0,),
        )
    return any(e.meta for e in everyone)


def _agree_on_nodes(everyone: list[_RankReport]) -> None:
    """Hybrid sharding splits the world into nodes of LOCAL_WORLD_SIZE ranks: ranks that see different
    sizes build different meshes and wait in each other's collectives until the group times out."""

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
    local = local_world_size()
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


def local_world_size() -> int:
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
