"""The loop style is part of the estimate: ``keep_outputs=True`` counts the outputs a loop keeps
through the backward (``outputs = model(**batch); outputs.loss.backward()``: fp32 logits under
bf16), the default counts Trainer's loop, which drops them - each equal to PyTorch's MemTracker on
that loop written by hand (a steady-state step of a checkpoint saved in bf16); in the planner and
the CLI too."""

from __future__ import annotations

import json

import pytest
import torch
from loops import memtracker_peak
from tiny import tiny_llama

from hf_memstack import estimate_memory, prepare_model
from hf_memstack.cli.main import main
from hf_memstack.planning.plan.planner import plan_policy

VOCAB, BATCH, SEQ = 1000, 2, 64
LOGITS = BATCH * SEQ * VOCAB * torch.float32.itemsize  # one fp32 [batch, seq, vocab] tensor


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    tiny_llama(vocab_size=VOCAB).to(torch.bfloat16).save_pretrained(path)
    return path


def _estimate(path, keep, policy="bf16+ckpt", **kw):
    return estimate_memory(path, policy, batch_size=BATCH, seq_len=SEQ, device="cpu", keep_outputs=keep, **kw)


@pytest.mark.parametrize("keep", [False, True])
def test_the_estimate_equals_memtracker_on_the_loop_it_counts(bf16_dir, keep):
    from transformers import AutoModelForCausalLM

    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir).train(), "bf16+ckpt")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    reference = memtracker_peak(model, {"input_ids": ids, "labels": ids.clone()}, keep_outputs=keep)
    est = _estimate(bf16_dir, keep)
    assert est.weights_dtype == "bf16" and est.keep_outputs is keep
    assert est.peak_bytes == reference
    # What the kept loop holds: the fp32 logits and the loss (a 4-byte fp32 scalar); none when dropped.
    assert est.kept_outputs_bytes == (LOGITS + 4 if keep else 0)


def test_kept_outputs_are_counted_at_any_depth_and_in_the_full_trace(bf16_dir):
    kept, dropped = _estimate(bf16_dir, True), _estimate(bf16_dir, False)
    assert kept.peak_bytes - dropped.peak_bytes == LOGITS  # the loss is alive in both loops' backward
    full = _estimate(bf16_dir, True, extrapolate=False)
    assert (full.peak_bytes, full.kept_outputs_bytes) == (kept.peak_bytes, kept.kept_outputs_bytes)
    assert "keeps its outputs" in kept.summary() and "keeps its outputs" not in dropped.summary()


def test_keep_outputs_is_a_training_loop_and_a_bool(bf16_dir):
    with pytest.raises(ValueError, match="keep_outputs=True with mode='eval'"):
        _estimate(bf16_dir, True, mode="eval")
    with pytest.raises(TypeError, match="keep_outputs='yes' must be True or False"):
        _estimate(bf16_dir, "yes")


def test_the_planner_counts_the_loop_it_is_told(bf16_dir):
    dropped = plan_policy(bf16_dir, budget="1GiB", seq_len=SEQ, batch_size=BATCH, device="cpu", margin=0)
    first = dropped.rows[0].policy
    # A budget the first rung fits exactly in Trainer's loop: not in a loop keeping its outputs.
    exact = _estimate(bf16_dir, False, policy=first).peak_bytes
    fits = plan_policy(bf16_dir, budget=exact, seq_len=SEQ, batch_size=BATCH, device="cpu", margin=0)
    kept = plan_policy(bf16_dir, budget=exact, seq_len=SEQ, batch_size=BATCH, device="cpu", margin=0, keep_outputs=True)
    assert fits.policy is not None and fits.policy.to_string() == first
    assert kept.policy is None or kept.policy.to_string() != first
    assert kept.rows[0].peak_bytes == _estimate(bf16_dir, True, policy=first).peak_bytes


def test_the_cli_takes_keep_outputs_for_estimate_and_plan(bf16_dir, capsys):
    args = ["estimate", str(bf16_dir), "--policy", "bf16+ckpt", "--batch-size", str(BATCH), "--seq-len", str(SEQ)]
    assert main([*args, "--device", "cpu", "--json", "--keep-outputs"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["estimates"]
    assert row["keep_outputs"] is True and row["peak_bytes"] == _estimate(bf16_dir, True).peak_bytes
    assert main([*args, "--device", "cpu", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["estimates"]
    assert row["keep_outputs"] is False and row["peak_bytes"] == _estimate(bf16_dir, False).peak_bytes
    plan = ["plan", str(bf16_dir), "--budget", "1GiB", "--seq-len", str(SEQ), "--batch-size", str(BATCH)]
    assert main([*plan, "--device", "cpu", "--json", "--margin", "0", "--keep-outputs"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["rows"][0]["peak_bytes"] == _estimate(bf16_dir, True, policy=chosen["rows"][0]["policy"]).peak_bytes
