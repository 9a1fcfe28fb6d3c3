"""Packed rows against each sample run alone (logits and gradients) on Llama, Qwen2 and GPT-2
(absolute positions) under SDPA and eager; prompt masking inside packed rows; the refusals of what
would let packed samples attend to each other, and verify's packing check."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_memstack import prepare_model, verify
from hf_memstack.data import (
    PackedCollator,
    check_packed_batch,
    compare_packed_to_separate,
    is_packed,
    pack_dataset,
    segment_lengths,
)

VOCAB = 96
LENGTHS = [7, 12, 5, 9, 3, 11]


def _model(arch: str, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    small = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "attn_implementation": attn,
    }
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**small)).train()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**small)).train()
    return GPT2LMHeadModel(
        GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation=attn,
        )
    ).train()


def _samples(lengths: list[int], prompt: int = 0) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * min(prompt, n) + ids[prompt:]})
    return out


def _alone_loss_sum(model: torch.nn.Module, sample: dict[str, list[int]]) -> tuple[torch.Tensor, int]:
    """A sample's summed next-token loss and its number of counted tokens, run alone (no position_ids)."""
    ids, labels = torch.tensor([sample["input_ids"]]), torch.tensor([sample["labels"]])
    logits = model(input_ids=ids).logits[0, :-1]
    target = labels[0, 1:]
    return F.cross_entropy(logits, target, ignore_index=-100, reduction="sum"), int((target != -100).sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_packed_rows_give_every_sample_its_own_logits_and_gradients(arch, attn):
    reference = _model(arch, attn)
    prepared = prepare_model(copy.deepcopy(reference), "fp32")
    samples = _samples(LENGTHS)
    rows = pack_dataset(samples, 16)
    batch = PackedCollator()(rows)
    assert batch["input_ids"].shape[0] < len(samples) and is_packed(batch["position_ids"])

    packed_logits = prepared(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    order = [s for row in rows for s in _split(row)]
    spans = [
        (r, sum(row["seq_lengths"][:i]), n) for r, row in enumerate(rows) for i, n in enumerate(row["seq_lengths"])
    ]
    # The positions say the same: each row's samples, then its padding segment.
    assert [
        lengths[: len(row["seq_lengths"])] for lengths, row in zip(segment_lengths(batch["position_ids"]), rows)
    ] == [row["seq_lengths"] for row in rows]
    for sample, (r, start, n) in zip(order, spans):
        alone = reference(input_ids=torch.tensor([sample])).logits[0]
        torch.testing.assert_close(packed_logits[r, start : start + n], alone, atol=2e-5, rtol=1e-5)

    prepared(**batch).loss.backward()
    total, count = zip(*(_alone_loss_sum(reference, s) for s in samples))
    (sum(total) / sum(count)).backward()
    grads = dict(reference.named_parameters())
    for name, p in prepared.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=2e-6, rtol=1e-4, msg=name)


def _split(row: dict[str, list[int]]) -> list[list[int]]:
    out, start = [], 0
    for n in row["seq_lengths"]:
        out.append(row["input_ids"][start : start + n])
        start += n
    return out


def test_prompt_tokens_stay_masked_inside_packed_rows():
    reference = _model("llama")
    prepared = prepare_model(copy.deepcopy(reference), "fp32")
    samples = _samples(LENGTHS, prompt=4)
    batch = PackedCollator()(pack_dataset(samples, 16))
    # Only response tokens (after each sample's first) carry labels: 4 prompt tokens per sample are masked.
    assert int((batch["labels"] != -100).sum()) == sum(max(0, n - 4) for n in LENGTHS)
    loss = prepared(**batch).loss
    total, count = zip(*(_alone_loss_sum(reference, s) for s in samples))
    torch.testing.assert_close(loss, sum(total) / sum(count), atol=1e-6, rtol=1e-6)


@pytest.fixture
def packed_model_and_batch():
    model = prepare_model(_model("llama"), "fp32")
    return model, PackedCollator()(pack_dataset(_samples(LENGTHS), 16))


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"attention_mask": "ones"}, "attention_mask: a packed batch .* 2-D attention_mask"),
        ({"use_cache": True}, "use_cache: a packed batch with use_cache=True in the call"),
    ],
)
def test_the_forward_refuses_a_packed_batch_that_would_attend_across_samples(packed_model_and_batch, extra, match):
    model, batch = packed_model_and_batch
    if extra.get("attention_mask") == "ones":
        extra = {"attention_mask": torch.ones_like(batch["input_ids"])}
    with pytest.raises(ValueError, match=match):
        model(**batch, **extra)
    with torch.no_grad(), pytest.raises(ValueError, match=match):  # evaluation too (labels given)
        model(**batch, **extra)


def test_a_mask_hiding_the_separators_does_not_hide_the_packing(packed_model_and_batch):
    """Trial finding (issue 22): with the pad token also ending every sample, the common
    attention_mask = input_ids != pad masks the separators; the restarts then sat next to masked
    tokens, the batch passed as padded, and the samples attended to each other (losses off by 0.12)."""
    model, batch = packed_model_and_batch
    mask = torch.ones_like(batch["input_ids"])
    starts = batch["position_ids"][:, 1:] == 0
    mask[:, :-1][starts] = 0  # the token before each restart (the previous sample's end) masked
    assert is_packed(batch["position_ids"], mask)
    with pytest.raises(ValueError, match="attention_mask: a packed batch .* 2-D attention_mask"):
        model(**batch, attention_mask=mask)
    # A mask with a hole in one sample, positions counting on across it, is not a packing.
    positions = torch.arange(6).unsqueeze(0)
    assert not is_packed(positions, torch.tensor([[1, 1, 0, 0, 1, 1]]))
    assert not is_packed((torch.tensor([[1, 1, 0, 1, 1]]).cumsum(-1) - 1).clamp(min=0), torch.tensor([[1, 1, 0, 1, 1]]))


def test_use_cache_turned_back_on_in_the_config_is_refused(packed_model_and_batch):
    model, batch = packed_model_and_batch
    model.config.use_cache = True
    with pytest.raises(ValueError, match="model.config.use_cache=True"):
        model(**batch)
    model.config.use_cache = False
    assert torch.isfinite(model(**batch).loss)


def test_padded_batches_and_generation_are_not_taken_for_packed_ones(packed_model_and_batch):
    model, _ = packed_model_and_batch
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: [0, 0, 0, 1, 2]
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    assert not is_packed(positions, mask)
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=ids).loss)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 7)


def _register_causal_only() -> str:
    """An attention implementation that ignores the mask (causal attention over the whole row)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("causal_only_test", causal_only)
    AttentionMaskInterface.register("causal_only_test", sdpa_mask)
    return "causal_only_test"


def test_an_attention_implementation_that_ignores_the_boundaries_is_refused():
    name = _register_causal_only()
    batch = PackedCollator()(pack_dataset(_samples(LENGTHS), 16))
    plain = _model("llama", name)
    plain.config.use_cache = False
    comparison = compare_packed_to_separate(plain, batch)  # the contamination is real: samples differ
    assert not comparison.ok and comparison.max_abs_diff > 0.01
    model = prepare_model(_model("llama", name), "fp32")
    with pytest.raises(ValueError, match=r"attn_implementation='causal_only_test'.*attend to each other"):
        model(**batch)
    with pytest.raises(ValueError, match="attend to each other"):
        check_packed_batch(plain, batch)
    with pytest.raises(
        ValueError, match="attend to each other"
    ):  # without a probe (FSDP): by the implementation's name
        check_packed_batch(plain, batch, probe=False)


def test_compare_finds_the_contamination_of_an_all_ones_mask():
    model = _model("llama")
    model.config.use_cache = False
    batch = PackedCollator()(pack_dataset(_samples(LENGTHS), 16))
    assert compare_packed_to_separate(model, batch).ok
    contaminated = compare_packed_to_separate(model, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    assert not contaminated.ok and contaminated.max_abs_diff > 0.05
    assert "attend to each other" in contaminated.describe()


@pytest.mark.parametrize("policy", ["fp32", "bf16+loss:chunked"])
def test_verify_compares_a_packed_batch_with_its_samples_alone(policy):
    model = prepare_model(_model("llama"), policy)
    report = verify(model, PackedCollator()(pack_dataset(_samples(LENGTHS), 16)))
    assert report.ok, str(report)
    check = report.check("packing")
    assert "6 samples of" in check.detail
    assert "packing" not in [
        c.name
        for c in verify(
            model, {"input_ids": torch.tensor([[3, 4, 5, 6]]), "labels": torch.tensor([[3, 4, 5, 6]])}
        ).checks
    ]
