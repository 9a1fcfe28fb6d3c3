"""Encoder-decoder models (T5, BART): estimated as the sequence-to-sequence LM they are saved as
(``task="seq2seq-lm"``), against the meter on the real model loaded from a bf16 checkpoint; never
built as another model (BART's decoder alone, as BartForCausalLM) without saying so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zoo import ZOO, Arch, build

from hf_memstack import estimate_memory, make_optimizer, measure_step, plan_policy, prepare_model

SEQ = 32
_ENCODER_DECODERS = [a for a in ZOO if a.kind == "encoder-decoder"]
assert {a.name for a in _ENCODER_DECODERS} == {"t5", "bart"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each encoder-decoder saved as a bf16 checkpoint (``save_pretrained``)."""
    root = tmp_path_factory.mktemp("seq2seq")
    out = {}
    for arch in _ENCODER_DECODERS:
        build(arch).to(torch.bfloat16).save_pretrained(root / arch.name)
        out[arch.name] = root / arch.name
    return out


def _batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 200, (batch_size, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.mark.parametrize("arch", _ENCODER_DECODERS, ids=lambda a: a.name)
def test_the_estimate_equals_the_meter_on_the_real_model(saved, arch: Arch) -> None:
    model = prepare_model(build(arch, folder=saved[arch.name]), "bf16+ckpt")  # loaded the default way: bf16
    real = measure_step(model, _batch(2), make_optimizer(model, lr=1e-4), timed=False)
    est = estimate_memory(saved[arch.name], "bf16+ckpt", batch_size=2, seq_len=SEQ)
    assert est.parameters == real.parameters, (est.parameters, real.parameters)
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.03, (est.peak_bytes, real.peak_bytes)
    assert any(n.startswith("task: seq2seq-lm") and "label tokens" in n for n in est.notes), est.notes
    # Asked for by name, and for the model object, the same model is estimated.
    by_name = estimate_memory(saved[arch.name], "bf16+ckpt", batch_size=2, seq_len=SEQ, task="seq2seq-lm")
    assert by_name.parameters == real.parameters
    loaded = build(arch, folder=saved[arch.name])
    assert estimate_memory(loaded, "bf16+ckpt", batch_size=2, seq_len=SEQ).parameters == real.parameters


@pytest.mark.parametrize("arch", _ENCODER_DECODERS, ids=lambda a: a.name)
def test_chunked_loss_is_refused_as_prepare_model_refuses_it(saved, arch: Arch) -> None:
    with pytest.raises(ValueError, match="needs a causal language model") as prepared:
        prepare_model(build(arch, folder=saved[arch.name]), "bf16+loss:chunked")
    with pytest.raises(ValueError, match="needs a causal language model") as estimated:
        estimate_memory(saved[arch.name], "bf16+loss:chunked", batch_size=2, seq_len=SEQ)
    assert str(prepared.value) in str(estimated.value)


def test_the_planner_plans_an_encoder_decoder_without_a_chunked_loss_rung(saved) -> None:
    folder = saved["t5"]
    plan = plan_policy(folder, budget="1GiB", seq_len=SEQ, batch_size=2, device="cpu")
    assert plan.fits and plan.estimate is not None and plan.rows
    assert not any("loss:chunked" in row.policy for row in plan.rows), [r.policy for r in plan.rows]
    direct = estimate_memory(folder, plan.policy, batch_size=2, seq_len=SEQ)
    assert plan.estimate.parameters == direct.parameters


def test_another_head_of_an_encoder_decoder_is_refused_naming_the_model(saved, tmp_path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(saved["bart"])
    # As a causal LM, BART is its decoder alone (BartForCausalLM): another model, refused.
    with pytest.raises(ValueError, match=r"task='causal-lm' on BartConfig \(model_type='bart'\), an encoder-decoder"):
        estimate_memory(config, "bf16", batch_size=1, seq_len=SEQ, task="causal-lm")
    config.architectures = ["BartForQuestionAnswering"]
    with pytest.raises(
        ValueError, match=r"BartForQuestionAnswering \(BartConfig, model_type='bart'\) is an encoder-dec"
    ):
        estimate_memory(config, "bf16", batch_size=1, seq_len=SEQ)
    with pytest.raises(ValueError, match="task='bogus' is not one of 'causal-lm', 'seq2seq-lm', 'classification'"):
        estimate_memory(config, "bf16", batch_size=1, seq_len=SEQ, task="bogus")
