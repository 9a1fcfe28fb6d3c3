"""Fixtures the transforms' tests share."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny Llama saved in bf16, as real checkpoints are, with tied embeddings."""
    path = tmp_path_factory.mktemp("bf16") / "llama"
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path
