"""The estimator counts the dense mask that packed rows make SDPA and eager attention build - and
no mask for unpacked batches, which the real run never builds (under fake tensors Transformers
cannot read the position ids and took every batch for a packed one)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_memstack import estimate_memory, measure_step, prepare_model
from hf_memstack.data import PackedCollator

SEQ = 384


def _config(attn: str = "sdpa") -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=512,
        attn_implementation=attn,
    )


def _measured(config: LlamaConfig, batch: dict[str, torch.Tensor], policy: str) -> int:
    torch.manual_seed(0)
    model = prepare_model(LlamaForCausalLM(config).train(), policy)
    return measure_step(model, batch, torch.optim.AdamW(model.parameters())).peak_bytes


def _rows(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(3, 60, (SEQ,), generator=g).tolist(), "seq_lengths": [SEQ // 3, SEQ - SEQ // 3]}
        for _ in range(n)
    ]
    return PackedCollator()(rows)


def test_an_unpacked_batch_is_estimated_without_a_dense_mask():
    ids = torch.arange(2 * SEQ).remainder(61).reshape(2, SEQ) + 3
    measured = _measured(_config(), {"input_ids": ids, "labels": ids}, "fp32+ckpt")
    estimated = estimate_memory(_config(), "fp32+ckpt", batch_size=2, seq_len=SEQ).peak_bytes
    # Before, a [2, 1, 384, 384] mask (and SDPA's float copy of it, saved per layer) was counted: +61% here.
    assert estimated == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_are_estimated_with_the_mask_they_build(attn):
    measured = _measured(_config(attn), _rows(2), "fp32+ckpt")
    packed = estimate_memory(_config(attn), "fp32+ckpt", batch_size=2, seq_len=SEQ, packed=True).peak_bytes
    unpacked = estimate_memory(_config(attn), "fp32+ckpt", batch_size=2, seq_len=SEQ).peak_bytes
    assert packed == pytest.approx(measured, rel=0.02)
    if attn == "sdpa":  # SDPA attends causally without a mask unless the rows are packed
        assert packed - unpacked > 2 * SEQ * SEQ  # at least the boolean mask
