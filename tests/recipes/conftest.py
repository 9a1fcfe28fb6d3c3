"""Fixtures for the recipe tests: the real script loaded as a module (Accelerate's singleton state
reset around each test) and a tiny Llama with a word-level tokenizer saved locally (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch
from recipe_utils import load_recipe, reset_accelerate


@pytest.fixture
def recipe():
    module = load_recipe()
    reset_accelerate()
    yield module
    reset_accelerate()


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer fitted to a small text file (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny_lm")
    words = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
    lines = [" ".join(words[(i * 3 + j) % len(words)] for j in range(8)) for i in range(120)]
    data = root / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t, "prompt": t[:11], "response": t[12:]}) + "\n" for t in lines))
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    model_dir = root / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=len(vocab),
            max_position_embeddings=32,
            pad_token_id=1,
            eos_token_id=2,
            bos_token_id=2,
            # dropout: resume tests then also check that the RNG continues exactly
            attention_dropout=0.1,
        )
    ).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return {"model": model_dir, "data": data, "lines": lines}
