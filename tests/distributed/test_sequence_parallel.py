"""Ulysses sequence parallelism (``sp:2``) on 2 CPU processes (gloo): each rank runs its half of every
row (``shard_batch``), and the sum of the ranks' losses and of their gradients equals one process's
loss and gradients on the whole rows - MHA, MQA (key/value heads repeated), packed rows with a sample
across the shard boundary, Mistral's sliding window shorter than the row, Qwen2's full and windowed
layers on packed rows, and a row whose length 2 does not divide - under ``ckpt`` and ``loss:chunked``.

The gradients are summed over the group here, in the test (the library's reduction is its own step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
}
ROWS = 2

# case -> (architecture, config overrides, the rows' samples' lengths (None: one sample per row), policy)
CASES: dict[str, tuple[str, dict[str, Any], list[list[int]] | None, str]] = {
    "llama_mha": ("llama", {"num_key_value_heads": 4}, None, "fp32+sp:2"),
    "llama_mqa": ("llama", {"num_key_value_heads": 1}, None, "fp32+ckpt+loss:chunked+sp:2"),
    "llama_gqa_packed": ("llama", {"num_key_value_heads": 2}, [[5, 13, 14], [20, 12]], "fp32+ckpt+loss:chunked+sp:2"),
    "mistral_window": (
        "mistral",
        {"num_key_value_heads": 2, "sliding_window": 8, "head_dim": 16},
        None,
        "fp32+ckpt+sp:2",
    ),
    "qwen2_window_packed": (
        "qwen2",
        {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        [[5, 13, 14], [3, 29]],
        "fp32+loss:chunked+sp:2",
    ),
    "llama_odd_length": ("llama", {"num_key_value_heads": 2}, [[29], [10, 19]], "fp32+ckpt+sp:2"),
}


def _model(case: str) -> torch.nn.Module:
    import transformers

    arch, overrides, _, _ = CASES[case]
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    config = config_class(**SHAPE, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(config).train()


def _batch(case: str) -> dict[str, torch.Tensor]:
    """The whole rows: labels -100 on the first tokens and at each sample's first token (as Transformers'
    DataCollatorWithFlattening marks them), so that the model's own shift predicts within samples."""
    samples = CASES[case][2] or [[32]] * ROWS
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in samples])
    ids = torch.randint(3, SHAPE["vocab_size"], positions.shape, generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[positions == 0] = -100
    labels[:, 1:3] = -100
    batch = {"input_ids": ids, "labels": labels}
    return {**batch, "position_ids": positions} if CASES[case][2] else batch


def _sharded(rank: int, world: int) -> dict[str, tuple[float, dict[str, torch.Tensor], str]]:
    import torch.distributed as dist

    from hf_memstack import describe, prepare_model
    from hf_memstack.transforms.sequence_parallel import shard_batch

    out = {}
    for case in CASES:
        model = prepare_model(_model(case), CASES[case][3])
        mine = shard_batch(_batch(case), sp_rank=rank, sp_size=world)
        loss = model(**mine, use_cache=False).loss
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad)
            grads[name] = p.grad
        out[case] = (float(total), grads, describe(model))
    return out


@pytest.fixture(scope="module")
def sharded() -> list[dict[str, tuple[float, dict[str, torch.Tensor], str]]]:
    return run_ranks(_sharded, timeout=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sharded_step_equals_the_unsharded_one(case: str, sharded: list[dict[str, Any]]) -> None:
    reference = _model(case)
    batch = _batch(case)
    loss = reference(**batch, use_cache=False).loss
    loss.backward()
    for rank_results in sharded:
        got_loss, grads, _ = rank_results[case]
        assert got_loss == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-6)
        for name, p in reference.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), (case, name)


def test_describe_says_ulysses_and_the_heads(sharded: list[dict[str, Any]]) -> None:
    text = sharded[1]["llama_mqa"][2]
    assert "sequence parallel: Ulysses over 2 ranks" in text and "slice 1 of 2" in text
    assert "heads 4 -> 2 per rank" in text and "key/value heads 1 (each repeated 2x)" in text
