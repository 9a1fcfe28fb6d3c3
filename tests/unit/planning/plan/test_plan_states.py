"""The planner's answer when a model-state saving (pure bf16, the optimizer rungs, 4-bit base weights)
is what makes a rung fit: the ladder reaches those after its heaviest activation rung, but with the
states smaller a lighter, faster activation rung may fit too. The plan picks that one; the reference
is the estimator itself, run on each policy independently of the plan."""

from __future__ import annotations

from tiny import llama_config

from hf_memstack import MemoryPolicy, estimate_memory, plan_policy
from hf_memstack.planning.plan.rungs import MEASURED_SPEED


def _config():
    return llama_config(hidden_size=256, intermediate_size=688, num_hidden_layers=4, vocab_size=4096, dtype="bfloat16")


def test_a_state_saving_is_combined_with_the_lightest_activation_rung_that_fits():
    cfg = _config()
    job = {"batch_size": 2, "seq_len": 256}
    light = estimate_memory(cfg, "bf16+loss:chunked+weights:bf16", **job).peak_bytes
    heavy = estimate_memory(cfg, "bf16+loss:chunked+ckpt+optim:in_backward", **job).peak_bytes
    assert light < heavy  # pure bf16's 8 bytes a parameter save more than every activation rung here
    budget = int((light + heavy) / 2 / 0.9)  # usable: between the two
    plan = plan_policy(cfg, budget=budget, seq_len=256, batch_size=2, device="cuda")

    assert plan.fits and plan.policy.master_weights == "bf16"
    assert plan.policy.checkpointing.mode == "none"  # no checkpointing: the fastest way it fits
    # The ladder's own first fit (every block checkpointed, tiled, pure bf16) is in the table, slower.
    walked = next(r for r in plan.rows if r.fits)
    chosen = next(r for r in plan.rows if MemoryPolicy.coerce(r.policy) == plan.policy)
    assert MemoryPolicy.coerce(walked.policy).checkpointing.mode == "full"
    assert chosen.relative_speed > walked.relative_speed
    assert (
        chosen.relative_speed == MEASURED_SPEED["bf16"] * MEASURED_SPEED["loss_chunked"] * MEASURED_SPEED["pure_bf16"]
    )
    # And it fits by the estimator's own account.
    assert estimate_memory(cfg, plan.policy, **job).peak_bytes <= budget * 0.9


def test_without_a_state_saving_the_walk_is_unchanged():
    # A budget every activation rung but full checkpointing misses, with no state saving needed:
    # the ladder's first fit stands, and no candidate row is added after it.
    cfg = _config()
    job = {"batch_size": 2, "seq_len": 256}
    full = estimate_memory(cfg, "bf16+loss:chunked+ckpt", **job).peak_bytes
    plan = plan_policy(cfg, budget=int(full / 0.9) + 1, seq_len=256, batch_size=2, device="cuda")
    assert plan.fits and plan.rows[-1].fits and MemoryPolicy.coerce(plan.rows[-1].policy) == plan.policy
    assert plan.policy.master_weights == "fp32" and plan.policy.optimizer.state == "fp32"


def test_on_several_devices_plain_sharding_is_chosen_over_offloading_when_it_fits():
    # Found by a new-user trial: a 7B full fine-tune on 4 devices chose fsdp:offload (0.28x) while
    # plain FSDP fit, because the walk's candidates dropped the sharding and a miss without it
    # ruled out the FSDP rung of the same checkpointing. Here the same shape in small: every
    # unsharded rung's weights and moments are over the budget, sharded ones fit.
    cfg = _config()
    job = {"batch_size": 2, "seq_len": 256, "world_size": 4}
    unsharded = estimate_memory(cfg, "bf16+loss:chunked+ckpt+optim:8bit+weights:bf16", **job)
    sharded = estimate_memory(cfg, "bf16+fsdp+loss:chunked+weights:bf16", **job)
    budget = int((unsharded.parameters + unsharded.optimizer + sharded.peak_bytes) / 2 / 0.9)
    assert sharded.peak_bytes < budget * 0.9 < unsharded.parameters + unsharded.optimizer
    plan = plan_policy(cfg, budget=budget, seq_len=256, batch_size=2, world_size=4, device="cuda")

    assert plan.fits and plan.policy.fsdp.mode == "full_shard" and not plan.policy.fsdp.cpu_offload
    policies = [r.policy for r in plan.rows]
    assert len(policies) == len(set(policies))  # no candidate traced twice
    assert estimate_memory(cfg, plan.policy, **job).peak_bytes <= budget * 0.9
