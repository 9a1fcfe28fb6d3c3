"""The planner reads a ckpt:N rung between its neighbours instead of tracing it (a ckpt:N trace
holds 3N blocks) only where it cannot fit: every rung it skipped, traced, is over the budget, and
the reading is close to the trace."""

from __future__ import annotations

from transformers import LlamaConfig

from hf_memstack import estimate_memory, plan_policy
from hf_memstack.precision import resolve_precision


def test_the_ckpt_n_rungs_it_reads_between_its_neighbours_do_not_fit():
    config = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=256, max_position_embeddings=2048)
    job = {"batch_size": 2, "seq_len": 512}
    precision = resolve_precision("auto", "cpu").name
    full = estimate_memory(config, f"{precision}+loss:chunked+ckpt", **job).peak_bytes
    budget = int(full / 0.9 * 1.01)  # every block checkpointed just fits
    plan = plan_policy(config, budget=budget, device="cpu", **job)
    assert plan.fits and plan.policy.checkpointing.mode == "full", plan.table()
    read = [r for r in plan.rows if r.interpolated]
    assert read, plan.table()
    for row in read:
        traced = estimate_memory(config, row.policy, **job).peak_bytes
        assert traced > budget * 0.9 and not row.fits
        assert abs(row.peak_bytes / traced - 1) < 0.10, (row, traced)
    assert "(interpolated)" in plan.table()
