"""Instance-level forward wrappers: autocast around a model's forward, checkpoint around a block's.

A wrapper replaces ``module.forward`` on the instance (the class is untouched) with a small
callable object that keeps everything code inspects and copies about a forward: the signature and
docstring (through ``__wrapped__``, as ``functools.wraps`` sets it, so Trainer's
``remove_unused_columns`` sees the real arguments), ``copy.deepcopy``, ``pickle``, and
``torch.compile`` (dynamo inlines the call). Module names and state-dict keys do not change, so
PEFT adapters, ``save_pretrained`` and FSDP2 see the model exactly as before.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._device import device_of
from .._unwrap import peft_class

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["AutocastForward", "CheckpointedForward", "forward_wrapper", "fused_lm_head_installed"]


class _ForwardWrapper:
    """Calls the module's original forward; subclasses add what happens around the call."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # The forward as it is now (the class's, bound): what this wrapper calls.
        original = module.forward
        functools.update_wrapper(self, getattr(original, "__func__", original), updated=())
        self.__wrapped__ = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __reduce__(self) -> tuple[object, ...]:
        # Unpickling rebuilds the wrapper around the module's class forward (the module's own
        # attributes, this one included, are restored after the wrapper is rebuilt), or around the
        # wrapper it was stacked on (the chunked loss under autocast, on one model).
        inner = self.__wrapped__ if isinstance(self.__wrapped__, _ForwardWrapper) else None
        return (_rebuild, (type(self), self.module, self._options(), inner))

    def _options(self) -> dict[str, object]:
        return {}


def _rebuild(
    cls: type[_ForwardWrapper], module: nn.Module, options: dict[str, object], inner: _ForwardWrapper | None = None
) -> _ForwardWrapper:
    wrapper = cls(module, **options)
    if inner is not None:
        wrapper.__wrapped__ = inner
    return wrapper


class AutocastForward(_ForwardWrapper):
    """Runs the forward under ``torch.autocast`` and returns fp32 outputs (Accelerate's recipe:
    a plain ``loss.backward()`` loop then works for bf16, and the loss is reduced in fp32).

    Every output, the logits included, even when the model computed its loss: a user's own loss
    term from ``outputs.logits`` (a KL against a teacher, a z-loss) then runs in fp32, and
    ``allclose``/``numpy()`` on the logits work whether or not labels were passed. The copy costs
    ~1.5% of a step on the ladder model of docs/benchmarks.md (measured); leaving the logits in bf16 when a loss
    was computed was tried and reverted, because such loss terms then silently lost precision.
    The chunked loss (``loss:chunked``) makes no full logits, so it has no such copy."""

    def __init__(self, module: nn.Module, *, dtype: torch.dtype) -> None:
        super().__init__(module)
        self.dtype = dtype

    def __call__(self, *args: object, **kwargs: object) -> object:
        from accelerate.utils import convert_to_fp32

        # The device type is read per call so that a model moved after prepare_model still autocasts.
        with torch.autocast(device_type=device_of(self.module).type, dtype=self.dtype):
            outputs = self.__wrapped__(*args, **kwargs)
        return convert_to_fp32(outputs)

    def _options(self) -> dict[str, object]:
        return {"dtype": self.dtype}


class CheckpointedForward(_ForwardWrapper):
    """Runs a block's forward under non-reentrant ``torch.utils.checkpoint`` while training:
    only the block's inputs are kept for backward, the rest is recomputed. With ``offload`` the
    kept inputs live in (pinned, when a GPU exists) host memory."""

    def __init__(
        self, module: nn.Module, *, offload: bool = False, checkpoint_kwargs: dict[str, Any] | None = None
    ) -> None:
        super().__init__(module)
        self.offload = offload
        self.checkpoint_kwargs = dict(checkpoint_kwargs or {})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # As in Transformers' own layers: checkpoint only when a backward will follow.
        if not (self.module.training and torch.is_grad_enabled()):
            return self.__wrapped__(*args, **kwargs)
        if not self.offload:
            return checkpoint(self.__wrapped__, *args, use_reentrant=False, **self.checkpoint_kwargs, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return checkpoint(self.__wrapped__, *args, use_reentrant=False, **self.checkpoint_kwargs, **kwargs)

    def _options(self) -> dict[str, object]:
        return {"offload": self.offload, "checkpoint_kwargs": self.checkpoint_kwargs}


_Wrapper = TypeVar("_Wrapper", bound=_ForwardWrapper)


def forward_wrapper(module: nn.Module, kind: type[_Wrapper]) -> _Wrapper | None:
    """The wrapper of ``kind`` installed on ``module.forward``, if any (seen through other wrappers)."""
    forward: object = module.__dict__.get("forward")
    seen = 0
    while forward is not None and seen < 16:
        if isinstance(forward, kind):
            return forward
        forward = getattr(forward, "__wrapped__", None)
        if isinstance(forward, types.MethodType):
            return None
        seen += 1
    return None


def fused_lm_head_installed(module: nn.Module) -> bool:
    """True when ``module.forward`` is TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``,
    installed by SFTTrainer, DPOTrainer, GRPOTrainer, ...), seen through hf_memstack's and
    Accelerate's wrappers: a forward taking ``fused_lm_head=True`` that then calls the backbone
    and ``lm_head.weight`` directly, around the model's own forward. Each function's own
    parameters are read, not the signature it copies from the model's forward (``functools.wraps``).
    For a PEFT model, the model it wraps is looked at too (TRL patches that one)."""
    if peft_class(module) and hasattr(module, "get_base_model"):
        base = cast("PeftModel", module).get_base_model()  # only PEFT's PeftModel (and subclasses) has it
        if base is not module:
            return _fused_forward(module.__dict__.get("forward")) or _fused_forward(base.__dict__.get("forward"))
    return _fused_forward(module.__dict__.get("forward"))


def _fused_forward(forward: object) -> bool:
    for _ in range(16):
        if isinstance(forward, types.MethodType):
            forward = forward.__func__
        if forward is None:
            return False
        if (
            isinstance(forward, types.FunctionType)
            and "fused_lm_head" in inspect.signature(forward, follow_wrapped=False).parameters
        ):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False
