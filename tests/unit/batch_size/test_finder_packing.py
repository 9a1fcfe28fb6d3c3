"""The finder on packed rows: it sizes rows of a fixed token budget, measuring the mask they build,
and says so."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_memstack import find_batch_size, prepare_model
from hf_memstack.data import PackedCollator, pack_dataset


def test_packed_rows_are_sized_as_rows_of_tokens(tmp_path):
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = prepare_model(LlamaForCausalLM(config).train(), "fp32")
    g = torch.Generator().manual_seed(0)
    samples = [
        {"input_ids": torch.randint(3, 60, (int(n),), generator=g).tolist()}
        for n in torch.randint(8, 60, (64,), generator=g)
    ]
    rows = pack_dataset(samples, 128)
    collate = PackedCollator(pad_to=128)

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        return collate([rows[i % len(rows)] for i in range(n)])

    result = find_batch_size(
        model, make_batch, torch.optim.AdamW(model.parameters()), budget="24MiB", cache_dir=tmp_path
    )
    assert result.packed and result.seq_len == 128
    assert result.tokens_per_batch == result.batch_size * 128
    assert f"{result.batch_size} packed rows of 128 tokens" in result.summary()
    assert result.peak_bytes <= result.budget
