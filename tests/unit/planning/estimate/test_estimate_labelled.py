"""The estimator counts the chunked head over the labelled positions (issue 41): ``label_fraction=``
(``--label-fraction``) against the meter on a prompt-masked batch."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hf_memstack import estimate_memory, make_optimizer, measure_step, plan_policy, prepare_model
from hf_memstack.cli.main import main

SEQ = 256


def _config() -> transformers.LlamaConfig:
    # A vocabulary large next to the rest, so the head's chunk is most of the step's peak.
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=SEQ,
    )


def test_the_estimate_at_half_labelled_matches_the_meter_on_a_half_masked_batch():
    config = _config()
    policy = "fp32+loss:chunked"
    half = estimate_memory(config, policy, batch_size=2, seq_len=SEQ, label_fraction=0.5)
    full = estimate_memory(config, policy, batch_size=2, seq_len=SEQ)
    torch.manual_seed(0)
    model = prepare_model(transformers.LlamaForCausalLM(config).train(), policy)
    ids = torch.randint(3, config.vocab_size, (2, SEQ))
    labels = ids.clone()
    labels[:, : SEQ // 2] = -100  # the prompt: half of each row's positions predict a label
    real = measure_step(model, {"input_ids": ids, "labels": labels}, make_optimizer(model, lr=1e-4), timed=False)
    assert abs(half.peak_bytes / real.peak_bytes - 1) <= 0.02, (half.peak_bytes, real.peak_bytes)
    # The default (every position labelled) over-counts this batch by the head's masked half.
    assert full.peak_bytes > 1.15 * real.peak_bytes, (full.peak_bytes, real.peak_bytes)


def test_the_cli_takes_label_fraction_and_refuses_a_bad_one(tmp_path, capsys):
    _config().save_pretrained(tmp_path)
    args = ["estimate", str(tmp_path), "--policy", "fp32+loss:chunked", "--batch-size", "2", "--seq-len", str(SEQ)]
    peaks = []
    for extra in ([], ["--label-fraction", "0.25"]):
        assert main([*args, *extra, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)["estimates"]
        peaks.append(row["peak_bytes"])
    assert peaks[1] < peaks[0]
    assert main([*args, "--label-fraction", "0"]) == 2
    assert "--label-fraction='0' must be a number in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, 1.5, "half", True])
def test_estimate_and_plan_refuse_a_label_fraction_outside_0_1(bad):
    with pytest.raises(ValueError, match=r"label_fraction=.* must be a number in \(0, 1\]"):
        estimate_memory(_config(), "fp32+loss:chunked", batch_size=1, seq_len=16, label_fraction=bad)
    with pytest.raises(ValueError, match=r"label_fraction=.* must be a number in \(0, 1\]"):
        plan_policy(_config(), budget="1GiB", seq_len=16, label_fraction=bad)
