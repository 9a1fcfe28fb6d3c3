"""The planner reads a ckpt:N rung between its neighbours instead of tracing it (a ckpt:N trace
holds 3N blocks) only where it cannot fit: every rung it skipped, traced, is over the budget, and
the reading is close to the trace."""

from __future__ import annotations

import pytest
from tiny import llama_config

from hf_memstack import MemoryPolicy, estimate_memory, plan_policy
from hf_memstack.planning.plan import estimates as plan_estimates
from hf_memstack.planning.plan import walk as plan_walk
from hf_memstack.transforms.precision.apply import resolve_precision


def test_the_ckpt_n_rungs_it_reads_between_its_neighbours_do_not_fit():
    config = llama_config(intermediate_size=256, num_hidden_layers=8, vocab_size=256, max_position_embeddings=2048)
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
        if row.below:  # read with the states in place of full checkpointing's peak: a lower bound
            assert traced >= row.peak_bytes, (row, traced)
        else:
            assert abs(row.peak_bytes / traced - 1) < 0.10, (row, traced)
    assert "(interpolated" in plan.table()


def test_a_search_screens_ckpt_n_by_its_states_without_tracing_full_checkpointing(monkeypatch):
    """Where the states' floor already rules a ckpt:N rung out, nothing is traced for it, and where
    it does not, the search traces the ckpt:N rung itself, not full checkpointing to read it by
    (Qwen2-1.5B at 16 GiB: a third trace where two answered)."""
    config = llama_config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        vocab_size=32768,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    job = {"batch_size": 1, "seq_len": 1024}
    pure = "bf16+loss:chunked+weights:bf16"
    plain = estimate_memory(config, pure, device="cuda", **job)
    ckpt4 = estimate_memory(config, "bf16+ckpt:4+loss:chunked+weights:bf16", device="cuda", **job)
    budget = int((ckpt4.peak_bytes + plain.peak_bytes) / 2 / 0.9)  # ckpt:4 fits, the plain rung does not
    assert ckpt4.peak_bytes < budget * 0.9 < plain.peak_bytes
    traces: list[str] = []  # every policy the plan traced, in order (the real estimator, called through)

    def traced_estimate(config, policy, **kwargs):
        traces.append(MemoryPolicy.coerce(policy).to_string())
        return estimate_memory(config, policy, **kwargs)

    monkeypatch.setattr(plan_estimates, "estimate_memory", traced_estimate)
    plan = plan_policy(config, budget=budget, device="cuda", trainable="all", **job)
    assert plan.fits and plan.policy.to_string() == "bf16+ckpt:4+loss:chunked+weights:bf16", plan.table()
    # The walk reaches pure bf16 at its heaviest rung; the search then traces the plain rung with it
    # (over) and ckpt:4 (fits), and never full checkpointing with pure bf16 to read ckpt:4 by.
    searched = [t for t in traces if "weights:bf16" in t]
    assert searched == [
        "bf16+ckpt+loss:chunked+mlp:tiled+weights:bf16",
        "bf16+loss:chunked+weights:bf16",
        "bf16+ckpt:4+loss:chunked+weights:bf16",
    ], (traces, plan.table())
    assert plan.estimate.peak_bytes == ckpt4.peak_bytes


def test_the_plain_rung_is_bounded_by_the_chunked_one_only_where_that_is_over_the_budget():
    config = llama_config(vocab_size=4096, dtype="bfloat16")
    job = {"batch_size": 2, "seq_len": 128}
    chunked = estimate_memory(config, "bf16+loss:chunked", **job).peak_bytes
    plain = estimate_memory(config, "bf16", **job).peak_bytes
    # Over budget: the plain rung reads the chunked one's peak, a lower bound of its own (traced here).
    plan = plan_policy(config, budget=int(chunked * 0.95), device="cuda", **job)
    first = plan.rows[0]
    assert (first.policy, first.traced, first.bound_by, first.peak_bytes) == (
        "bf16",
        False,
        "bf16+loss:chunked",
        chunked,
    )
    assert plain >= first.peak_bytes and not first.fits and "(as bf16+loss:chunked)" in plan.table()
    # Under budget: the plain rung is traced, as before.
    plan = plan_policy(config, budget=int(plain / 0.9 * 1.01), device="cuda", **job)
    assert plan.rows[0].traced and plan.rows[0].peak_bytes == plain and plan.policy.to_string() == "bf16"


def test_a_full_fine_tune_whose_fp32_master_weights_do_not_fit_gets_pure_bf16():
    # Big enough that BF16AdamW's chunk buffers (5 x 4 MiB at most) are small beside the model states.
    config = llama_config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=8192, dtype="bfloat16"
    )
    job = {"batch_size": 1, "seq_len": 16}
    master = estimate_memory(config, "bf16+loss:chunked+ckpt", **job)
    pure = estimate_memory(config, "bf16+loss:chunked+ckpt+weights:bf16", **job)
    assert pure.peak_bytes < master.parameters + master.optimizer  # fp32 master weights cannot fit where pure bf16 does
    budget = int((pure.peak_bytes + master.parameters + master.optimizer) / 2 / 0.9)
    plan = plan_policy(config, budget=budget, device="cuda", **job)
    assert plan.fits and plan.policy.master_weights == "bf16", plan.table()
    assert plan.estimate.peak_bytes == pure.peak_bytes  # the pure-bf16 rung was traced, not screened by fp32's floor
    assert any("BF16AdamW" in s for s in plan.suggestions)
    # Stepping in the backward frees gradients, not moments; its rung does not fit, and where it is
    # screened by a floor (not traced), the floor is a lower bound of its trace. Not the floor of the
    # rungs stepped after the backward: on CUDA their foreach step holds a copy of the second moments
    # that the step in the backward never makes (it read 104.9 MB there against 104.0 MB traced).
    in_backward = [r for r in plan.rows if "optim:in_backward" in r.policy and "weights:bf16" not in r.policy]
    assert in_backward and not any(r.fits for r in in_backward), plan.table()
    for row in in_backward:
        traced = estimate_memory(config, row.policy, device="cuda", **job)
        assert traced.peak_bytes >= row.peak_bytes and traced.peak_bytes > budget * 0.9


def test_every_rung_it_bounds_by_a_stronger_one_is_over_the_budget_when_traced():
    config = llama_config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6, vocab_size=4096, dtype="bfloat16"
    )
    job = {"batch_size": 2, "seq_len": 256, "trainable": "lora"}
    full = estimate_memory(config, "bf16+loss:chunked+ckpt", **job).peak_bytes
    budget = int(full / 0.9 * 1.01)  # every block checkpointed just fits
    plan = plan_policy(config, budget=budget, device="cuda", **job)
    bounded = {r.policy: r for r in plan.rows if r.bound_by}
    assert set(bounded) == {"bf16", "bf16+loss:chunked+ckpt:selective"}, plan.table()
    for row in bounded.values():
        traced = estimate_memory(config, row.policy, **job).peak_bytes
        assert traced >= row.peak_bytes > budget * 0.9 and not row.fits


@pytest.mark.filterwarnings("ignore:policy.precision='bf16' on a CPU without:UserWarning")
def test_a_16_bit_full_fine_tune_is_not_planned_in_fp32_on_a_cpu():
    """A trial: on a CPU without native bf16 the plan for a bf16 checkpoint chose an fp32 rung,
    which is plain AdamW over the bf16 weights (updates below bf16's resolution lost)."""
    from hf_memstack import plan_policy

    config = llama_config(vocab_size=256, dtype="bfloat16")
    plan = plan_policy(config, budget="8GiB", seq_len=32, batch_size=1, trainable="all", device="cpu")
    assert plan.rows and not [r.policy for r in plan.rows if r.policy.startswith("fp32")], [r.policy for r in plan.rows]
    assert plan.policy is not None and plan.policy.precision == "bf16"


def test_a_search_that_must_shed_most_activations_traces_slowest_first_and_still_finds_the_fastest_fit(monkeypatch):
    """Where only the 4-bit base fits, and the fastest 4-bit rung traced misses by most of its
    activations, the search traces strong rungs before weak ones: fewer traces than the
    fastest-first order (``DEEP`` infinite, the order before), the same answer, and that answer the
    fastest 4-bit rung whose own estimate fits (each traced here on its own, the reference)."""
    config = llama_config(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=4096,
        dtype="bfloat16",
    )
    job = {"batch_size": 1, "seq_len": 512, "trainable": {"r": 8}}
    sixteen = estimate_memory(config, "bf16+loss:chunked+ckpt", device="cuda", **job)
    budget = int((sixteen.parameters + sixteen.optimizer) * 0.97 / 0.9)  # the 16-bit weights alone do not fit
    usable = int(budget * 0.9)
    traces: list[str] = []
    # Each (policy, arguments) traced once for both searches (an estimate is a frozen value of its
    # arguments): the second search counts what it asks for, and pays only for what the first did not.
    done: dict[tuple[str, str], object] = {}

    def traced_estimate(config, policy, **kwargs):
        traces.append(MemoryPolicy.coerce(policy).to_string())
        key = (traces[-1], repr(sorted(kwargs.items())))
        if key not in done:
            done[key] = estimate_memory(config, policy, **kwargs)
        return done[key]

    monkeypatch.setattr(plan_estimates, "estimate_memory", traced_estimate)
    plans, searched = {}, {}
    for deep in (plan_walk.DEEP, float("inf")):
        monkeypatch.setattr(plan_walk, "DEEP", deep)
        traces.clear()
        plans[deep] = plan_policy(config, budget=budget, device="cuda", **job)
        searched[deep] = [t for t in traces if "quant:nf4" in t]
    monkeypatch.undo()
    plan, ordered = plans[plan_walk.DEEP], plans[float("inf")]
    assert plan.fits and plan.policy.quant.mode == "nf4", plan.table()
    assert len(searched[plan_walk.DEEP]) < len(searched[float("inf")]), searched
    assert plan.policy == ordered.policy and plan.estimate == ordered.estimate
    rows = [r for r in ordered.rows if MemoryPolicy.coerce(r.policy).quant.mode == "nf4"]
    direct = {r.policy: estimate_memory(config, r.policy, device="cuda", **job).peak_bytes for r in rows}
    fastest = max((r for r in rows if direct[r.policy] <= usable), key=lambda r: r.relative_speed)
    assert plan.policy == MemoryPolicy.coerce(fastest.policy), plan.table()
    assert plan.estimate.peak_bytes == direct[fastest.policy]
