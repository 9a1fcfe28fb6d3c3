"""BF16AdamW: AdamW for pure bf16 training (``weights:bf16``) - bf16 weights and moments, each
update computed in fp32 and written back with stochastic rounding.

Rounding an fp32 value to bf16 to the nearest drops every update smaller than half a bf16 step
(2^-8 relative): plain AdamW over bf16 weights stops learning once its updates get that small.
Stochastic rounding rounds up with probability equal to the dropped fraction (its 16 low bits
over 2^16), so the weight is right in expectation and small updates accumulate
(Gupta et al. 2015; torchao's ``_AdamW(bf16_stochastic_round=True)`` does the same).

Why not torchao's: its step is one ``torch.compile``d function per parameter shape. On a CPU that
compiles for minutes, and eagerly (as under the memory meter or on fake tensors) it holds about
ten fp32 copies of the largest parameter at once (503 MiB of step memory for MiniLM-L6's 45 MiB of
bf16 weights, measured). This step runs eagerly in chunks of ``_CHUNK`` values, in place: five fp32
buffers of one chunk at most, on any device, and on FSDP2's sharded DTensors (their local shards).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

    from .groups import ParamGroup

__all__ = ["BF16AdamW", "rounds_stochastically", "stochastic_round_to_bf16", "warn_on_plain_steps_over_pure_bf16"]

# Values per chunk of the fp32 work: bounds the step's temporaries at 5 x 4 MiB, and costs nothing
# measurable against one pass over the whole tensor.
_CHUNK = 1 << 20


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (fp32) in bf16, rounded up or down at random: up with probability (low 16 bits) / 2^16.

    Adding a uniform 16-bit integer to the fp32 bit pattern carries into the bf16 bits exactly with
    that probability; masking the low bits then truncates. The carry also steps the exponent when the
    mantissa overflows, which is the next bf16 value (as torchao's rounding does)."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, device=bits.device, dtype=torch.int32, generator=generator)
    return (bits + noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)  # -65536 == 0xFFFF0000


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments, as ``torch.optim.AdamW``) over bf16
    parameters, with bf16 moments and stochastic rounding of the weights: 2 (weight) + 2 (gradient)
    + 4 (moments) = 8 bytes per parameter, where fp32 master weights take 16.

    Parameters in another dtype are refused: the rounding would write bf16 values into them."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        if not 0.0 <= float(lr):
            raise ValueError(f"BF16AdamW: lr={lr!r} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"BF16AdamW: betas={betas!r} must each be in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(
                        f"BF16AdamW: a parameter of shape {tuple(p.shape)} is {p.dtype}; it updates bf16 "
                        "parameters only (cast them first: prepare_model with a weights:bf16 policy does)"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch overloads it
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepping = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        last = _last_of_each_size(p for p, _ in stepping)
        for i, (p, group) in enumerate(stepping):
            self._step_parameter(p, group, arithmetic=i in last)
        return loss

    def _step_parameter(self, p: torch.Tensor, group: ParamGroup, arithmetic: bool = True) -> None:
        grad = p.grad
        assert grad is not None, "step() steps only the parameters that have a gradient"
        if grad.is_sparse:
            raise RuntimeError("BF16AdamW does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        if not arithmetic:
            return
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        bias1, bias2_sqrt = 1 - beta1**step, (1 - beta2**step) ** 0.5
        weight, grad = _local(p), _local(grad)
        m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        tensors = (weight, grad, m, v)
        chunks: Iterable[tuple[torch.Tensor, ...]] = [tensors]  # a strided parameter: one chunk, its own layout
        if all(t.is_contiguous() for t in tensors):
            flat = [t.view(-1) for t in tensors]
            # The estimator's fake tensors have no values to update: the first chunk allocates what
            # every chunk does (each frees its buffers before the next), and only its views are made
            # (slicing every chunk of a 150k-token embedding cost more than the step's own ops).
            starts = range(0, min(flat[0].numel(), 1)) if _is_fake(weight) else range(0, flat[0].numel(), _CHUNK)
            chunks = (tuple(t[i : i + _CHUNK] for t in flat) for i in starts)
        for w_c, g_c, m_c, v_c in chunks:
            g32 = g_c.float()
            m32 = m_c.float().lerp_(g32, 1 - beta1)
            v32 = v_c.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            m_c.copy_(stochastic_round_to_bf16(m32))
            v_c.copy_(stochastic_round_to_bf16(v32))
            denom = v32.sqrt_().div_(bias2_sqrt).add_(group["eps"])
            w32 = w_c.float().mul_(1 - lr * group["weight_decay"]).addcdiv_(m32, denom, value=-lr / bias1)
            w_c.copy_(stochastic_round_to_bf16(w32))


def rounds_stochastically(optimizer: torch.optim.Optimizer) -> bool:
    """BF16AdamW, or torchao's 8-bit AdamW with ``bf16_stochastic_round``, alone or inside an
    optimizer stepping in the backward."""
    inner = getattr(
        optimizer, "optimizers", None
    )  # hf_memstack.transforms.optim.optimizer.OptimizerInBackward: one optimizer per parameter
    stepping = next(iter(inner.values()), None) if isinstance(inner, dict) else optimizer
    return isinstance(stepping, BF16AdamW) or bool(getattr(stepping, "bf16_stochastic_round", False))


_WARNED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers checked once
_HOOKED = False


def warn_on_plain_steps_over_pure_bf16() -> None:
    """Once per process: a global optimizer step pre-hook that warns (once per optimizer) when an
    optimizer without stochastic rounding steps parameters ``prepare_model`` keeps in pure bf16 - a
    hand-written ``torch.optim.AdamW`` loop, or Trainer without the callback - whose small updates
    would round away."""
    global _HOOKED
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_plain_step)
        _HOOKED = True


def _check_plain_step(optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    if optimizer in _WARNED:
        return
    _WARNED.add(optimizer)  # checked once, whatever the verdict
    pure = sum(1 for g in optimizer.param_groups for p in g["params"] if getattr(p, "_memstack_pure_bf16", False))
    if pure and not rounds_stochastically(optimizer):
        warnings.warn(
            f"{type(optimizer).__name__} steps {pure} parameter(s) that prepare_model keeps in pure bf16 (weights:bf16) without "
            "stochastic rounding: updates smaller than bf16's resolution round away. Build the optimizer with "
            "hf_memstack.make_optimizer(model, lr=...) (BF16AdamW), or prepare with fp32 master weights ('bf16')",
            stacklevel=3,
        )


def _last_of_each_size(params: Iterable[torch.Tensor]) -> set[int]:
    """Which parameters (by position) the step must compute: all of them on real tensors; on the
    estimator's fake tensors, only the last of each chunk size.

    Fake tensors have no values, only allocations, and a parameter's arithmetic allocates the same
    temporaries as any other of its chunk size (dtype, device), freed before the next parameter. What
    stays between parameters (the moments, made for every parameter, whether the meter made them
    before the step or the step makes them as it goes) only grows, so the step's peak for a chunk size
    is at its last parameter: skipping the earlier ones keeps the peak and what is alive at it. The
    arithmetic was most of a pure-bf16 estimate's time (4.1 of 7.6 s on a Qwen2-1.5B shape)."""
    params = list(params)
    if not params or not _is_fake(_local(params[0])):
        return set(range(len(params)))
    # (chunk size, or a strided parameter's shape and strides), contiguous, dtype, device
    last: dict[tuple[int | tuple[tuple[int, ...], tuple[int, ...]], bool, torch.dtype, torch.device], int] = {}
    for i, p in enumerate(params):
        t, grad = _local(p), p.grad
        assert grad is not None, "step() passes only the parameters that have a gradient"
        contiguous = all(x.is_contiguous() for x in (t, _local(grad)))
        size = min(t.numel(), _CHUNK) if contiguous else (tuple(t.shape), t.stride())
        last[(size, contiguous, t.dtype, t.device)] = i
    return set(last.values())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in-place updates reach the DTensor), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
