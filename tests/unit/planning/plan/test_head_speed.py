"""The planner's chunked-loss speed at a label fraction (issue 41): ``loss:chunked`` runs its head over
the labelled positions only, so its rungs step faster on prompt-masked data than the factor measured
at every position - by the head's share of the step - and exactly that factor at every position."""

from __future__ import annotations

import json

import pytest
from tiny import llama_config

from hf_memstack import estimate_memory, plan_policy
from hf_memstack.cli.main import main
from hf_memstack.planning.plan.head_speed import MOST_HEAD_SHARE, chunked_loss_speed, head_share
from hf_memstack.planning.plan.rungs import MEASURED_SPEED

SEQ, BATCH = 256, 2
MEASURED = MEASURED_SPEED["loss_chunked"]


def _config():
    # A 32k vocabulary next to a narrow backbone: the head is a large part of the step.
    return llama_config(hidden_size=256, intermediate_size=688, num_hidden_layers=2, vocab_size=32000)


def _budget(config) -> int:
    """Between the plain rung's peak and the chunked loss's: the walk stops at the chunked rung."""
    job = {"batch_size": BATCH, "seq_len": SEQ, "device": "cuda"}
    plain = estimate_memory(config, "bf16", **job).peak_bytes
    chunked = estimate_memory(config, "bf16+loss:chunked", **job).peak_bytes
    assert chunked < plain
    return (plain + chunked) // 2


def test_the_chunked_rung_steps_faster_the_fewer_positions_carry_a_label():
    config = _config()
    budget = _budget(config)
    plans = {
        f: plan_policy(config, budget=budget, seq_len=SEQ, batch_size=BATCH, device="cuda", margin=0, label_fraction=f)
        for f in (1.0, 0.5, 0.2)
    }
    factor = {}
    for f, plan in plans.items():
        plain, chunked = plan.rows[:2]
        assert (plain.policy, chunked.policy) == ("bf16", "bf16+loss:chunked"), plan.table()
        assert not plain.fits and chunked.fits and plan.policy.loss.mode == "chunked"
        factor[f] = chunked.relative_speed / plain.relative_speed
        assert f"| {chunked.relative_speed:.2f}x |" in plan.table()  # the table prints it
    assert plans[1.0].rows[0].relative_speed == plans[0.2].rows[0].relative_speed  # the model's own loss: as before
    assert factor[1.0] == pytest.approx(MEASURED)  # every position labelled: the measured factor, unchanged
    # Fewer labelled positions, a faster step; never faster than the head alone gets (1/f of its time).
    assert MEASURED < factor[0.5] < factor[0.2] < MEASURED / 0.2
    assert "label fraction" not in plans[1.0].table()
    note = next(line for line in plans[0.2].table().splitlines() if "label fraction 0.20" in line)
    assert f"{factor[0.2]:.2f}x the model's own loss" in note


def test_the_factor_is_bounded_and_the_measured_one_at_every_position():
    for share in (0.0, 0.3, MOST_HEAD_SHARE, 1.0):
        assert chunked_loss_speed(share, 1.0) == pytest.approx(MEASURED)
    assert chunked_loss_speed(0.0, 0.1) == pytest.approx(MEASURED)  # no head, nothing gained
    # A head of the whole step is taken as MOST_HEAD_SHARE of it: a bound, whatever the fraction.
    assert chunked_loss_speed(1.0, 1e-6) == pytest.approx(MEASURED / (1 - MOST_HEAD_SHARE), rel=1e-4)
    speeds = [chunked_loss_speed(0.4, f) for f in (1.0, 0.8, 0.5, 0.2, 0.05)]
    assert speeds == sorted(speeds)


def test_the_head_share_grows_with_the_vocabulary_and_shrinks_with_the_backbone():
    import torch

    def share(**shape):
        return head_share(llama_config(**shape), task="causal-lm", dtype=torch.float32, seq_len=SEQ)

    base = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "vocab_size": 32000}
    assert 0 < share(**base) <= MOST_HEAD_SHARE
    assert share(**{**base, "vocab_size": 128000}) > share(**base)
    assert share(**{**base, "num_hidden_layers": 8}) < share(**base)


def test_the_cli_plan_shows_the_speed_at_a_label_fraction(tmp_path, capsys):
    config = _config()
    config.save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--device", "cuda"]
    args += ["--budget", str(_budget(config)), "--margin", "0"]
    rows = {}
    for fraction in ("1.0", "0.2"):
        assert main([*args, "--label-fraction", fraction, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        rows[fraction] = out["rows"][1]
        assert bool(out["head_speed"]) == (fraction == "0.2")
    assert rows["0.2"]["policy"] == rows["1.0"]["policy"] == "bf16+loss:chunked"
    assert rows["0.2"]["relative_speed"] > rows["1.0"]["relative_speed"]
    assert main([*args, "--label-fraction", "0.2"]) == 0
    assert "loss:chunked's head runs over the labelled 20% of the positions" in capsys.readouterr().out
