"""The memory rungs are the table STEPS read against the facts a RungContext states: each rung is a
row whose requirements hold, written with the token table's spellings, in the ladder's order,
keeping the savings of the rows kept before it; memory_rungs' keywords are those facts."""

from __future__ import annotations

import functools
import itertools

import pytest

from hf_memstack import MemoryPolicy
from hf_memstack.planning.plan.next_rung import next_rung
from hf_memstack.planning.plan.rungs import (
    MEASURED_SPEED,
    STEPS,
    Requirement,
    RungContext,
    memory_rungs,
    rungs_for,
)
from hf_memstack.policy import tokens

R = Requirement
STATED = (
    R.CAUSAL_LM,
    R.TORCHAO,
    R.LORA_WITH_TORCHAO,
    R.STEP_IN_BACKWARD,
    R.TOKENS_OVER_ONE_TILE,
    R.FULL_FINETUNE,
    R.SEVERAL_DEVICES,
)
CONTEXTS = [
    RungContext(precision, blocks, frozenset(r for r, on in zip(STATED, flags, strict=True) if on))
    for precision, blocks, flags in itertools.product(
        ("fp32", "bf16", "fp16"), (1, 3, 4, 5), itertools.product((False, True), repeat=len(STATED))
    )
]
BY_NAME = {s.name: s for s in STEPS}
# Parsed once per string (the tests only read them): the same rungs recur across contexts.
_parsed = functools.lru_cache(maxsize=None)(MemoryPolicy.from_string)


def _stage(policy: MemoryPolicy) -> int:
    """0 the precision alone, 1 activation rungs, 2 the 4-bit and optimizer rungs, 3 offload, 4 FSDP."""
    if policy.fsdp.mode != "none":
        return 4
    if policy.checkpointing.mode == "offload":
        return 3
    if policy.quant.mode != "none" or policy.optimizer != MemoryPolicy().optimizer or policy.master_weights != "fp32":
        return 2
    return int(policy != MemoryPolicy(precision=policy.precision))


def test_the_table_names_only_token_spellings_speed_keys_and_earlier_rows():
    spellings = {t.spelling for t in tokens.TOKENS}
    for i, step in enumerate(STEPS):
        for token in step.tokens:
            assert token in spellings or f"{token.partition(':')[0]}:N" in spellings, token
            assert tokens.parse(f"bf16+{token}")[1] == [], token
        assert all(key in MEASURED_SPEED for key in step.speed), step
        assert set(step.carries) <= {s.name for s in STEPS[:i]}, step
    assert len(BY_NAME) == len(STEPS)


def test_a_rung_is_offered_exactly_when_its_requirements_hold():
    for context in CONTEXTS:
        facts = context.facts()
        rungs = rungs_for(context)
        assert [r.step for r in rungs] == [s.name for s in STEPS if s.requires <= facts], context
        assert all(r.requires == BY_NAME[r.step].requires for r in rungs)


@pytest.mark.parametrize("fact", STATED, ids=lambda r: r.value)
def test_stating_one_more_fact_adds_the_rungs_that_need_it_and_no_others(fact):
    for context in CONTEXTS:
        if fact in context.satisfied:
            continue
        without = {r.step for r in rungs_for(context)}
        more = RungContext(context.precision, context.num_blocks, context.satisfied | {fact})
        added = {r.step for r in rungs_for(more)} - without
        assert added == {s.name for s in STEPS if fact in s.requires and s.requires <= more.facts()}, more
        assert without <= {r.step for r in rungs_for(more)}


def test_the_facts_the_precision_and_depth_give_are_worked_out_not_taken():
    stated = frozenset({R.NOT_FP16, R.BF16, R.MORE_THAN_4_BLOCKS, R.STEP_IN_BACKWARD})
    assert RungContext("fp16", 2, stated).facts() == {R.STEP_IN_BACKWARD}
    assert RungContext("bf16", 5, frozenset()).facts() == {
        R.NOT_FP16,
        R.BF16,
        R.MORE_THAN_2_BLOCKS,
        R.MORE_THAN_3_BLOCKS,
        R.MORE_THAN_4_BLOCKS,
    }
    assert RungContext("fp32", 3, frozenset()).facts() == {R.NOT_FP16, R.MORE_THAN_2_BLOCKS}


def test_every_rung_parses_round_trips_and_is_written_once_per_token():
    seen = {r.policy for c in CONTEXTS for r in rungs_for(c)}
    for policy in seen:
        parsed = _parsed(policy)
        assert _parsed(parsed.to_string()) == parsed, policy
        written = policy.split("+")
        assert written[0] == parsed.precision and len(set(written)) == len(written), policy


def test_rungs_come_in_the_ladder_order():
    for context in CONTEXTS:
        rungs = rungs_for(context)
        policies = [_parsed(r.policy) for r in rungs]
        # Activation rungs first (they change no arithmetic), then 4-bit and optimizer, offload, FSDP.
        stages = [_stage(p) for p in policies]
        assert stages == sorted(stages) and stages[0] == 0, (context, [r.policy for r in rungs])
        every_n = [p.checkpointing.every_n for p in policies if p.checkpointing.mode == "every_n"]
        assert every_n == sorted(every_n, reverse=True)  # the fewest blocks checkpointed first
        assert len({r.policy for r in rungs}) == len(rungs)
        # No rung after full checkpointing is faster than it; the tiles are slower than every rung before.
        full = next(i for i, r in enumerate(rungs) if r.step == "full")
        assert all(r.relative_speed <= rungs[full].relative_speed for r in rungs[full:])
        for i, r in enumerate(rungs):
            if r.step == "tiled_mlp":
                assert all(q.relative_speed > r.relative_speed for q in rungs[:i])


def test_later_rungs_keep_the_savings_of_the_rows_kept_before_them():
    for context in CONTEXTS:
        rungs = rungs_for(context)
        for i, r in enumerate(rungs):
            for later in (_parsed(q.policy) for q in rungs[i + 1 :]):
                if r.step == "chunked_loss":
                    assert later.loss.mode == "chunked"
                if r.step == "full":  # or offloaded, which checkpoints every block too
                    assert later.checkpointing.mode in ("full", "offload")
                if r.step == "tiled_mlp":
                    assert later.mlp.mode == "tiled"
                if r.step == "nf4":
                    assert later.quant.mode == "nf4"
                if r.step == "pure_bf16":
                    assert later.master_weights == "bf16"
        kept = [s for s in STEPS if s.kept]
        assert {s.name for s in kept} >= {"chunked_loss", "full", "tiled_mlp", "nf4", "pure_bf16"}


def test_offloading_keeps_the_optimizer_rungs_offered_and_fsdp_does_not():
    for context in CONTEXTS:
        rungs = {r.step: _parsed(r.policy) for r in rungs_for(context)}
        facts = context.facts()
        offload = rungs["offload"].optimizer
        assert (offload.state == "8bit") == (R.TORCHAO in facts)
        assert (offload.step == "in_backward") == ({R.STEP_IN_BACKWARD, R.NOT_FP16} <= facts)
        for name in ("fsdp", "fsdp_offload"):
            if name in rungs:
                assert rungs[name].optimizer == MemoryPolicy().optimizer


def test_fp16_has_no_in_backward_rung_and_only_bf16_trains_pure_bf16():
    for context in CONTEXTS:
        policies = [_parsed(r.policy) for r in rungs_for(context)]
        if context.precision == "fp16":
            assert all(p.optimizer.step != "in_backward" for p in policies)
        pure = any(p.master_weights == "bf16" for p in policies)
        assert pure == (context.precision == "bf16" and R.FULL_FINETUNE in context.satisfied)


def test_memory_rungs_keywords_are_the_stated_facts():
    keywords = {
        "causal_lm": R.CAUSAL_LM,
        "eightbit": R.TORCHAO,
        "quantize": R.LORA_WITH_TORCHAO,
        "step_in_backward": R.STEP_IN_BACKWARD,
        "tiled_mlp": R.TOKENS_OVER_ONE_TILE,
        "pure_bf16": R.FULL_FINETUNE,
    }
    assert set(keywords.values()) | {R.SEVERAL_DEVICES} == set(STATED)  # every stated fact has its keyword
    for context in CONTEXTS[:: len(CONTEXTS) // 97]:
        flags = {k: r in context.satisfied for k, r in keywords.items()}
        world = 2 if R.SEVERAL_DEVICES in context.satisfied else 1
        got = memory_rungs(context.precision, num_blocks=context.num_blocks, world_size=world, **flags)
        assert got == rungs_for(context), context
    # The keywords' defaults: torchao and stepping in the backward assumed, one device.
    assert [r.step for r in memory_rungs("bf16", num_blocks=1)] == [
        "mixed_precision",
        "selective",
        "selective_alternate",
        "full",
        "in_backward",
        "8bit",
        "8bit_in_backward",
        "offload",
    ]


def test_next_rung_names_the_first_rung_that_adds_a_saving():
    bf16 = MemoryPolicy.from_string("bf16")
    assert (
        next_rung(bf16, num_blocks=4, causal_lm=True)
        == "Next rung of the ladder: 'bf16+loss:chunked' (no full logits)."
    )
    assert next_rung(MemoryPolicy.from_string("fp16+ckpt+optim:8bit"), num_blocks=4) == (
        "Next rung of the ladder: 'fp16+ckpt:offload+optim:8bit' (less activation memory)."
    )
    assert next_rung(bf16, num_blocks=4, weights_dominate=True, quantize=True) == (
        "Next rung of the ladder: 'bf16+quant:nf4' (the frozen linear weights in 4 bits)."
    )
