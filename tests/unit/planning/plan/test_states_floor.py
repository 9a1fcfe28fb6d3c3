"""The planner's floor of a rung's model states, counted from the parameters without a trace: never
above what the estimator's trace holds in weights and optimizer state (so a rung it skips could not
have fit), and the traced weights and their moments exactly where nothing is left out; and a plan whose full-precision states cannot fit
goes straight to the state-saving rungs, choosing what the estimator, run on every candidate
independently, says is the fastest that fits."""

from __future__ import annotations

import pytest
import torch
from tiny import SHAPE, VOCAB, configs, llama_config
from transformers import Qwen2Config

from hf_memstack import MemoryPolicy, estimate_memory, plan_policy
from hf_memstack.planning.plan.rungs import memory_rungs, savings_speed
from hf_memstack.planning.plan.states_floor import states_floor


def _gpt2(dtype):
    cfg = configs()["gpt2"]
    cfg.dtype = dtype
    return cfg


CONFIGS = {
    "llama": lambda dtype: llama_config(dtype=dtype),
    "gpt2": _gpt2,
    # Tied embeddings: one parameter, counted once.
    "qwen2-tied": lambda dtype: Qwen2Config(
        **SHAPE, num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True, dtype=dtype
    ),
}
JOB = {"batch_size": 1, "seq_len": 16}


def _floor(cfg, policy: str, dtype: torch.dtype, trains_all: bool = True) -> int | None:
    return states_floor(cfg, MemoryPolicy.coerce(policy), task="causal-lm", dtype=dtype, trains_all=trains_all)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["bf16", "fp32", "bf16+weights:bf16", "bf16+ckpt+optim:in_backward"])
def test_the_counted_floor_is_the_traced_weights_and_moments(arch, dtype, policy):
    if policy == "bf16+weights:bf16" and dtype == torch.float32:
        pytest.skip("pure bf16 over fp32 weights casts them: covered by the bf16 load")
    cfg = CONFIGS[arch](dtype)
    e = estimate_memory(cfg, policy, **JOB, dtype=dtype)
    # The traced weights (and buffers) and AdamW's two moments of each weight in its dtype, never above
    # what the trace's optimizer field holds (the moments and, at these tiny sizes, the step's scratch).
    buffers = sum(b.numel() * b.element_size() for b in _meta_model(cfg).buffers())
    assert _floor(cfg, policy, dtype) == e.parameters + 2 * (e.parameters - buffers) <= e.parameters + e.optimizer


@pytest.mark.parametrize("policy", ["bf16+optim:8bit", "bf16+weights:bf16+optim:8bit"])
def test_eight_bit_moments_are_counted_below_what_they_hold(policy):
    pytest.importorskip("torchao")
    cfg = llama_config(dtype="bfloat16")
    e = estimate_memory(cfg, policy, **JOB)
    floor = _floor(cfg, policy, torch.bfloat16)
    assert floor is not None and e.parameters <= floor <= e.parameters + e.optimizer


def test_a_lora_run_counts_its_frozen_base_alone():
    cfg = llama_config(dtype="bfloat16")
    e = estimate_memory(cfg, "bf16+ckpt", **JOB, trainable={"r": 8})
    floor = _floor(cfg, "bf16+ckpt", torch.bfloat16, trains_all=False)
    meta = _meta_model(cfg)
    base = sum(p.numel() for p in meta.parameters()) * 2 + sum(b.numel() * b.element_size() for b in meta.buffers())
    assert floor == base < e.parameters + e.optimizer


def test_four_bit_base_weights_have_no_floor():
    assert _floor(llama_config(dtype="bfloat16"), "bf16+ckpt+quant:nf4", torch.bfloat16, trains_all=False) is None


def _meta_model(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def test_a_plan_whose_full_precision_states_cannot_fit_searches_the_saving_rungs_at_once():
    # AdamW's fp32 moments and master weights alone over the budget, as on a 1.5B full fine-tune at
    # 16 GiB; with pure bf16 the activations decide which rung fits.
    cfg = llama_config(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        vocab_size=4096,
        max_position_embeddings=1024,
        dtype="bfloat16",
    )
    job = {"batch_size": 2, "seq_len": 512}
    fp32_states = _floor(cfg, "bf16", torch.bfloat16)
    assert fp32_states is not None
    usable = fp32_states * 0.965
    plan = plan_policy(cfg, budget=int(usable / 0.9) + 1, seq_len=512, batch_size=2, device="cuda")

    # Every rung with fp32 states is a row, none traced.
    fp32_rows = [r for r in plan.rows if MemoryPolicy.coerce(r.policy).master_weights == "fp32"]
    assert fp32_rows and not any(r.traced for r in fp32_rows)
    # The reference: every activation rung with pure bf16, each estimated on its own.
    fitting, missing = {}, []
    for rung in memory_rungs("bf16", num_blocks=6, causal_lm=True, tiled_mlp=True, pure_bf16=True):
        p = MemoryPolicy.coerce(rung.policy)
        if p.master_weights == "bf16" or p.optimizer.step != "after_backward" or p.checkpointing.mode == "offload":
            continue
        merged = MemoryPolicy.from_dict({**p.to_dict(), "master_weights": "bf16"})
        peak = estimate_memory(cfg, merged, **job).peak_bytes
        (
            fitting.__setitem__(merged.to_string(), rung.relative_speed * savings_speed(merged))
            if peak <= usable
            else missing.append(merged)
        )
    assert plan.fits and fitting and missing  # the choice is a real one: some rungs miss
    assert fitting.get(plan.policy.to_string()) == max(fitting.values())
    # Fewer traces than candidates: the faster misses rule out what saves no more than them.
    assert sum(r.traced for r in plan.rows) < len(fitting) + len(missing)
