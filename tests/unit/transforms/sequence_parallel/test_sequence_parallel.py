"""``sp:N`` in ``prepare_model`` in one process: every refusal happens before the model changes (and
names the fix), the switch and the record under PyTorch's fake process group (world 2 or 3, no
peers: nothing is exchanged for real), the refusals at run time (a padding mask, a KV cache), and the
exchanges' fake shapes, which let a shapes-only group trace a step on fake tensors (the estimator)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from tiny import assert_untouched, configs, make_batch, snapshot, tiny_llama

from hf_memstack import describe, prepare_model
from hf_memstack.transforms.sequence_parallel import (
    ULYSSES_ATTENTION,
    head_to_seq,
    kv_replication,
    register_group,
    seq_to_head,
    set_active_group,
    shard_batch,
    ulysses_mask,
)


@pytest.fixture
def fake_world(request: pytest.FixtureRequest) -> Iterator[int]:
    """A fake process group of ``request.param`` ranks (2 unless parametrized), this process rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = getattr(request, "param", 2)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield world
    finally:
        dist.destroy_process_group()


def _refused(model: torch.nn.Module, policy: str, error: type[Exception], match: str) -> None:
    before = snapshot(model)
    implementation = model.config._attn_implementation if hasattr(model, "config") else None
    with pytest.raises(error, match=match):
        prepare_model(model, policy)
    assert_untouched(model, before)
    if implementation is not None:
        assert model.config._attn_implementation == implementation


def test_without_a_process_group_sp_is_refused_naming_torchrun():
    _refused(tiny_llama(), "fp32+sp:2", RuntimeError, r"sp:2.*no torch.distributed process group.*torchrun")


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_size_that_does_not_divide_the_world_is_refused(fake_world):
    _refused(tiny_llama(), "fp32+sp:4", ValueError, r"size=4 \(sp:4\) does not divide the world size 2")


@pytest.mark.parametrize("fake_world", [3], indirect=True)
def test_heads_not_divisible_by_the_size_are_refused(fake_world):
    _refused(tiny_llama(), "fp32+sp:3", ValueError, r"4 attention heads are not divisible by 3.*divides 4")


def _bloom() -> torch.nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=128))


def _gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**_SMALL, head_dim=16))


def _qwen3_next() -> torch.nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **_SMALL,
        layer_types=["linear_attention", "full_attention"],
        head_dim=16,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return Qwen3NextForCausalLM(config)


def _t5() -> torch.nn.Module:
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration(configs()["t5"])


def _eager_only() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    class EagerOnlyLlama(LlamaForCausalLM):  # a model that declares no SDPA support
        _supports_sdpa = False

    config = tiny_llama().config
    config._attn_implementation = "eager"
    return EagerOnlyLlama(config)


def _bert_mlm() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128))


def _gemma3_bidirectional() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_SMALL, head_dim=16, use_bidirectional_attention=True))


def _mixtral_router_loss() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**_SMALL, num_local_experts=4, output_router_logits=True))


def _llama_dynamic_rope() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    return LlamaForCausalLM(LlamaConfig(**_SMALL, max_position_embeddings=16, rope_parameters=rope))


def _phi3_longrope() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}
    config = Phi3Config(
        **_SMALL, pad_token_id=0, max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=rope
    )
    return Phi3ForCausalLM(config)


_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (_t5, r"is an encoder-decoder.*drop sp:2"),
        (_bloom, r"\(bloom\) adds a position bias \(ALiBi"),
        (_gemma2, r"soft-caps its attention logits"),
        (_qwen3_next, r"layers of kind linear_attention \(layer_types\)"),
        (_eager_only, r"cannot be switched to 'hf_memstack_ulysses'.*attn_implementation='sdpa'"),
        (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), r"has no Transformers config: drop sp:2"),
        (_bert_mlm, r"BertForMaskedLM's attention is not causal \(BertSelfAttention has is_causal=False\).*causal LMs"),
        (_gemma3_bidirectional, r"not causal \(Gemma3Attention has is_causal=False\).*drop sp:2"),
        (_mixtral_router_loss, r"MixtralConfig.output_router_logits is True.*output_router_logits=False"),
        (_llama_dynamic_rope, r"LlamaConfig.rope_parameters has rope_type 'dynamic'.*static rope type"),
        (_phi3_longrope, r"Phi3Config.rope_parameters has rope_type 'longrope'.*'linear', 'yarn', 'llama3'"),
    ],
    ids=[
        "t5",
        "bloom",
        "gemma2",
        "qwen3_next",
        "eager_only",
        "plain_module",
        "bert_mlm",
        "gemma3_bidirectional",
        "mixtral_router_loss",
        "llama_dynamic_rope",
        "phi3_longrope",
    ],  # fmt: skip
)
def test_models_ulysses_cannot_shard_are_refused_untouched(fake_world, build, match):
    _refused(build(), "fp32+sp:2", ValueError, match)


def test_the_switch_the_record_and_describe(fake_world):
    model = prepare_model(tiny_llama(), "fp32+ckpt+sp:2")
    assert model.config._attn_implementation == ULYSSES_ATTENTION
    result = model.memstack.sequence_parallel
    assert (result.size, result.rank, result.heads, result.kv_heads, result.previous) == (2, 0, 4, 2, "sdpa")
    assert "sequence parallel: Ulysses over 2 ranks" in describe(model)
    assert not model.memstack.attention.applied  # Ulysses attends per sample itself: no hf_memstack_sdpa


def test_sp_off_leaves_the_record_off():
    model = prepare_model(tiny_llama(), "fp32")
    assert not model.memstack.sequence_parallel.applied
    assert "sequence parallel" not in describe(model)


def test_a_padded_batch_and_a_kv_cache_are_refused_at_run_time(fake_world):
    model = prepare_model(tiny_llama(), "fp32+sp:2")
    ids = torch.randint(3, 100, (2, 8))
    with pytest.raises(ValueError, match=r"padded batch.*PackedCollator.*shard_batch"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 0] + [1] * 6] * 2), labels=ids)
    with pytest.raises(ValueError, match=r"an attention_mask of shape \(2, 1, 8, 8\).*no attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool), labels=ids)
    cache = model(input_ids=ids, position_ids=torch.arange(8)[None], use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"1 queries and 9 keys.*use_cache=False"):
        model(input_ids=ids[:, :1], position_ids=torch.tensor([[8]]), past_key_values=cache, use_cache=True)


def test_bidirectional_attention_and_a_router_loss_are_refused_at_run_time(fake_world):
    from transformers import MixtralConfig, MixtralForCausalLM

    model = prepare_model(MixtralForCausalLM(MixtralConfig(**_SMALL, num_local_experts=4)), "fp32+sp:2")
    ids = torch.randint(3, 100, (2, 8))
    batch = {"input_ids": ids, "position_ids": torch.arange(8)[None], "labels": ids, "use_cache": False}
    with pytest.raises(ValueError, match=r"called with output_router_logits=True.*output_router_logits=False"):
        model(**batch, output_router_logits=True)
    model.model.layers[1].self_attn.is_causal = False  # made bidirectional after prepare_model
    with pytest.raises(ValueError, match=r"MixtralAttention.is_causal is False.*causal LMs only"):
        model(**batch)


def test_the_group_batch_message_names_each_ranks_shape_and_the_fix():
    from hf_memstack.transforms.sequence_parallel.guard import group_batch_message

    message = group_batch_message([(2, 16), (3, 16)], 2)
    assert "rank 0 2 rows x 16 tokens, rank 1 3 rows x 16 tokens" in message
    assert "shard_batch(batch, sp_rank=rank % 2, sp_size=2)" in message and "rank // 2" in message


def test_a_trainer_without_the_hooks_is_refused_at_the_forward_naming_the_fix(fake_world):
    """A Trainer (or subclass) running the forward of an sp:N model that add_memstack_callback did not
    hook would give each rank other whole rows: the guard finds it above the forward and refuses."""
    from transformers import Trainer

    from hf_memstack.transforms.sequence_parallel.guard import TRAINER_MARK

    class Runner(Trainer):
        def __init__(self):  # only its frame matters: no Trainer set-up
            pass

        def run(self, model, batch):
            return model(**batch)

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    batch = shard_batch(make_batch("llama", seq=16), sp_rank=0, sp_size=2)
    with pytest.raises(
        ValueError, match=r"sp:2: Runner is training .* without hf_memstack's hooks.*add_memstack_callback\(trainer\)"
    ):
        Runner().run(model, batch)
    hooked = Runner()
    setattr(hooked, TRAINER_MARK, 2)
    assert hooked.run(model, batch).loss.shape == ()


def test_the_mask_function_passes_no_mask_and_an_all_ones_one():
    assert ulysses_mask(attention_mask=None) is None
    assert ulysses_mask(attention_mask=torch.ones(2, 8, dtype=torch.bool)) is None


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n", "expected"), [(4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (32, 8, 16, 2), (12, 3, 4, 4)]
)
def test_kv_replication_repeats_key_value_heads_until_n_divides_them(heads, kv_heads, n, expected):
    r = kv_replication(heads, kv_heads, n)
    assert r == expected and (kv_heads * r) % n == 0 and (heads // kv_heads) % r == 0


def test_the_exchanges_shapes_on_fake_tensors_and_a_whole_step_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memstack.transforms.sequence_parallel.attention import register_ulysses_attention

    register_ulysses_attention()  # as apply_sequence_parallel does (alone, no other test has registered it)
    group = register_group(None, size=2)
    set_active_group(group)
    with FakeTensorMode():
        x = torch.empty(3, 4, 8, 16)
        assert seq_to_head(x, group).shape == (3, 2, 16, 16)
        assert head_to_seq(seq_to_head(x, group), group).shape == x.shape
        model = tiny_llama()
        model.set_attn_implementation(ULYSSES_ATTENTION)
        ids = torch.randint(3, 100, (2, 8))
        out = model(input_ids=ids, position_ids=torch.arange(8)[None], labels=ids, use_cache=False)
        out.loss.backward()
        assert out.logits.shape == (2, 8, 128)
    with pytest.raises(RuntimeError, match="runs on fake tensors only"):
        seq_to_head(torch.zeros(1, 4, 2, 2), group)
