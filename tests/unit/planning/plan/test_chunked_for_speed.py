"""The planner adds the chunked loss head for speed, not only for memory (issue 41): a causal LM whose
plan fits plain mixed precision gets ``+loss:chunked`` when its head, run over the labelled positions
only, is predicted faster by ``FASTER_BY`` or more - and the plan says why. At every position, with
the outputs kept (the chunked head returns no logits), or for a classifier, the walk's answer stands."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import llama_config

from hf_memstack import estimate_memory, plan_policy
from hf_memstack.cli.main import main
from hf_memstack.planning.plan.head_speed import FASTER_BY, chunked_loss_speed, head_share

SEQ, BATCH = 256, 2
JOB = {"seq_len": SEQ, "device": "cuda", "margin": 0}


def _config():
    # A 32k vocabulary next to a narrow backbone: the head is a large part of the step.
    return llama_config(hidden_size=256, intermediate_size=688, num_hidden_layers=2, vocab_size=32000)


def _budget(config) -> int:
    """Room for the plain rung, so the walk stops at its first rung (plain mixed precision)."""
    return 2 * estimate_memory(config, "bf16", batch_size=BATCH, seq_len=SEQ, device="cuda").peak_bytes


def _factor(config, fraction: float) -> float:
    share = head_share(config, task="causal-lm", dtype=torch.float32, seq_len=SEQ)
    return chunked_loss_speed(share, fraction)


def test_a_plan_that_fits_bf16_takes_the_chunked_head_below_a_label_fraction_of_1():
    config = _config()
    assert _factor(config, 0.25) >= FASTER_BY  # the case the rule is for
    plans = {
        f: plan_policy(config, budget=_budget(config), batch_size=BATCH, label_fraction=f, **JOB) for f in (1.0, 0.25)
    }

    every = plans[1.0]
    assert every.policy.to_string() == "bf16" and [r.policy for r in every.rows] == ["bf16"]
    assert every.chunked_for_speed == "" and "added for speed" not in every.table()

    labelled = plans[0.25]
    assert labelled.policy.to_string() == "bf16+loss:chunked" and labelled.batch_size == BATCH
    plain, chunked = labelled.rows
    assert (plain.policy, chunked.policy) == ("bf16", "bf16+loss:chunked")
    assert plain.fits and chunked.fits and chunked.peak_bytes <= plain.peak_bytes  # lighter too
    assert chunked.relative_speed == pytest.approx(plain.relative_speed * _factor(config, 0.25))
    # The estimate chosen is the chunked policy's own.
    assert labelled.estimate.peak_bytes == chunked.peak_bytes
    note = labelled.chunked_for_speed
    assert note.startswith("loss:chunked added for speed") and "labelled 25% of the positions" in note
    assert f"x{_factor(config, 0.25):.2f} predicted over bf16" in note
    assert f"  - {note}" in labelled.table()
    assert labelled.as_dict()["chunked_for_speed"] == note
    # Compiling the whole model would run every position through the head: regional compilation is advised.
    assert "compile:regional" in labelled.suggestions[0]


def test_a_gain_within_the_noise_leaves_the_plan_as_the_walk_chose():
    config = _config()
    fraction = 0.999  # a head over 99.9% of the positions: nearly the measured factor at every position
    assert _factor(config, fraction) < FASTER_BY
    plan = plan_policy(config, budget=_budget(config), batch_size=BATCH, label_fraction=fraction, **JOB)
    assert plan.policy.to_string() == "bf16" and plan.chunked_for_speed == ""


def test_a_loop_that_keeps_the_outputs_keeps_the_logits():
    config = _config()
    plan = plan_policy(config, budget=_budget(config), batch_size=BATCH, label_fraction=0.25, keep_outputs=True, **JOB)
    assert plan.policy.to_string() == "bf16" and [r.policy for r in plan.rows] == ["bf16"]
    assert plan.chunked_for_speed == ""


def test_a_classifier_is_planned_as_before():
    config = _config()
    config.pad_token_id = 0  # a sequence classifier pools at the last non-pad token of each row
    plan = plan_policy(config, budget="8GiB", batch_size=BATCH, label_fraction=0.25, task="classification", **JOB)
    assert plan.policy.to_string() == "bf16" and [r.policy for r in plan.rows] == ["bf16"]
    assert plan.chunked_for_speed == ""


def test_the_largest_batch_is_the_chunked_policys_own():
    config = _config()
    budget = _budget(config)
    plan = plan_policy(config, budget=budget, batch_size="max", label_fraction=0.25, **JOB)
    plain, chunked = plan.rows
    assert plan.policy.to_string() == chunked.policy == "bf16+loss:chunked"
    assert plan.batch_size == chunked.max_batch_size >= plain.max_batch_size >= 1
    assert (
        estimate_memory(
            config, "bf16+loss:chunked", batch_size=plan.batch_size, seq_len=SEQ, device="cuda", label_fraction=0.25
        ).peak_bytes
        <= budget
    )


def test_the_cli_plan_says_why_it_added_the_chunked_head(tmp_path, capsys):
    config = _config()
    config.save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--device", "cuda"]
    args += ["--budget", str(_budget(config)), "--margin", "0", "--label-fraction", "0.25"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "choose: bf16+loss:chunked at batch size 2" in out
    assert "loss:chunked added for speed: the head runs over the labelled 25% of the positions" in out
    assert main([*args, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["policy"] == "bf16+loss:chunked"
    assert planned["chunked_for_speed"].startswith("loss:chunked added for speed")
    assert main([*args, "--keep-outputs", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["policy"] == "bf16" and kept["chunked_for_speed"] == ""
