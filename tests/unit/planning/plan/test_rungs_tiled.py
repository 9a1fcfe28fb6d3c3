"""The tiled-MLP rung: placed among the activation rungs by its measured speed (after full
checkpointing, whose work it adds to), kept by the rungs after it, offered only when a step holds
more tokens than one tile, and chosen by the planner when it is what fits."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from hf_memstack import MemoryPolicy, estimate_memory, plan_policy
from hf_memstack.planning.plan.rungs import MEASURED_SPEED, memory_rungs


def test_the_rung_sits_after_full_checkpointing_and_the_rungs_after_it_keep_the_tiles():
    plain = [r.policy for r in memory_rungs("bf16", num_blocks=4, world_size=2, causal_lm=True)]
    tiled = memory_rungs("bf16", num_blocks=4, world_size=2, causal_lm=True, tiled_mlp=True)
    names = [r.policy for r in tiled]
    at = names.index("bf16+loss:chunked+ckpt+mlp:tiled")
    assert names[:at] == plain[:at] and names[at - 1] == "bf16+loss:chunked+ckpt"
    assert all(MemoryPolicy.from_string(n).mlp.mode == "tiled" for n in names[at:])
    assert [n.replace("+mlp:tiled", "") for n in names[at + 1 :]] == plain[at:]
    speeds = {r.policy: r.relative_speed for r in tiled}
    assert speeds[names[at]] == speeds[names[at - 1]] * MEASURED_SPEED["mlp_tiled"]


@pytest.mark.slow
def test_the_planner_offers_tiles_for_long_sequences_only():
    from hf_memstack.transforms.precision.apply import resolve_precision

    precision = resolve_precision("auto", "cpu").name  # what the planner starts from on this CPU
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=4096,
    )
    short = plan_policy(config, budget="1GiB", seq_len=64, device="cpu")
    assert short.fits and not any("mlp:tiled" in r.policy for r in short.rows)
    # Full checkpointing alone holds the whole recomputed MLP of a block: 2,048 tokens x 512 x 4 bytes per tensor.
    ckpt = estimate_memory(config, f"{precision}+loss:chunked+ckpt", batch_size=1, seq_len=2048).peak_bytes
    long = plan_policy(config, budget=int(ckpt / 0.9) - 1, seq_len=2048, device="cpu")
    assert long.fits and long.policy.mlp.mode == "tiled" and long.policy.checkpointing.mode == "full"
    assert long.estimate.peak_bytes < ckpt
