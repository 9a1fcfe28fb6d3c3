"""apply_checkpointing: activation checkpointing through the model's own Transformers API, or
PyTorch's non-reentrant ``torch.utils.checkpoint`` around each repeated block when the model has
none (or when the blocks are named explicitly) - block by block, or op by op (selective)."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from ..._device import device_of
from ...policy import CheckpointingConfig
from .._wrappers import CheckpointedForward
from ..blocks import Blocks
from ..tiled_mlp import inside_tiled_mlp

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
    from transformers import PreTrainedModel

__all__ = [
    "SAVED_OPS",
    "CheckpointingGuard",
    "CheckpointingResult",
    "SelectiveCheckpointingWarning",
    "apply_checkpointing",
    "check_checkpointing",
    "install_checkpointing_guard",
    "selective_context_fn",
    "uses_transformers_checkpointing",
]

CheckpointingMethod = Literal["none", "transformers", "torch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointingResult:
    """What :func:`apply_checkpointing` did."""

    method: CheckpointingMethod
    """``transformers`` (the model's ``activation_checkpointing_enable``), ``torch``
    (``torch.utils.checkpoint`` around each block's forward) or ``none``."""
    checkpointed: tuple[int, ...] = ()
    """Indices of the checkpointed blocks (0, n, 2n, ... for every n-th)."""
    note: str = ""
    """Why something asked for was adjusted (e.g. offload on the CPU)."""


def uses_transformers_checkpointing(model: nn.Module, cfg: CheckpointingConfig) -> bool:
    """True when the model's own Transformers API can apply ``cfg`` (else PyTorch's checkpoint is used)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    if cfg.block_classes is not None:
        return False  # an explicit block override is honoured block by block
    if hasattr(model, "activation_checkpointing_enable"):
        return True
    # transformers < 5 has only `gradient_checkpointing_enable`, without every_n_layers / offload.
    return hasattr(model, "gradient_checkpointing_enable") and cfg.mode == "full"


def check_checkpointing(model: nn.Module, cfg: CheckpointingConfig) -> None:
    """Raise before the model is touched when ``cfg`` cannot work on ``model``.

    Raises:
        ValueError: ``use_reentrant=True`` where PyTorch's checkpoint would be used: the reentrant
            implementation passes no keyword arguments to the block and drops the gradients of a
            block whose inputs do not require grad (frozen embeddings, LoRA), so it is refused.
    """
    if cfg.mode != "none" and cfg.use_reentrant and not uses_transformers_checkpointing(model, cfg):
        raise ValueError(
            f"policy.checkpointing.use_reentrant=True: {type(model).__name__} is checkpointed block by block with "
            "torch.utils.checkpoint (it has no Transformers checkpointing API, or block_classes was given), where only "
            "the non-reentrant implementation is used (reentrant checkpointing drops keyword arguments and the gradients "
            "of frozen inputs). Set use_reentrant=False"
        )


def apply_checkpointing(model: nn.Module, cfg: CheckpointingConfig, *, blocks: Blocks | None) -> CheckpointingResult:
    """Enable activation checkpointing on ``model`` in place.

    Transformers models use ``activation_checkpointing_enable`` (5.x; ``gradient_checkpointing_enable``
    on older versions), which also disables the KV cache in checkpointed layers and makes the input
    embeddings' output require grad (frozen embeddings / PEFT). Other models (and explicit
    ``block_classes``) get ``torch.utils.checkpoint`` around each block's forward, installed on the
    instance so that module names and state-dict keys do not change (PEFT adapters save as usual).
    """
    if cfg.mode == "none":
        return CheckpointingResult(method="none")
    every_n = cfg.every_n if cfg.mode == "every_n" else 1
    offload = cfg.mode == "offload"
    note = ""
    if offload and device_of(model).type == "cpu":
        # The saved inputs already live in host memory; Transformers 5.24 would still ask for pinned
        # memory and fail on a host without an accelerator. Full checkpointing is the same thing here.
        offload = False
        note = "offload skipped: the model is on the CPU, its activations are already in host memory"
    # Same choice as Transformers' every_n_layers: blocks 0, n, 2n, ...
    chosen = tuple(i for i in range(len(blocks) if blocks is not None else 0) if i % every_n == 0)

    if uses_transformers_checkpointing(model, cfg):
        pretrained = cast("PreTrainedModel", model)  # supports_gradient_checkpointing: a Transformers model
        kwargs = _checkpoint_kwargs(cfg)
        if hasattr(pretrained, "activation_checkpointing_enable"):
            pretrained.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs, every_n_layers=every_n, offload=offload
            )
        else:
            pretrained.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return CheckpointingResult(method="transformers", checkpointed=chosen, note=note)

    if blocks is None:
        raise ValueError(
            "apply_checkpointing needs the model's blocks (hf_memstack.transforms.blocks.find_blocks(model))"
        )
    extra = {k: v for k, v in _checkpoint_kwargs(cfg).items() if k != "use_reentrant"}
    for i in chosen:
        block = blocks.modules[i]
        block.forward = CheckpointedForward(block, offload=offload, checkpoint_kwargs=extra)  # type: ignore[method-assign]
    return CheckpointingResult(method="torch", checkpointed=chosen, note=note)


def _checkpoint_kwargs(cfg: CheckpointingConfig) -> dict[str, object]:
    """What ``torch.utils.checkpoint.checkpoint`` is given for ``cfg`` (Transformers passes it through)."""
    kwargs: dict[str, object] = {"use_reentrant": cfg.use_reentrant}
    if cfg.mode == "selective":
        kwargs["context_fn"] = selective_context_fn(cfg.selective_matmuls)
    return kwargs


# ------------------------------------------------------------------------------------ selective
def _aten_ops(*names: str) -> frozenset[OpOverload]:
    # Some kernels exist only in some PyTorch builds and versions: keep those this one has.
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


_MATMULS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm")
SAVED_OPS: frozenset[OpOverload] = _MATMULS | _aten_ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""The ops whose outputs selective checkpointing keeps (torchtitan's list for a single device): the
matmuls and attention kernels, which cost most to recompute. Norms, activations, rotary
embeddings, casts and other cheap ops are recomputed in the backward."""


_Contexts = tuple["TorchDispatchMode", "TorchDispatchMode"]
"""What a ``context_fn`` returns: the forward's and the recompute's dispatch modes."""


class SelectiveCheckpointingWarning(UserWarning):
    """Selective checkpointing found no op of its save list in a checkpointed block: it recomputes everything."""


def selective_context_fn(matmuls: str = "save_all") -> functools.partial[_Contexts]:
    """The ``context_fn`` of op-level (selective) checkpointing, for ``torch.utils.checkpoint`` or
    Transformers' ``activation_checkpointing_kwargs``: keep the outputs of :data:`SAVED_OPS`
    (with ``"save_alternate"``, every second matmul is recomputed too, as torchtitan does),
    recompute the rest. A ``functools.partial`` of a module function and a string: dynamo traces
    it (pytorch's checkpoint under compile accepts a partial), pickle and deepcopy copy it."""
    fn = functools.partial(_selective_contexts, matmuls)
    fn.cache_hash = f"hf_memstack.selective_checkpointing.{matmuls}"  # type: ignore[attr-defined]  # compile's cache key
    return fn


def _selective_contexts(matmuls: str) -> _Contexts:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # Counted per checkpointed call, so the forward and its recompute agree on which matmul is which.
    counts: dict[str, int] = defaultdict(int)
    policy = functools.partial(_selective_policy, matmuls, counts)
    # When this call's contexts are done with (after its backward), say if nothing was kept: the
    # block's kernels are not in the list, and everything was recomputed as with full checkpointing.
    weakref.finalize(policy, _warn_if_nothing_saved, counts)
    return create_selective_checkpoint_contexts(policy)


def _selective_policy(
    matmuls: str,
    counts: dict[str, int],
    ctx: SelectiveCheckpointContext,
    op: OpOverload,
    *args: object,
    **kwargs: object,
) -> CheckpointPolicy:
    from torch.utils.checkpoint import CheckpointPolicy

    if inside_tiled_mlp():
        # A tiled MLP keeps one tile's intermediates at a time; saving its matmuls here would keep all.
        return CheckpointPolicy.PREFER_RECOMPUTE
    counts["ops"] += 1
    save = op in SAVED_OPS
    if op in _MATMULS:
        counts["matmuls"] += 1
        save = matmuls == "save_all" or counts["matmuls"] % 2 == 1
    if save:
        counts["saved"] += 1
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _warn_if_nothing_saved(counts: dict[str, int]) -> None:
    if counts["ops"] and not counts["saved"]:
        warnings.warn(
            "policy.checkpointing.mode='selective': no op in the save list (matmuls, attention: "
            "hf_memstack.transforms.checkpointing.apply.SAVED_OPS) ran in a checkpointed block, so every op is recomputed, as with full "
            "checkpointing; the model uses kernels the list does not know. Use checkpointing mode 'full', or report the "
            "kernel to add it",
            SelectiveCheckpointingWarning,
            stacklevel=2,
        )


@dataclass(frozen=True, slots=True)
class _Applied:
    """Checkpointing as it runs on a prepared model, in the terms of Transformers' API."""

    every_n_layers: int | None
    """None: no checkpointing."""
    offload: bool
    checkpoint_kwargs: tuple[tuple[str, object], ...]


class CheckpointingGuard:
    """Stands in for a prepared model's ``activation_checkpointing_enable`` and
    ``gradient_checkpointing_enable``. A later call (``TrainingArguments(gradient_checkpointing=True)``,
    TRL's default ``SFTConfig``, a PEFT helper, user code) changes nothing and says so once, when it
    asks for what the policy already applied or for the default checkpointing (every layer, no
    keyword arguments) over a policy that already checkpoints its own way (``ckpt:2``,
    ``ckpt:selective``, ``ckpt:offload``): the policy's is kept. One that asks for something else
    (other keyword arguments, ``every_n_layers`` or ``offload``; any checkpointing over a policy
    without it) is refused, instead of silently replacing the policy's checkpointing while
    ``model.memstack`` still describes the old one."""

    def __init__(self, name: str, applied: _Applied, policy: str, told: list[bool] | None = None) -> None:
        self.name = name
        self.applied = applied
        self.policy = policy
        self.told = told if told is not None else [False]
        """Shared by a model's two guards: whether the "nothing changed" warning was given."""

    def __call__(
        self,
        checkpointing_kwargs: dict[str, object] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
        **kwargs: Any,
    ) -> None:
        checkpointing_kwargs = kwargs.pop(
            "activation_checkpointing_kwargs", kwargs.pop("gradient_checkpointing_kwargs", checkpointing_kwargs)
        )
        if kwargs:
            raise TypeError(f"{self.name}() got unexpected keyword arguments {sorted(kwargs)}")
        caller = f"{self.name}()"
        problem = self.conflict(checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload, caller=caller)
        if problem:
            raise RuntimeError(problem)
        if not self.told[0]:
            self.told[0] = True
            warnings.warn(self.kept_note(caller), stacklevel=2)

    def kept_note(self, caller: str) -> str:
        """What a call that changes nothing is told."""
        return (
            f"{caller} on a model prepared by hf_memstack with policy {self.policy!r}, which already checkpoints "
            f"({self._applied_text()}): the policy's checkpointing is kept and this call changed nothing. Set "
            "activation_checkpointing=False in your TrainingArguments/SFTConfig to silence this (gradient_checkpointing=False "
            "on a Transformers without activation_checkpointing)"
        )

    def conflict(
        self,
        checkpointing_kwargs: dict[str, object] | None,
        *,
        every_n_layers: int = 1,
        offload: bool = False,
        caller: str,
        fix: str = (
            "set activation_checkpointing=False in your TrainingArguments/SFTConfig (gradient_checkpointing=False on a "
            "Transformers without activation_checkpointing)"
        ),
    ) -> str | None:
        """Why enabling checkpointing this way would replace the policy's (None: it asks for the
        same, or for the default over a policy that checkpoints)."""
        requested = _Applied(every_n_layers, offload, _normalised(checkpointing_kwargs))
        if requested == self.applied or (self.applied.every_n_layers is not None and requested == _DEFAULT_REQUEST):
            return None
        instead = (
            f"with checkpointing in the policy (e.g. '{self.policy}+ckpt')"
            if self.applied.every_n_layers is None
            else "with the checkpointing you want in the policy"
        )
        return (
            f"{caller} asks for checkpointing with every_n_layers={every_n_layers}, offload={offload}, "
            f"kwargs={dict(requested.checkpoint_kwargs)}, which would replace the checkpointing of this model's hf_memstack "
            f"policy {self.policy!r} ({self._applied_text()}). Checkpointing is set by the policy: {fix} (hf_memstack's "
            f"training_arguments() does), or prepare a fresh model {instead}"
        )

    def _applied_text(self) -> str:
        a = self.applied
        if a.every_n_layers is None:
            return "no checkpointing"
        return f"every_n_layers={a.every_n_layers}, offload={a.offload}, kwargs={dict(a.checkpoint_kwargs)}"


def install_checkpointing_guard(
    model: nn.Module, cfg: CheckpointingConfig, result: CheckpointingResult, policy: str
) -> bool:
    """Put :class:`CheckpointingGuard` in place of the model's Transformers checkpointing methods
    (on the instance). Returns False for models without them."""
    names = [n for n in ("activation_checkpointing_enable", "gradient_checkpointing_enable") if hasattr(model, n)]
    if not names or not getattr(model, "supports_gradient_checkpointing", False):
        return False
    if result.method == "none":
        applied = _Applied(None, False, ())
    else:
        every_n = cfg.every_n if cfg.mode == "every_n" else 1
        offload = cfg.mode == "offload" and not result.note
        applied = _Applied(every_n, offload, _normalised(_checkpoint_kwargs(cfg)))
    told = [False]
    for name in names:
        setattr(model, name, CheckpointingGuard(name, applied, policy, told))
    return True


def _normalised(kwargs: dict[str, object] | None) -> tuple[tuple[str, object], ...]:
    # Transformers' default when no kwargs are given is non-reentrant checkpointing. A context_fn
    # compares by what it is (selective_context_fn("save_all") twice is the same request).
    merged = {"use_reentrant": False, **(kwargs or {})}
    return tuple(sorted((k, _comparable(v)) for k, v in merged.items()))


def _comparable(value: object) -> object:
    if isinstance(value, functools.partial):
        if value.func is _selective_contexts:
            return f"selective({', '.join(map(str, value.args))})"
        return (
            getattr(value.func, "__qualname__", repr(value.func)),
            value.args,
            tuple(sorted(value.keywords.items())),
        )
    return value


# What Trainer asks for with gradient_checkpointing=True and no keyword arguments (TRL's default).
_DEFAULT_REQUEST = _Applied(1, False, _normalised(None))
