"""The 4-bit base weights rung: the planner offers it to LoRA runs only, after every activation
rung and before the optimizer and FSDP rungs, keeps it on every rung after it, and picks it when it
is the first that fits; the finder names it when a LoRA model's weights alone exceed the budget."""

from __future__ import annotations

import pytest
import torch
from tiny import batches

from hf_memstack import BudgetTooSmallError, MemoryPolicy, estimate_memory, find_batch_size, plan_policy, prepare_model

pytest.importorskip("torchao")
pytest.importorskip("peft")

LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}


def test_the_planner_picks_4bit_base_weights_for_lora_when_checkpointing_is_not_enough(pretrained_dirs):
    ckpt = estimate_memory(pretrained_dirs["llama"], "bf16+ckpt+loss:chunked", batch_size=1, seq_len=16, trainable=LORA)
    quant = estimate_memory(
        pretrained_dirs["llama"], "bf16+ckpt+loss:chunked+quant:nf4", batch_size=1, seq_len=16, trainable=LORA
    )
    assert quant.peak_bytes < ckpt.peak_bytes
    budget = int((ckpt.peak_bytes + quant.peak_bytes) / 2 / 0.9)
    plan = plan_policy(pretrained_dirs["llama"], budget=budget, seq_len=16, batch_size=1, device="cpu", trainable=LORA)
    names = [r.policy for r in plan.rows]
    first = next(i for i, n in enumerate(names) if "quant" in n)
    assert plan.fits and plan.policy.quant.mode == "nf4" and names[first].endswith("+ckpt+quant:nf4"), plan.table()
    assert (
        names[first - 1].endswith("+ckpt") and plan.rows[first].fits
    )  # the walk reaches it after every activation rung
    # Then the faster activation rungs are tried with the 4-bit weights: the choice is at least as fast, and fits.
    chosen = next(r for r in plan.rows if MemoryPolicy.coerce(r.policy) == plan.policy)
    assert chosen.fits and chosen.relative_speed >= plan.rows[first].relative_speed, plan.table()
    assert any("merge_adapters" in s for s in plan.suggestions)


def test_the_rung_comes_after_full_checkpointing_and_later_rungs_keep_it():
    from hf_memstack.planning.plan.rungs import memory_rungs

    names = [r.policy for r in memory_rungs("bf16", num_blocks=4, world_size=2, causal_lm=True, quantize=True)]
    first = next(i for i, n in enumerate(names) if "quant:nf4" in n)
    assert names[first] == "bf16+loss:chunked+ckpt+quant:nf4" and names[first - 1] == "bf16+loss:chunked+ckpt", names
    assert all("quant:nf4" in n for n in names[first:]), names
    assert any("optim:" in n for n in names[first + 1 :]) and names[-1].endswith(
        "+fsdp:offload"
    )  # before optimizer and FSDP rungs
    assert not any("quant" in r.policy for r in memory_rungs("bf16", num_blocks=4, world_size=2, causal_lm=True))


def test_the_finder_names_4bit_weights_when_a_lora_models_weights_do_not_fit(load_model):
    from peft import LoraConfig, get_peft_model

    model = prepare_model(get_peft_model(load_model("llama"), LoraConfig(**LORA)), "bf16+ckpt")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(
        BudgetTooSmallError,
        match=r"parameters alone.*Next rung of the ladder: 'bf16\+ckpt\+quant:nf4' "
        r"\(the frozen linear weights in 4 bits\)",
    ):
        find_batch_size(model, batches(), optimizer, budget=params // 2, cache=False)


def test_planning_for_a_gpu_on_a_machine_without_one_plans_bf16(pretrained_dirs):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: 'cuda' is resolved from it")
    plan = plan_policy(pretrained_dirs["llama"], budget="8GiB", seq_len=16, batch_size=1, device="cuda", trainable=LORA)
    assert plan.fits and plan.policy.to_string() == "bf16", plan.table()


def test_rungs_that_only_save_activations_are_not_traced_once_the_weights_alone_exceed_the_budget(tmp_path):
    from transformers import LlamaConfig

    # Weights that dominate: 4-bit weights fit where no activation rung over the 32-bit base can.
    LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ).save_pretrained(tmp_path)
    first = estimate_memory(tmp_path, "bf16", batch_size=1, seq_len=16, trainable=LORA)
    quant = estimate_memory(tmp_path, "bf16+ckpt+loss:chunked+quant:nf4", batch_size=1, seq_len=16, trainable=LORA)
    floor = first.parameters + first.optimizer
    assert quant.peak_bytes < floor
    plan = plan_policy(
        tmp_path,
        budget=int((quant.peak_bytes + floor) / 2 / 0.9),
        seq_len=16,
        batch_size=1,
        device="cpu",
        trainable=LORA,
    )
    rows = plan.rows
    fit = next(i for i, r in enumerate(rows) if r.fits)
    assert plan.fits and plan.policy.quant.mode == "nf4" and rows[fit].traced, plan.table()
    # No rung over the 32-bit base is traced: its weights, counted from the parameters, are over the
    # budget alone - a floor no higher than the traced one.
    usable = plan.budget * 0.9
    base = [r for r in rows if MemoryPolicy.coerce(r.policy).quant.mode == "none"]
    assert base and all(not r.traced and not r.fits and usable < r.peak_bytes <= floor for r in base), plan.table()
    assert ">= " in plan.table() and "(weights + optimizer state)" in plan.table()
    skipped = estimate_memory(tmp_path, base[-1].policy, batch_size=1, seq_len=16, trainable=LORA)
    assert skipped.peak_bytes >= base[-1].peak_bytes  # the floor is a floor


def test_the_rung_is_not_offered_where_prepare_model_refuses_4bit_weights():
    # GPT-2's projections are Conv1D, which torchao's 4-bit weights (F.linear) cannot replace: a LoRA
    # plan short of memory once stopped on that refusal instead of answering without the rung.
    from transformers import GPT2Config

    config = GPT2Config(n_embd=64, n_layer=8, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match="not nn.Linear"):
        estimate_memory(config, "bf16+ckpt+quant:nf4", batch_size=1, seq_len=32, trainable="lora")
    plan = plan_policy(config, budget="1MiB", seq_len=32, trainable="lora")
    assert not plan.fits and plan.rows
    assert not any("quant" in row.policy for row in plan.rows), plan.table()
