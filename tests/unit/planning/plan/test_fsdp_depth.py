"""FSDP estimates of a 70B-shaped Llama (config only, traced on fake tensors) at any depth: the
forward+backward peak holds at least the resident parameters, the activations grow with the blocks
and the sequence as the single-device trace's do, and the plan at 8 x 80 GiB checkpoints."""

from __future__ import annotations

import json

import pytest

from hf_memstack import estimate_memory, plan_policy
from hf_memstack.planning.plan.estimates import with_activation_floor
from hf_memstack.policy import MemoryPolicy

LLAMA_70B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**{k: v for k, v in LLAMA_70B.items() if k != "model_type"}, "num_hidden_layers": layers})


def _est(layers: int, policy: str, seq: int = 4096):
    return estimate_memory(_config(layers), policy, batch_size=1, seq_len=seq, world_size=8, device="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bf16+fsdp", "bf16+fsdp+loss:chunked"])
def test_fsdp_reading_at_4_16_and_80_blocks_holds_its_parameters_and_grows(policy):
    ests = {layers: _est(layers, policy) for layers in (4, 16, 80)}
    single = {
        layers: estimate_memory(_config(layers), "bf16", batch_size=1, seq_len=4096, device="cuda")
        for layers in (4, 16)
    }
    for layers, e in ests.items():
        assert e.forward_backward_peak >= e.parameters + e.optimizer, (layers, e)
        # No checkpointing: every block's activations are held at the peak, as the estimate's own slope says
        # (4 blocks are traced in full: no slope to read).
        assert e.activations >= e.activations_per_block * e.blocks, (layers, e)
        assert layers == 4 or e.activations_per_block * e.blocks > 0, (layers, e)
    per_block = (ests[16].activations - ests[4].activations) / 12
    assert (ests[80].activations - ests[16].activations) / 64 == pytest.approx(per_block, rel=0.01)
    # Sharding divides states, not activations; a rank gathering bf16 parameters (FSDP2's param_dtype) computes in
    # bf16 throughout - residual stream, norms, no autocast copies of fp32 master weights (measured on 2 gloo
    # ranks: tests/distributed/test_fsdp_estimate.py) - so each block adds what it adds on one device under pure
    # bf16, less than under autocast over fp32 masters.
    pure = estimate_memory(
        _config(16), policy.replace("+fsdp", "+weights:bf16"), batch_size=1, seq_len=4096, device="cuda"
    )
    single = estimate_memory(_config(16), policy.replace("+fsdp", ""), batch_size=1, seq_len=4096, device="cuda")
    assert per_block == pytest.approx(pure.activations_per_block, rel=0.01)
    assert per_block < single.activations_per_block
    longer = _est(16, policy, seq=8192)
    assert longer.activations > 1.9 * ests[16].activations


def test_the_activation_floor_raises_an_estimate_below_its_per_block_reading():
    import dataclasses

    e = _est(4, "bf16+ckpt+fsdp")
    assert with_activation_floor(e) == e  # a sound estimate stands
    # The forward+backward read below the states and its blocks' activations (as FSDP's once read): raised.
    low = dataclasses.replace(e, activations_per_block=e.peak_bytes, blocks=4, forward_backward_peak=0)
    raised = with_activation_floor(low)
    floor = e.parameters + e.optimizer + 4 * e.peak_bytes
    assert raised.forward_backward_peak == raised.peak_bytes == floor
    assert raised.activations == 4 * e.peak_bytes - e.gradients  # the rest of the floor beside the states
    parts = ("parameters", "gradients", "optimizer", "activations", "temporaries")
    assert raised.peak_bytes == sum(getattr(raised, k) for k in parts)
    assert "raised" in raised.notes[-1]


@pytest.mark.slow
def test_the_70b_plan_at_8_x_80_gib_checkpoints_and_its_figure_holds_its_blocks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    plan = plan_policy(str(tmp_path), budget="80GiB", seq_len=4096, world_size=8, device="cuda")
    if plan.estimate is None:
        return  # nothing fits: said, never a run without checkpointing
    assert plan.policy.checkpointing.mode != "none", plan.policy
    e = plan.estimate
    assert e.blocks == 80 and e.activations >= e.activations_per_block * e.blocks
    # Without checkpointing, every block's activations: far over the budget.
    plain = _est(80, "bf16+fsdp+loss:chunked+weights:bf16")
    assert plain.activations >= 80 * plain.activations_per_block > 80 * 2**30
    assert plain.peak_bytes > plan.usable_bytes
    # A rung without FSDP borrowing the chosen run's state savings is as fast as its rung times
    # those savings: it borrows no offloaded sharding's slowness (it read 0.30x for bf16+weights:bf16).
    from hf_memstack.planning.plan.rungs import savings_speed

    speeds = {r.policy: r.relative_speed for r in plan.rows}
    pairs = [
        (r.policy, base)
        for r in plan.rows
        if "fsdp" not in r.policy
        for base in [r.policy.replace("+weights:bf16", "")]
        if base != r.policy and base in speeds
    ]
    assert pairs, speeds
    for policy, base in pairs:
        ratio = savings_speed(MemoryPolicy.coerce(policy)) / savings_speed(MemoryPolicy.coerce(base))
        assert speeds[policy] == pytest.approx(speeds[base] * ratio), (policy, base, speeds)
