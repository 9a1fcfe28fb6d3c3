"""Shared by the benchmark scripts: the reference model, its batch, the machine's description."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def reference_model(layers: int, hidden: int, vocab: int = 32000, seed: int = 0) -> torch.nn.Module:
    """A Llama-shaped causal LM built from a config (random weights, fp32), in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=vocab,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).train()


def reference_batch(
    batch: int, seq: int, vocab: int = 32000, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}"
