"""transforms.bf16_adamw: on the estimator's fake tensors the step computes only the last parameter of
each chunk size. The reference is the same estimate with every parameter's arithmetic traced (the
step as it runs on real tensors), field by field; on real tensors every parameter is updated."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_memstack import estimate_memory
from hf_memstack.planning.estimate import build_cache
from hf_memstack.transforms.optim import bf16_adamw
from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW

CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    tie_word_embeddings=True,  # one largest parameter, first in the order: a step that skips it is caught
    dtype="bfloat16",
)


def _estimate(policy: str) -> dict:
    build_cache.clear()
    return estimate_memory(CONFIG, policy, batch_size=2, seq_len=32, extrapolate=False).as_dict()


@pytest.mark.parametrize("chunk", [1 << 20, 1024], ids=["sizes-by-numel", "most-share-one-chunk"])
@pytest.mark.parametrize("policy", ["bf16+weights:bf16", "bf16+ckpt+loss:chunked+weights:bf16"])
def test_the_fake_step_gives_every_field_of_the_step_that_computes_every_parameter(policy, chunk, monkeypatch):
    monkeypatch.setattr(bf16_adamw, "_CHUNK", chunk)
    rounds = []
    real_round = bf16_adamw.stochastic_round_to_bf16
    monkeypatch.setattr(bf16_adamw, "stochastic_round_to_bf16", lambda x, g=None: rounds.append(1) or real_round(x, g))
    skipping = _estimate(policy)
    computed_skipping = len(rounds)
    monkeypatch.setattr(bf16_adamw, "_last_of_each_size", lambda params: set(range(len(list(params)))))
    rounds.clear()
    every = _estimate(policy)
    assert skipping == every  # every field: the peak, its phase, the five categories, the notes
    if chunk == 1 << 20:  # whole small tensors: the step's temporaries make the peak, which is what is compared
        assert every["peak_phase"] == "optimizer"
    assert 0 < computed_skipping < len(rounds)  # it did skip, and the reference computed more


def test_on_real_tensors_every_parameter_is_updated():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (64, 64, 64, 32)]
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    BF16AdamW(params, lr=1e-2, weight_decay=0.0).step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
