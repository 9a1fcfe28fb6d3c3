"""The planner's sequence-parallel rung (sp:N): offered after every activation rung of one device, one
rung per degree N dividing the world size and the heads (smallest first), the rungs after it keeping
the largest; and only where several ranks are given and the activations at the wanted seq do not fit."""

from transformers import LlamaConfig

from hf_memstack import MemoryPolicy, estimate_memory, plan_policy
from hf_memstack.planning.plan.rungs import Requirement, RungContext, rungs_for
from hf_memstack.planning.plan.sequence_rungs import sp_degrees

SEQ = 2048


def _config(heads=4):
    return LlamaConfig(
        hidden_size=16 * heads,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
        vocab_size=128,
        max_position_embeddings=4096,
    )


def _plan(cfg, budget, world, seq=SEQ):
    return plan_policy(cfg, budget=budget, seq_len=seq, world_size=world, device="cpu", margin=0.0)


def test_the_degrees_divide_the_world_size_and_the_heads():
    assert sp_degrees(_config(4), 8) == (2, 4)
    assert sp_degrees(_config(6), 4) == (2,)
    assert sp_degrees(_config(3), 2) == ()
    assert sp_degrees(_config(4), 1) == ()


def test_the_sp_rungs_come_after_the_activation_rungs_and_the_later_rungs_keep_the_largest():
    R = Requirement
    facts = frozenset({R.SEVERAL_DEVICES, R.SEQUENCE_OVER_ONE_DEVICE, R.CAUSAL_LM, R.TORCHAO})
    rungs = rungs_for(RungContext("bf16", 8, facts, sp_degrees=(2, 4)))
    steps = [r.step for r in rungs]
    first = steps.index("sequence_parallel")
    assert steps[first - 1] == "full" and steps[first : first + 2] == ["sequence_parallel"] * 2
    sizes = [MemoryPolicy.from_string(r.policy).sequence_parallel.size for r in rungs]
    assert sizes == [1] * first + [2, 4] + [4] * (len(rungs) - first - 2)
    assert rungs[first].relative_speed > rungs[first + 1].relative_speed  # the smaller degree is faster
    assert steps.index("fsdp") > first + 1
    # Without the fact (short sequences, one device) the ladder is the one it always was.
    assert "sequence_parallel" not in [
        r.step for r in rungs_for(RungContext("bf16", 8, facts - {R.SEQUENCE_OVER_ONE_DEVICE}, sp_degrees=(2, 4)))
    ]


def test_the_planner_shards_the_sequence_when_no_activation_rung_fits():
    cfg = _config()
    rows = _plan(cfg, "1KiB", world=2).rows  # nothing fits: every rung listed
    policies = [r.policy for r in rows]
    sp_row = next(p for p in policies if "+sp:2" in p)
    heaviest = policies[policies.index(sp_row) - 1]
    assert MemoryPolicy.from_string(heaviest).checkpointing.mode == "full", policies
    one = estimate_memory(cfg, heaviest, batch_size=1, seq_len=SEQ, world_size=2, device="cpu")
    two = estimate_memory(cfg, sp_row, batch_size=1, seq_len=SEQ, world_size=2, device="cpu")
    plan = _plan(cfg, (one.peak_bytes + two.peak_bytes) // 2, world=2)
    assert plan.fits and plan.policy.sequence_parallel.size == 2, plan.table()
    assert plan.estimate.sequence_parallel == 2 and plan.estimate.peak_bytes <= plan.usable_bytes
    # Every rung without it was over the budget; a faster one than the sp rung's may carry sp:2.
    assert all(not r.fits for r in plan.rows if "+sp:" not in r.policy), plan.table()


def test_no_sp_rung_on_one_device_for_heads_no_degree_divides_or_when_the_activations_fit():
    cfg = _config()
    assert not any("+sp:" in r.policy for r in _plan(cfg, "1KiB", world=1).rows)
    assert not any("+sp:" in r.policy for r in _plan(_config(heads=3), "1KiB", world=2).rows)
    roomy = _plan(cfg, "8GiB", world=2)
    assert roomy.fits and roomy.policy.sequence_parallel.size == 1


def test_when_the_sequence_needs_more_ranks_the_advice_names_the_wider_degree():
    cfg, seq = _config(), 2 * SEQ
    wide = estimate_memory(cfg, "bf16+ckpt+loss:chunked+mlp:tiled+sp:4", batch_size=1, seq_len=seq, world_size=4)
    # Just over 4 ranks' reading: 2 ranks (sp:2, FSDP, pure bf16...) do not fit it, 4 would.
    plan = _plan(cfg, int(wide.peak_bytes * 1.05), world=2, seq=seq)
    assert not plan.fits, plan.table()
    said = [s for s in plan.suggestions if s.startswith("more ranks: sequence parallelism over 4 devices")]
    assert said and "--world-size 4" in said[0] and "+sp:4" in said[0], plan.suggestions
