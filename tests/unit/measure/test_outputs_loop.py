"""measure_step measures the loop it says it measured: one that drops the model's outputs once the
loss is taken (Trainer, the recipe), or one that keeps ``outputs`` through the backward
(``outputs = model(**batch); outputs.loss.backward()``), whose fp32 logits (the prepared bf16
forward returns fp32 outputs, as Accelerate does) stay alive - each equal, to the byte, to PyTorch's
MemTracker on the same loop written by hand, on a steady-state step of a checkpoint saved in bf16."""

from __future__ import annotations

import pytest
import torch
from loops import memtracker_peak
from tiny import tiny_llama

from hf_memstack import measure_step, prepare_model

VOCAB, BATCH, SEQ = 1000, 2, 64


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    tiny_llama(vocab_size=VOCAB).to(torch.bfloat16).save_pretrained(path)
    return path


def _prepared(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).train()
    assert model.dtype == torch.bfloat16  # as saved: what a user loads by default
    return prepare_model(model, "bf16+ckpt")


def _batch():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("keep", [False, True])
def test_the_meter_equals_memtracker_on_the_loop_it_names(bf16_dir, keep):
    reference = memtracker_peak(_prepared(bf16_dir), _batch(), keep_outputs=keep)
    model = _prepared(bf16_dir)
    measured = measure_step(
        model, _batch(), torch.optim.AdamW(model.parameters(), lr=1e-4), keep_outputs=keep, timed=False
    )
    assert measured.loop == ("outputs kept" if keep else "outputs dropped")
    assert measured.loop in measured.summary()
    assert measured.peak_bytes == reference


def test_keeping_the_outputs_costs_their_fp32_logits(bf16_dir):
    model = _prepared(bf16_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dropped = measure_step(model, _batch(), opt, timed=False)
    kept = measure_step(model, _batch(), opt, timed=False, keep_outputs=True)
    assert dropped.loop == "outputs dropped"  # the default: Trainer's and the recipe's loop
    # One fp32 [batch, seq, vocab] tensor more at the peak (in the backward, where both peak).
    assert kept.peak_bytes - dropped.peak_bytes == BATCH * SEQ * VOCAB * torch.float32.itemsize
    assert kept.peak_phase == dropped.peak_phase == "forward+backward"


def test_a_step_fn_is_its_own_loop_and_keep_outputs_with_it_is_refused(bf16_dir):
    model = _prepared(bf16_dir)

    def step_fn(m, b, o):
        m(**b).loss.backward()

    assert measure_step(model, _batch(), step_fn=step_fn, timed=False).loop == "step_fn"
    with pytest.raises(ValueError, match="keep_outputs=True with a step_fn"):
        measure_step(model, _batch(), step_fn=step_fn, keep_outputs=True)


def test_the_previous_steps_outputs_are_counted_through_the_next_forward(bf16_dir):
    """``outputs = model(**batch)`` rebinds only once the forward returns: the previous step's outputs
    are alive through all of it. The traced forward's peak counts them as MemTracker does when given them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from hf_memstack.measure.memory import trace_training_step

    model = _prepared(bf16_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    outputs = model(**_batch())
    outputs.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = _batch()  # made before the step, as a data loader makes it
    tracker = MemTracker()
    tracker.track_external(model, opt, outputs.loss, outputs.logits)
    with tracker:
        outputs = model(**batch)
    reference = sum(v for dev in tracker.get_tracker_snapshot("peak").values() for k, v in dev.items() if k == "Total")
    del outputs
    kept = trace_training_step(model, batch, opt, keep_outputs=True)
    dropped = trace_training_step(model, batch, opt)
    assert kept.peaks[0]["total"] == reference
    assert kept.kept == BATCH * SEQ * VOCAB * torch.float32.itemsize + 4 and dropped.kept == 0  # the logits, the loss
    assert kept.peaks[0]["total"] - dropped.peaks[0]["total"] == kept.kept
