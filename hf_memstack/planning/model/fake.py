"""The estimator's model on fake tensors (shapes and dtypes, no storage): built once on the meta
device per config and job, given fake parameters for each trace, and the meter's step traced on
it with a fake batch."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ...measure.memory import PhasePeaks, trace_training_step
from ...record import record_of
from ...sizes import format_bytes
from ...transforms.blocks import find_blocks
from ..estimate import build_cache
from ..estimate.trainable import apply_peft
from ..estimate.weights_dtype import WeightsDtype, set_dtypes
from .config import build_model
from .vision_inputs import ImageSpec, image_batch

# The most values an integer tensor of a vision-language batch keeps (its ids, masks, grids: a batch of
# 64 x 32k tokens is 2M) - each one computed for real, on the CPU.
_MOST_KEPT = 2**24

if TYPE_CHECKING:
    from peft import PeftConfig
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import PretrainedConfig


def build_fake_model(
    config: PretrainedConfig,
    task: str,
    peft_config: PeftConfig | None,
    trust_remote_code: bool,
    mode: FakeTensorMode,
    weights: WeightsDtype,
) -> nn.Module:
    """The model built on the meta device in the weights' dtype (PEFT adapters added there, in the
    dtype PEFT gives them), then given fake tensors: shapes and dtypes, no storage. Built on meta
    first because ``Module.to()`` (which PEFT calls on its new adapters) cannot swap fake
    parameters; tied parameters stay tied. A model object's own per-parameter dtypes are kept."""

    net = meta_model(config, task, peft_config, trust_remote_code, weights)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            fakes[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if parameter else new
        return fakes[id(t)]

    for module in net.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = cast(nn.Parameter, fake(p, True))  # fake(p, True) makes a Parameter
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = fake(b, False)
    return net


def meta_model(
    config: PretrainedConfig,
    task: str,
    peft_config: PeftConfig | None,
    trust_remote_code: bool,
    weights: WeightsDtype,
    *,
    copy: bool = True,
) -> nn.Module:
    """The model built on the meta device in the weights' dtype, with its PEFT adapters (in the
    dtype PEFT gives them): once per config and job (PEFT's wrapping is most of a build), a copy
    for each caller, which may prepare and fake it in place; ``copy=False``: the cached model itself,
    for a caller that only reads it (a 7B's deep copy costs a trace's tenth)."""

    def build() -> nn.Module:
        with torch.device("meta"):
            net = build_model(config, task, trust_remote_code=trust_remote_code, dtype=weights.dtype)
            if weights.per_parameter:
                set_dtypes(net, weights.per_parameter)
            if peft_config is not None:
                net = apply_peft(net, peft_config)
                if weights.per_parameter:
                    set_dtypes(net, weights.per_parameter)
        return net

    key = (*build_key(config, task, trust_remote_code, weights), repr(peft_config))
    return build_cache.model_copy(key, build) if copy else build_cache.cached("meta_models", key, build)


def build_key(
    config: PretrainedConfig, task: str, trust_remote_code: bool, weights: WeightsDtype
) -> tuple[Hashable, ...]:
    """Everything a model built on meta depends on besides its PEFT config."""
    per = tuple(sorted((k, str(v)) for k, v in weights.per_parameter.items())) if weights.per_parameter else None
    return (*build_cache.config_key(config), task, trust_remote_code, str(weights.dtype), per)


def traced_step(
    net: nn.Module,
    batch: Mapping[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    config: PretrainedConfig,
    task: str,
    *,
    keep_outputs: bool = False,
) -> PhasePeaks:
    """The meter's step on fake tensors (in the loop that drops or, ``keep_outputs``, keeps the model's
    outputs). A forward that needs the data's values (an output whose shape depends on them, a
    ``.item()``) cannot run there: said as such, not as a trace error."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        # Each block's part of every phase is kept apart, for the depth extrapolation (measure/segments.py).
        return trace_training_step(net, batch, opt, blocks=blocks_or_empty(net), keep_outputs=keep_outputs)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise ValueError(
            f"the estimator cannot trace {type(net).__name__} ({type(config).__name__}, task={task!r}) without real data: its "
            f"forward depends on the values of the batch ({type(e).__name__}: {str(e).splitlines()[0][:120]}). Measure it "
            "instead: hf_memstack.measure_step or find_batch_size on the real model"
        ) from None


def quant_counts(net: nn.Module) -> dict[str, int]:
    """The traced 4-bit base's numbers (none without one), each a line in the number of blocks."""

    record = record_of(net)
    quant = record.quant if record is not None else None
    if quant is None or not quant.layers:
        return {}
    return {
        "quant_layers": len(quant.layers),
        "quant_weights": quant.weights,
        "quant_bytes": quant.bytes_4bit,
        "quant_bytes_before": quant.bytes_before,
    }


def blocks_or_empty(net: nn.Module) -> tuple[nn.Module, ...]:

    try:
        return find_blocks(net).modules
    except ValueError:
        return ()


def fake_batch(
    config: PretrainedConfig,
    task: str,
    batch: int,
    seq: int,
    *,
    packed: bool = False,
    images: ImageSpec | None = None,
    mode: FakeTensorMode | None = None,
) -> dict[str, torch.Tensor]:
    """One step's batch on fake tensors (built under ``mode``, the trace's FakeTensorMode); with
    ``images``, a vision-language model's (:func:`fake_image_batch`)."""
    if images is not None:
        return fake_image_batch(config, images, batch, seq, cast("FakeTensorMode", mode))  # given with images
    ids = torch.randint(0, max(2, config.get_text_config().vocab_size - 1), (batch, seq))
    if task == "classification":
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": torch.zeros(batch, dtype=torch.long),
        }
    if task == "seq2seq-lm":  # an encoder-decoder's: its decoder reads labels as long as the inputs (shifted right)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if packed:  # two samples a row, positions restarting at the second: the collator's layout
        half = seq // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand(batch, seq)
        return {"input_ids": ids, "labels": ids, "position_ids": positions}
    return {"input_ids": ids, "labels": ids}


def fake_image_batch(
    config: PretrainedConfig, images: ImageSpec, batch: int, seq: int, mode: FakeTensorMode
) -> dict[str, torch.Tensor]:
    """A vision-language model's batch: its integer inputs (ids, grids, masks) are fake tensors that
    keep their values, as the model's forward reads them (where the image tokens are, how many
    patches each image has: Qwen2-VL's rope index and vision attention split by them); its pixels
    are plain fake tensors (no values, no storage)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        ints, floats = image_batch(config, images, batch, seq, traced_inputs=True)
    convert = mode.fake_tensor_converter.from_real_tensor
    pixels = {k: torch.empty(shape, dtype=torch.float32) for k, shape in floats.items()}
    return {**{k: convert(mode, t, make_constant=True) for k, t in ints.items()}, **pixels}


@contextlib.contextmanager
def values_kept(mode: FakeTensorMode, images: ImageSpec | None) -> Iterator[None]:
    """Under ``mode``, integer and boolean results computed from such kept values keep theirs too
    (FakeTensorMode keeps only one-element results), so the forward's reads of them (``.tolist()``,
    a check of the image tokens' count) answer; floating-point results never do (the model's
    activations stay fake). Only for a vision-language model's batch (``images``)."""
    if images is None:
        yield
        return
    keeps = mode.may_turn_const

    def may_turn_const(t: torch.Tensor) -> bool:
        if keeps(t):
            return True
        plain = t.layout == torch.strided and t.device.type == "cpu" and not mode.is_our_fake(t)
        return plain and t.numel() <= _MOST_KEPT and not (t.is_floating_point() or t.is_complex())

    mode.may_turn_const = may_turn_const  # type: ignore[method-assign]  # this mode's own, until the finally
    try:
        yield
    finally:
        del mode.may_turn_const  # the class's own again


def quant_notes(counts: dict[str, int], lora: bool) -> list[str]:
    """What the traced 4-bit base holds (its bytes are in ``parameters``, counted as traced)."""
    if not counts.get("quant_layers"):
        return []
    bits = 8 * counts["quant_bytes"] / counts["quant_weights"]
    notes = [
        f"4-bit base weights: {counts['quant_layers']} linear layers, {format_bytes(counts['quant_bytes'])} for "
        f"{counts['quant_weights']:,} weights ({bits:.2f} bits each; {format_bytes(counts['quant_bytes_before'])} before quantization)"
    ]
    if not lora:
        notes.append(
            "quant:nf4 with trainable='all': the 4-bit layers are frozen and only the rest trains; pass trainable='lora' "
            "(--lora-r) for QLoRA"
        )
    return notes
