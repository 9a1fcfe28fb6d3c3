"""The estimator builds the depth plan and the meta model once per config and job (the planner's
rungs and batch sizes share them): the plan and every estimate equal those built afresh, and an
entry is never reused for another config, dtype, PEFT config or sequence length."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

import hf_memstack.planning.estimate.build_cache as build_cache
import hf_memstack.planning.estimate.trace as estimate_trace
from hf_memstack import estimate_memory, plan_policy
from hf_memstack.transforms.precision.apply import resolve_precision


def _config(**overrides) -> LlamaConfig:
    fields = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    } | overrides
    return LlamaConfig(**fields)


def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every build done anew, as before the cache."""
    monkeypatch.setattr(build_cache, "cached", lambda cache, key, build: build())


def _rows(plan) -> list[tuple]:
    return [(r.policy, r.peak_bytes, r.fits, r.max_batch_size, r.traced, r.interpolated) for r in plan.rows]


@pytest.mark.slow
def test_the_plan_with_cached_builds_equals_the_plan_built_afresh(monkeypatch):
    config = _config()
    precision = resolve_precision("auto", "cpu").name
    job = {"batch_size": 2, "seq_len": 64, "trainable": {"r": 4}}
    # A budget where the walk goes past the first rungs (every block checkpointed just fits).
    budget = int(estimate_memory(config, f"{precision}+loss:chunked+ckpt", **job).peak_bytes / 0.9 * 1.01)
    build_cache.clear()
    cached = plan_policy(config, budget=budget, device="cpu", **job)
    _fresh(monkeypatch)
    fresh = plan_policy(config, budget=budget, device="cpu", **job)
    assert len(cached.rows) > 2 and cached.fits, cached.table()
    assert _rows(cached) == _rows(fresh), (cached.table(), fresh.table())
    assert (cached.policy, cached.batch_size) == (fresh.policy, fresh.batch_size)
    assert dataclasses.asdict(cached.estimate) == dataclasses.asdict(fresh.estimate)


@pytest.mark.slow
def test_a_cached_build_is_never_reused_for_another_config_dtype_trainable_or_seq_len(monkeypatch):
    # Each differs from the first in one thing the builds depend on (or, seq_len, in one they do not).
    lora = {"r": 4}
    jobs = [
        (_config(), "bf16+ckpt", {"trainable": lora, "dtype": "bf16", "seq_len": 32}),
        (
            _config(),
            "bf16+ckpt:2",
            {"trainable": lora, "dtype": "bf16", "seq_len": 32},
        ),  # another depth plan (period 2)
        (_config(intermediate_size=192), "bf16+ckpt", {"trainable": lora, "dtype": "bf16", "seq_len": 32}),
        (_config(num_hidden_layers=10), "bf16+ckpt", {"trainable": lora, "dtype": "bf16", "seq_len": 32}),
        (_config(), "bf16+ckpt", {"trainable": lora, "dtype": "fp32", "seq_len": 32}),
        (_config(), "bf16+ckpt", {"trainable": {"r": 8}, "dtype": "bf16", "seq_len": 32}),
        (_config(), "bf16+ckpt", {"trainable": {"r": 4, "target_modules": ["q_proj"]}, "dtype": "bf16", "seq_len": 32}),
        (_config(), "bf16+ckpt", {"trainable": "all", "dtype": "bf16", "seq_len": 32}),
        (_config(), "bf16+ckpt", {"trainable": lora, "dtype": "bf16", "seq_len": 16}),
    ]
    build_cache.clear()
    warm = [dataclasses.asdict(estimate_memory(c, p, batch_size=1, **j)) for c, p, j in jobs]
    _fresh(monkeypatch)
    fresh = [dataclasses.asdict(estimate_memory(c, p, batch_size=1, **j)) for c, p, j in jobs]
    for job, w, f in zip(jobs, warm, fresh, strict=True):
        assert w == f, job
    # The jobs do differ where it shows: otherwise the comparison above could not catch a stale entry.
    assert len({(e["trainable_parameters"], e["total_parameters"], e["peak_bytes"]) for e in fresh}) == len(fresh)


def test_the_rungs_and_batches_of_one_model_share_one_depth_plan(monkeypatch):
    calls = []
    real = estimate_trace.plan_depths
    monkeypatch.setattr(estimate_trace, "plan_depths", lambda *a, **k: calls.append(1) or real(*a, **k))
    build_cache.clear()
    config = _config()
    for policy, batch in (("bf16", 1), ("bf16+loss:chunked", 1), ("bf16+ckpt", 2)):
        e = estimate_memory(config, policy, batch_size=batch, seq_len=32, trainable={"r": 4})
        assert any("traced with" in n for n in e.notes), e.notes  # extrapolated: the depth plan was used
    assert len(calls) == 1
    estimate_memory(config, "bf16+ckpt:2", batch_size=1, seq_len=32, trainable={"r": 4})  # another period: its own plan
    assert len(calls) == 2


def test_the_key_sees_the_attention_implementation_a_config_was_given():
    # to_json_string leaves attn_implementation out: an eager config once got the SDPA build cached before it.
    from transformers import LlamaConfig

    from hf_memstack.planning.estimate.build_cache import config_key

    assert config_key(LlamaConfig(attn_implementation="eager")) != config_key(LlamaConfig(attn_implementation="sdpa"))
    assert config_key(LlamaConfig(attn_implementation="eager")) == config_key(LlamaConfig(attn_implementation="eager"))
