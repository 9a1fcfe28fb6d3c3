"""estimate_memory: how much memory a training step will take, where it goes, and which phase
holds the peak - from a config alone, without downloading or materialising any weights.

The model is built from its config under PyTorch's ``FakeTensorMode`` (tensors with shapes and
dtypes but no storage), the memory policy is applied with :func:`prepare_model`, and the memory
meter traces one real Transformers forward, backward and optimizer step on fake data. So the
estimate counts exactly what the meter measures - frozen parameters, tied embeddings, the logits
of large vocabularies - for any architecture Transformers can build. Two things are not traced
and are accounted for separately: torch.compile (estimated as its eager policy: compile usually
lowers the peak a little) and FSDP over ``world_size`` ranks (the traced model states are divided
by the ranks, plus one block's gathered parameters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .memory import StepMemory, format_bytes, measure_step
from .policy import MemoryPolicy

__all__ = ["MemoryEstimate", "estimate_memory", "load_config"]


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """The estimated peak of one training step (bytes, per rank), by category."""

    model: str
    policy: str
    batch_size: int
    seq_len: int
    world_size: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    """Activations alive at the end of the forward (what the backward needs)."""
    temporaries: int
    """The rest of the peak: transient buffers, logits and their gradients at the peak."""
    peak_bytes: int
    peak_phase: str
    trainable_parameters: int
    total_parameters: int
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        cats = ", ".join(f"{k} {format_bytes(getattr(self, k))}" for k in ("parameters", "gradients", "optimizer", "activations", "temporaries"))
        return (f"{self.model} [{self.policy}] batch {self.batch_size} x seq {self.seq_len}, {self.world_size} rank(s): "
                f"peak {format_bytes(self.peak_bytes)} in the {self.peak_phase} phase ({cats})")


def load_config(model: str | Path | Any, *, trust_remote_code: bool = False) -> Any:
    """A Transformers config from a config object, a local directory, or a hub id already in the
    local cache. Nothing is downloaded, so an unknown id fails at once instead of hanging offline.

    Raises:
        ValueError: not a directory with a config.json and not in the local Hugging Face cache.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if isinstance(model, nn.Module):
        return model.config
    try:
        return AutoConfig.from_pretrained(str(model), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"model={str(model)!r} is not a local directory with a config.json and not in the local Hugging Face cache "
            f"({type(e).__name__}); download it first (`hf download {model} config.json`) or pass a local directory"
        ) from None


def estimate_memory(
    model: str | Path | Any,
    policy: MemoryPolicy | str | dict[str, Any] | None = None,
    *,
    batch_size: int,
    seq_len: int,
    world_size: int = 1,
    optimizer: str = "adamw",
    trainable: str | Any = "all",
    task: str = "causal-lm",
    trust_remote_code: bool = False,
) -> MemoryEstimate:
    """Estimate one training step's peak memory per rank, by category.

    Args:
        model: a hub id (from the local cache), a local directory, a config, or a model (its config is used).
        policy: the memory policy (string, dict, :class:`MemoryPolicy`).
        batch_size: per-device micro-batch size.
        seq_len: tokens per sample.
        world_size: ranks sharing the model under an FSDP policy.
        optimizer: ``adamw`` (two fp32 moments per trainable parameter) or ``sgd`` (none).
        trainable: ``all``, or a PEFT config (its adapters are added and only they train).
        task: ``causal-lm`` or ``classification`` (which head the config gets).

    Raises:
        ValueError: bad sizes, an unknown model, or a policy the model cannot use.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .prepare import prepare_model

    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r} is not one of 'adamw', 'sgd'")
    config = load_config(model, trust_remote_code=trust_remote_code)
    policy = MemoryPolicy.coerce(policy)
    if policy.fsdp.mode == "none" and world_size > 1:
        notes = [f"world_size={world_size} without FSDP: every rank holds the whole model (data parallel)"]
    else:
        notes = []
    traced = MemoryPolicy.from_dict({**policy.to_dict(), "compile": {"mode": "none"}, "fsdp": {"mode": "none"}})
    if policy.compile.mode != "none":
        notes.append("compile is estimated as eager: its fused kernels usually lower the peak a little")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"seq_len={seq_len} is above the model's limit of {limit} positions")

    with FakeTensorMode(allow_non_fake_inputs=True):
        net = _build(config, task, trust_remote_code)
        if trainable != "all":
            net = _apply_peft(net, trainable)
        net.train()
        prepare_model(net, traced)
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False, fused=False) if optimizer == "adamw" else torch.optim.SGD(params, lr=1e-4)
        batch = _batch(config, task, batch_size, seq_len)
        m = measure_step(net, batch, opt, warmup=True, timed=False)
    total_params = sum(p.numel() for p in net.parameters())
    trainable_params = sum(p.numel() for p in params)
    return _per_rank(m, net, policy, world_size, config, batch_size, seq_len, trainable_params, total_params, notes, model)


def _per_rank(m: StepMemory, net: nn.Module, policy: MemoryPolicy, world: int, config: Any, batch: int, seq: int,
              trainable: int, total: int, notes: list[str], model: Any) -> MemoryEstimate:
    params, grads, opt = m.parameters, m.gradients, m.optimizer
    # What the peak holds beyond the model states: activations and temporaries (logits, their gradients, buffers).
    rest = max(0, m.peak_bytes - params - grads - opt)
    if policy.fsdp.mode != "none" and world > 1:
        # Sharded states; plus the parameters of the block being computed, gathered in full.
        block = max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in _blocks_or_empty(net)), default=0)
        params, grads, opt = params // world + 2 * block, grads // world, opt // world
        if policy.fsdp.cpu_offload:
            notes.append("fsdp cpu_offload: sharded parameters, gradients and optimizer state live in host memory")
            params, grads, opt = 2 * block, 0, 0
    name = getattr(config, "_name_or_path", "") or type(net).__name__
    return MemoryEstimate(
        model=str(model) if isinstance(model, (str, Path)) else name, policy=policy.to_string(), batch_size=batch, seq_len=seq,
        world_size=world, parameters=params, gradients=grads, optimizer=opt, activations=min(m.saved_activations, rest),
        temporaries=rest - min(m.saved_activations, rest), peak_bytes=params + grads + opt + rest, peak_phase=m.peak_phase,
        trainable_parameters=trainable, total_parameters=total, notes=tuple(notes),
    )


def _blocks_or_empty(net: nn.Module) -> tuple[nn.Module, ...]:
    from .blocks import find_blocks

    try:
        return find_blocks(net).modules
    except ValueError:
        return ()


def _build(config: Any, task: str, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task not in ("causal-lm", "classification"):
        raise ValueError(f"task={task!r} is not one of 'causal-lm', 'classification'")
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    try:
        return auto.from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"{type(config).__name__} has no {task} model in Transformers ({e}); pass task='classification' "
                         "or 'causal-lm' to match the model") from None


def _apply_peft(net: nn.Module, peft_config: Any) -> nn.Module:
    from peft import get_peft_model  # optional: only when a PEFT config is given

    return get_peft_model(net, peft_config)


def _batch(config: Any, task: str, batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, max(2, config.vocab_size - 1), (batch, seq))
    if task == "classification":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.zeros(batch, dtype=torch.long)}
    return {"input_ids": ids, "labels": ids}
