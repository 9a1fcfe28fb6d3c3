"""4-bit layers whose class overrides ``nn.Linear.forward`` (issue 40): torchao's NF4 weight runs
through ``F.linear`` only, and Falcon's ``FalconLinear`` computes ``input @ self.weight.T`` (``aten.permute``
on an ``NF4Tensor``: ``NotImplementedError`` at the first forward, after ``prepare_model`` accepted it).

Each such class is tried before anything changes, on a small copy of one of its layers:
- its forward runs on a 4-bit weight and gives ``F.linear``'s result: quantized as it is;
- else its forward computes ``F.linear`` on a dense weight (Falcon's does, in another spelling):
  quantized, with ``F.linear`` installed as the forward of each of its quantized layers (an
  instance wrapper: the class, the module names and the state-dict keys are unchanged; dequantizing
  keeps the same arithmetic);
- else refused, naming the class.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._wrappers import _ForwardWrapper

__all__ = ["LinearForward", "linear_forward_classes"]

_ROWS = 8  # the probe weight's rows: 8 blocks of block_size weights


class LinearForward(_ForwardWrapper):
    """``F.linear(input, weight, bias)`` as a layer's forward: the arithmetic its class's forward
    was checked to compute, in the one form a 4-bit weight runs through."""

    module: nn.Linear

    def __call__(self, input: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if args or kwargs:  # a forward with more arguments than nn.Linear's: its own code decides
            return self.__wrapped__(input, *args, **kwargs)
        return F.linear(input, self.module.weight, self.module.bias)


def linear_forward_classes(
    found: list[tuple[str, nn.Linear]], *, to_nf4: Callable[..., torch.Tensor], block_size: int
) -> set[type[nn.Module]]:
    """The classes among ``found`` whose layers need :class:`LinearForward` to run 4-bit.

    Raises:
        ValueError: a class whose forward neither runs on a 4-bit weight nor computes ``F.linear``,
            naming it and its layers, before anything changes.
    """
    needs: set[type[nn.Module]] = set()
    for cls in {type(m) for _, m in found if type(m).forward is not nn.Linear.forward}:
        sample = next(m for _, m in found if type(m) is cls)
        if _runs_4bit(sample, to_nf4, block_size):
            continue
        why = _not_linear(sample, block_size)
        if why is not None:
            layers = [n for n, m in found if type(m) is cls]
            raise ValueError(
                f"policy.quant.mode='nf4': {', '.join(layers[:3])}{' ...' if len(layers) > 3 else ''} "
                f"({cls.__module__}.{cls.__qualname__}, a subclass of nn.Linear) override nn.Linear.forward, and that "
                f"forward neither runs on a 4-bit weight (torchao's NF4 runs through F.linear only) nor computes "
                f"F.linear ({why}), so it cannot be quantized here. Leave these layers out with policy.quant.targets "
                "(naming the nn.Linear layers to quantize), or drop quant:nf4"
            )
        needs.add(cls)
    return needs


def _probe(module: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A shallow copy of ``module`` holding ``weight`` and ``bias`` (its own parameters untouched)."""
    probe = copy.copy(module)
    probe.__dict__["_parameters"] = {
        **module._parameters,
        "weight": nn.Parameter(weight, requires_grad=False),
        "bias": None if bias is None else nn.Parameter(bias, requires_grad=False),
    }
    return probe


def _inputs(module: nn.Linear, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(_ROWS, block_size, generator=g)
    bias = torch.randn(_ROWS, generator=g) if module.bias is not None else None
    return torch.randn(2, 3, block_size, generator=g), weight, bias


def _runs_4bit(module: nn.Linear, to_nf4: Callable[..., torch.Tensor], block_size: int) -> bool:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():  # real values, also while the estimator traces
        x, weight, bias = _inputs(module, block_size)
        four_bit = to_nf4(weight, block_size, _ROWS)
        try:
            got = type(module).forward(_probe(module, four_bit, bias), x)
        except Exception:  # noqa: BLE001 - any failure means: not as it is
            return False
        return torch.is_tensor(got) and bool(torch.allclose(got, F.linear(x, four_bit, bias), atol=1e-5))


def _not_linear(module: nn.Linear, block_size: int) -> str | None:
    """None when the class's forward gives ``F.linear``'s result on a dense weight, else what it did."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        x, weight, bias = _inputs(module, block_size)
        try:
            got = type(module).forward(_probe(module, weight, bias), x)
        except Exception as e:  # noqa: BLE001 - named in the refusal
            return f"on a dense weight it raised {type(e).__name__}: {e}"
        if not torch.is_tensor(got) or got.shape != (*x.shape[:-1], _ROWS):
            return f"on a dense weight it returned {type(got).__name__} {tuple(getattr(got, 'shape', ()))}"
        if not torch.allclose(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-5):
            return "on a dense weight its result differs from F.linear's"
    return None
