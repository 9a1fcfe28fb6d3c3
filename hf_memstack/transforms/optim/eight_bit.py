"""torchao's ``AdamW8bit`` for ``optim:8bit``, loaded on demand (torchao is an optional extra) and made
trackable: its compiled step runs eagerly under the memory meter's and the estimator's dispatch modes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from ..._quiet import quiet_imports

_INSTALL = "pip install 'hf_memstack[optim]' (torchao)"


@functools.cache
@quiet_imports()  # torchao's import-time noise only (hf_memstack/_quiet.py)
def _torchao_adamw() -> Callable[..., torch.optim.Optimizer]:
    """torchao's ``AdamW8bit`` (with ``bf16_stochastic_round`` under pure bf16), trackable: a class whose
    constructor takes AdamW's arguments (not ``torch.optim.Optimizer``'s ``defaults`` dict)."""
    try:
        from torchao.optim import AdamW8bit
    except Exception as e:  # noqa: BLE001 - an ImportError, or torchao failing to load against this torch
        raise RuntimeError(
            f"policy.optimizer.state='8bit' needs torchao's AdamW8bit, which does not import here ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}); {_INSTALL}, or use policy.optimizer.state='fp32'"
        ) from None
    base = AdamW8bit

    # torchao builds its quantization maps on first use, with a .tolist() that fake tensors (the
    # estimator) cannot answer: build them now, on real tensors (torchao caches them).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with contextlib.suppress(ImportError, AttributeError), unset_fake_temporarily():
        from torchao.optim import subclass_8bit

        subclass_8bit.get_qmap_signed()
        subclass_8bit.get_qmap_unsigned()

    class TrackableAdamW(base):  # type: ignore[valid-type, misc]
        """torchao's AdamW, whose compiled step runs eagerly under a tensor-tracking dispatch mode
        (the memory meter, the estimator's fake tensors): dynamo refuses to compile there, and the
        state it creates is the same."""

        def step(self, closure: Callable[[], float] | None = None) -> float | None:
            if _tracking_mode_active() or _on_fake_tensors(self):
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            return super().step(closure)

    TrackableAdamW.__name__ = TrackableAdamW.__qualname__ = "TrackableAdamW8bit"
    return TrackableAdamW


def _on_fake_tensors(optimizer: torch.optim.Optimizer) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for group in optimizer.param_groups for p in group["params"])


def _tracking_mode_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not getattr(mode, "is_infra_mode", lambda: False)() for mode in _get_current_dispatch_mode_stack())
