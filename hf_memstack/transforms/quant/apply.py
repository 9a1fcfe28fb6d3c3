"""4-bit base weights (QLoRA): quantize the frozen linear layers of a model's blocks to NF4
(``check_quant`` decides, ``apply_quant`` swaps the weights), accept models loaded 4-bit with
bitsandbytes, and report which tensors are 4-, 16- and 32-bit and whether the adapters on the
4-bit layers got gradients (``verify_quant``).

The backend was chosen by measurement (``bench/qlora.py``, docs/quant.md): both torchao's ``NF4Tensor``
and bitsandbytes' ``Linear4bit`` train LoRA on a CPU with our pins, to the same loss, at the same
bytes (4.13 bits per weight) and within noise of each other's step time. torchao quantizes what
``prepare_model`` quantizes because it is plain PyTorch: the weight is swapped on the model's own
``nn.Linear`` (module classes and state-dict keys unchanged, so PEFT wraps it as any linear layer),
it runs on any device and under ``FakeTensorMode`` (the estimator traces it and counts its bytes to
the byte), and it defines FSDP2's all-gather (``fsdp_pre_all_gather``), where bitsandbytes'
quantization state is a Python object FSDP2 cannot shard. Models users load with
``BitsAndBytesConfig(load_in_4bit=True)`` are accepted as they are.

The NF4 layout (QLoRA; torchao's implementation): two 4-bit codes per byte; one int8 scale per
``block_size`` weights; the scales themselves quantized around their mean with one scale factor
per 256 of them (double quantization); a 16-entry code table. About 0.5 + 1/64 bytes per weight.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from ..._quiet import quiet_imports
from ...measure.accounting import tensor_bytes
from ...policy import QuantConfig
from ..blocks import Blocks
from .forward import LinearForward, linear_forward_classes
from .targets import BNB_LOAD, find_targets, refuse_trainable_targets, scaler_block_size

if TYPE_CHECKING:
    from types import ModuleType

    from bitsandbytes.nn import Params4bit

__all__ = ["QuantPlan", "QuantResult", "apply_quant", "check_quant", "four_bit_weight", "is_4bit", "quantizable"]

_INSTALL = "pip install 'hf_memstack[quant]' (torchao)"
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
Backend = Literal["none", "torchao", "bitsandbytes"]


def is_4bit(t: object) -> bool:
    """Whether ``t`` is a 4-bit weight: torchao's ``NF4Tensor`` or bitsandbytes' ``Params4bit``
    (looked up among the modules already imported: neither library is imported for this)."""
    return _backend_of(t) != "none"


def _backend_of(t: object) -> Backend:
    t = getattr(t, "_local_tensor", t)  # under FSDP2 a DTensor holds this rank's shard: an NF4 weight too
    nf4 = getattr(sys.modules.get(_NF4_MODULE), "NF4Tensor", None)
    bnb = getattr(sys.modules.get("bitsandbytes.nn.modules"), "Params4bit", None)
    if nf4 is not None and isinstance(t, nf4):
        return "torchao"
    if bnb is not None and isinstance(t, bnb):
        return "bitsandbytes"
    return "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Target:
    name: str
    module: nn.Linear
    scaler_block_size: int
    """Scales per second-level scale factor: 256 (QLoRA's), or the largest divisor of the layer's
    (per-shard) number of blocks below it, for layers too small for 256."""
    linear_forward: bool = False
    """Its class's forward computes F.linear in a form a 4-bit weight cannot run (Falcon's
    ``input @ weight.T``): ``F.linear`` is installed as its forward (:mod:`.quant_forward`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantPlan:
    """What ``check_quant`` decided; ``apply_quant`` cannot fail on it."""

    cfg: QuantConfig
    dtype: torch.dtype
    """The dtype the 4-bit weights dequantize to (the compute dtype)."""
    targets: tuple[_Target, ...] = ()
    """Layers to quantize now."""
    loaded: tuple[tuple[str, nn.Module], ...] = ()
    """Layers that came 4-bit (bitsandbytes, or an NF4 weight already there)."""
    loaded_backend: Backend = "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantResult:
    """Which layers hold 4-bit weights, and their bytes."""

    mode: str = "none"
    """The policy's ``quant.mode``."""
    backend: Backend = "none"
    """Who holds the 4-bit weights: ``torchao`` (quantized by ``prepare_model`` or given so), ``bitsandbytes``
    (loaded so), ``none``."""
    layers: tuple[nn.Module, ...] = ()
    """The modules whose weight is 4-bit (PEFT wraps them as ``base_layer``; they stay these objects)."""
    names: tuple[str, ...] = ()
    """Their names at ``prepare_model`` time."""
    quantized: int = 0
    """How many of them ``prepare_model`` quantized (the others came 4-bit)."""
    weights: int = 0
    """Weights (parameters) held in 4 bits."""
    bytes_4bit: int = 0
    """Bytes of those weights now: codes, scales, second-level scales and code tables."""
    bytes_before: int = 0
    """Bytes of the weights ``prepare_model`` quantized, before it did."""
    upcast: int = 0
    """Parameters cast to fp32 by ``quant.upcast``."""

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes_4bit / self.weights if self.weights else 0.0

    def describe(self) -> str:
        if not self.layers:
            return "off"
        text = (
            f"{len(self.layers)} linear layer(s) in 4 bits ({self.backend}; {self.weights:,} weights, "
            f"{self.bits_per_weight:.2f} bits each)"
        )
        if self.quantized:
            text += f", {self.quantized} quantized here from {self.bytes_before / 2**20:.2f} MiB to {self.bytes_4bit / 2**20:.2f} MiB"
        if self.upcast:
            text += f"; {self.upcast} other parameter(s) upcast to fp32"
        return text + "; they are frozen: train adapters on them (LoRA)"


def check_quant(
    model: nn.Module,
    cfg: QuantConfig,
    *,
    dtype: torch.dtype,
    blocks: Blocks | None,
    shards: int = 1,
    fsdp: bool = False,
) -> QuantPlan:
    """Decide what to quantize, refusing (before anything changes) what cannot work.

    Args:
        model: the model as given to ``prepare_model`` (a PEFT model or not).
        cfg: the policy's ``quant``.
        dtype: the compute dtype (what the 4-bit weights dequantize to).
        blocks: the model's repeated blocks (the default targets), or None.
        shards: ranks FSDP2 shards each weight over (its rows split into that many).
        fsdp: the policy shards with FSDP2.

    Raises:
        ValueError: 8-bit or other integer weights; trainable 4-bit weights; trainable weights to
            quantize in a model where something is frozen already; a target that is not an
            ``nn.Linear`` (GPT-2's ``Conv1D``, an embedding), is tied to another module, or matches
            nothing; a layer whose size the blocks do not divide; bitsandbytes weights under FSDP.
        RuntimeError: ``mode="nf4"`` without torchao.
    """
    loaded = _loaded_4bit(model)
    _refuse_other_integer_weights(model)
    _refuse_trainable_4bit(loaded)
    backends = {_backend_of(m.weight) for _, m in loaded}
    if fsdp and "bitsandbytes" in backends:
        raise ValueError(
            f"{type(model).__name__} holds bitsandbytes 4-bit weights and the policy shards with FSDP2, which cannot "
            "shard them (their quantization state is not a tensor); load the model in 16 bits and add quant:nf4 to the "
            "policy (torchao's NF4 weights define FSDP2's all-gather)"
        )
    loaded_backend: Backend = "bitsandbytes" if "bitsandbytes" in backends else ("torchao" if backends else "none")
    plan = QuantPlan(cfg=cfg, dtype=dtype, loaded=tuple(loaded), loaded_backend=loaded_backend)
    if cfg.mode == "none" or loaded:  # a model loaded 4-bit is the 4-bit base: nothing more is quantized
        return plan
    nf4 = _nf4_module()  # torchao is there (RuntimeError otherwise)
    found = find_targets(model, cfg, blocks)
    refuse_trainable_targets(model, found)
    rerouted = linear_forward_classes(found, to_nf4=nf4.to_nf4, block_size=cfg.block_size)
    targets = tuple(
        _Target(
            name=n,
            module=m,
            scaler_block_size=scaler_block_size(n, m, cfg.block_size, shards),
            linear_forward=type(m) in rerouted,
        )
        for n, m in found
    )
    return QuantPlan(cfg=cfg, dtype=dtype, targets=targets, loaded_backend=loaded_backend)


def apply_quant(model: nn.Module, plan: QuantPlan) -> QuantResult:
    """Swap each target's weight for its NF4 form (frozen), one layer at a time so that only one
    layer's temporaries exist at once; cast the other 16-bit parameters to fp32 when asked."""
    before = 0
    for target in plan.targets:
        weight = target.module.weight
        before += tensor_bytes(weight)
        with torch.no_grad():
            nf4 = _to_nf4(weight.detach().to(plan.dtype).contiguous(), plan.cfg.block_size, target.scaler_block_size)
        target.module.weight = nn.Parameter(nf4, requires_grad=False)
        if target.linear_forward:
            target.module.forward = LinearForward(target.module)  # type: ignore[method-assign]
        del weight, nf4
    # A model loaded 4-bit holds its 4-bit weights in linear layers (bitsandbytes' Linear4bit is an nn.Linear).
    layers = [t.module for t in plan.targets] or [cast(nn.Linear, m) for _, m in plan.loaded]
    if plan.loaded_backend == "bitsandbytes":
        _keep_bnb_layout(layers)
    names = [t.name for t in plan.targets] or [n for n, _ in plan.loaded]
    upcast = _upcast(model) if plan.cfg.upcast else 0
    return QuantResult(
        mode=plan.cfg.mode,
        backend="torchao" if plan.targets else plan.loaded_backend,
        layers=tuple(layers),
        names=tuple(names),
        quantized=len(plan.targets),
        weights=sum(m.in_features * m.out_features for m in layers),
        bytes_4bit=sum(tensor_bytes(m.weight) for m in layers),
        bytes_before=before,
        upcast=upcast,
    )


def _to_nf4(weight: torch.Tensor, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """torchao's NF4 form of ``weight``. On the estimator's fake tensors (shapes and dtypes, no
    values) the same tensors are built empty instead of computed: quantizing a 7B model's fake
    weights took over a minute of CPU for bytes known from the shapes (the estimator tests hold
    both to the meter's real NF4 weights, byte for byte)."""
    from torch._subclasses.fake_tensor import FakeTensor

    nf4 = _nf4_module()
    if isinstance(weight, FakeTensor) and hasattr(nf4, "SubclassTensorArgs"):
        n_blocks = weight.numel() // block_size

        def empty(size: int | tuple[()], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=weight.device)

        meta = nf4.SubclassTensorArgs(
            weight.size(), weight.stride(), weight.storage_offset(), weight.dtype, weight.device, False
        )
        return nf4.NF4Tensor(
            meta,
            block_size,
            n_blocks,
            scaler_block_size,
            empty(n_blocks, torch.int8),
            empty(n_blocks // scaler_block_size, weight.dtype),
            empty((), weight.dtype),
            empty(weight.numel() // 2, torch.uint8),
            empty(16, weight.dtype),
        )
    out = nf4.to_nf4(weight, block_size, scaler_block_size)
    # With a single second-level factor, torchao keeps it as a view of a temporary
    # scaler_block_size long (up to 512 bytes a layer): hold only the factor.
    out.quantization_factor = out.quantization_factor.clone()
    return out


def quantizable(blocks: Blocks | None) -> bool:
    """Whether 4-bit base weights would shrink this model and ``prepare_model`` would take them: its
    blocks hold frozen ``nn.Linear`` weights that are not 4-bit yet (a LoRA base) and no projection
    of another kind (GPT-2's Conv1D, a mixture-of-experts router: refused by :func:`check_quant`),
    and torchao is installed."""
    import importlib.util

    if blocks is None or importlib.util.find_spec("torchao") is None:
        return False
    try:
        found = find_targets(blocks.root, QuantConfig(mode="nf4"), blocks)
    except ValueError:
        return False
    return any(not m.weight.requires_grad and not is_4bit(m.weight) for _, m in found)


# ---------------------------------------------------------------------------------------- the checks


@quiet_imports()  # torchao's import-time noise only (hf_memstack/_quiet.py)
def _nf4_module() -> ModuleType:
    try:
        import importlib

        return importlib.import_module(_NF4_MODULE)
    except ImportError:
        try:  # torchao before 0.16 kept NF4 here
            from torchao.dtypes import nf4tensor

            return nf4tensor
        except ImportError:
            raise RuntimeError(
                f"policy.quant.mode='nf4' needs torchao's NF4 weights: {_INSTALL}; or load the model 4-bit with "
                f"bitsandbytes ({BNB_LOAD}) and drop quant:nf4"
            ) from None


def _keep_bnb_layout(layers: list[nn.Linear]) -> None:
    """Keep bitsandbytes' 4-bit codes in the layout its autograd path reads.

    On a CPU with AVX512-BF16, ``Linear4bit``'s first eval-mode no-grad forward (an evaluation, a
    generation) repacks the codes for a CPU inference kernel and keeps them so; every later forward,
    training ones included, runs that kernel, which has no backward: the loss still computes but no
    gradient reaches the adapters (measured with bitsandbytes 0.50.2). Undo a repack already done,
    as bitsandbytes' own ``_save_to_state_dict`` does, and switch it off.
    """
    for layer in layers:
        unpack_bnb_weight(cast("Params4bit", layer.weight))  # a bitsandbytes Linear4bit's
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            setattr(layer, "support_avx512bf16_for_cpu", False)  # noqa: B010 (a plain attribute nn.Module cannot type)


def unpack_bnb_weight(weight: Params4bit) -> None:
    """Put a bitsandbytes ``Params4bit`` repacked for its CPU inference kernel back into its standard
    layout, in place, with bitsandbytes' own inverse (as its ``_save_to_state_dict`` does); nothing
    for a weight in that layout already."""
    if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
        import bitsandbytes.functional as bnbf  # present: the weight is one of its Params4bit

        weight.data, weight.quant_state = bnbf._convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)


def four_bit_weight(module: nn.Module) -> nn.Parameter | None:
    """The module's own 4-bit weight parameter, or None (a PEFT wrapper's ``weight`` property,
    which returns its base layer's, does not count: the base layer is the 4-bit layer)."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return weight if weight is not None and is_4bit(weight) else None


def _loaded_4bit(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if four_bit_weight(m) is not None]


def _refuse_other_integer_weights(model: nn.Module) -> None:
    """torch.ao's quantized modules, 8-bit bitsandbytes weights and other integer parameters cannot
    take adapters the way 4-bit bases do (and torch.ao's hold no parameters to train at all)."""
    fix = (
        f"load the model in 16 bits (from_pretrained(..., dtype=torch.bfloat16)) and add quant:nf4 to the policy (QLoRA-style), "
        f"or load it 4-bit with bitsandbytes ({BNB_LOAD}), or load it in fp32 (dtype=torch.float32) for full training"
    )
    other = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if ".quantized." in type(m).__module__ or type(m).__name__ in ("Linear8bitLt", "Int8Params")
        }
    )
    if other or getattr(model, "is_loaded_in_8bit", False):
        raise ValueError(
            f"{type(model).__name__} has quantized modules ({', '.join(other) or '8-bit bitsandbytes'}) that are not "
            f"4-bit: hf_memstack trains 4-bit (NF4) bases only; {fix}"
        )
    integer = sorted(
        {
            str(p.dtype)
            for p in model.parameters()
            if not p.dtype.is_floating_point and not p.dtype.is_complex and not is_4bit(p)
        }
    )
    if integer:
        raise ValueError(
            f"{type(model).__name__} has quantized (integer) weights ({', '.join(integer)}) that are not 4-bit "
            f"bitsandbytes or torchao weights; {fix}"
        )


def _refuse_trainable_4bit(loaded: list[tuple[str, nn.Module]]) -> None:
    trainable = [n for n, m in loaded if m.weight.requires_grad]
    if trainable:
        raise ValueError(
            f"4-bit weights require grad ({', '.join(trainable[:3])}{' ...' if len(trainable) > 3 else ''}): 4-bit "
            "weights cannot train. Freeze them (module.weight.requires_grad_(False)) and train adapters on them "
            "(peft.get_peft_model with a LoraConfig freezes the base)"
        )


def _upcast(model: nn.Module) -> int:
    """PEFT's ``prepare_model_for_kbit_training`` cast, without its freezing: 16-bit parameters to fp32."""
    cast = [p for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16) and not is_4bit(p)]
    for p in cast:
        p.data = p.data.to(torch.float32)
    return len(cast)
