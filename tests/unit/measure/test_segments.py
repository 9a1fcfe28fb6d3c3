"""The parts of a step the tracker keeps apart for the depth extrapolation (measure/segments.py),
read on a real tiny Llama's training step: the order they run in, with and without checkpointing,
and that the highest part of each phase is the phase's peak as MemTracker reads it."""

from __future__ import annotations

import pytest
import torch
from tiny import make_batch, tiny_llama

from hf_memstack import prepare_model
from hf_memstack.measure.memory import trace_training_step
from hf_memstack.transforms.blocks import find_blocks


@pytest.mark.parametrize("policy", ["fp32", "fp32+ckpt"])
def test_each_phase_is_kept_in_parts_in_the_order_they_run(policy):
    layers = 3
    model = prepare_model(tiny_llama(num_hidden_layers=layers), policy)
    blocks = find_blocks(model).modules
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    traced = trace_training_step(model, make_batch("llama"), opt, blocks=blocks)
    forward, backward, step = (list(s) for s in traced.segments)
    # The forward runs the embeddings, the blocks from the input, then the head; the backward the
    # head's backward, the blocks from the last (a checkpointed block's recompute is inside its own
    # part), then the embeddings' (every weight trains: block 0's input needs its gradient).
    blocks_up = [("block", k) for k in range(layers)]
    assert forward == [("pre", 0), *blocks_up, ("post", 0)]
    assert backward == [("pre", 0), *reversed(blocks_up), ("post", 0)]
    assert step == [("pre", 0)]  # no block runs in the optimizer step
    for peak, parts in zip(traced.peaks, traced.segments, strict=True):
        assert max(p["total"] for p in parts.values()) == peak["total"]


def test_without_blocks_no_parts_are_kept():
    model = tiny_llama()
    traced = trace_training_step(model, make_batch("llama"), torch.optim.AdamW(model.parameters(), lr=1e-4))
    assert traced.segments == ()
