"""The planner offers sequence parallelism (sp:N) for packed rows too (``packed=True``: the estimator traces
them, tests/unit/planning/estimate/test_estimate_sp_packed.py), as it does for unpacked ones
(tests/unit/planning/plan/test_plan_sp.py)."""

from transformers import LlamaConfig

from hf_memstack import estimate_memory, plan_policy

SEQ = 2048


def _config():
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=4096,
    )


def _plan(cfg, budget):
    return plan_policy(cfg, budget=budget, seq_len=SEQ, world_size=2, packed=True, device="cpu", margin=0.0)


def test_the_planner_shards_packed_rows_by_sequence_when_no_activation_rung_fits():
    cfg = _config()
    policies = [r.policy for r in _plan(cfg, "1KiB").rows]  # nothing fits: every rung listed
    sp_row = next((p for p in policies if "+sp:2" in p), None)
    assert sp_row is not None, policies  # not offered for packed rows before
    heaviest = policies[policies.index(sp_row) - 1]
    one = estimate_memory(cfg, heaviest, batch_size=1, seq_len=SEQ, world_size=2, packed=True, device="cpu")
    two = estimate_memory(cfg, sp_row, batch_size=1, seq_len=SEQ, world_size=2, packed=True, device="cpu")
    plan = _plan(cfg, (one.peak_bytes + two.peak_bytes) // 2)
    assert plan.fits and plan.policy.sequence_parallel.size == 2, plan.table()
    assert plan.estimate.sequence_parallel == 2 and plan.estimate.peak_bytes <= plan.usable_bytes
    assert any("packed rows traced as" in n for n in plan.estimate.notes), plan.estimate.notes
