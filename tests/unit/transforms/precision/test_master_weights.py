"""policy.master_weights: fp32 master weights for 16-bit checkpoints under mixed precision, and pure
bf16 with stochastic rounding (``weights:bf16``): the policy, prepare_model's casts, make_optimizer,
the Trainer check and the estimate. References: the same checkpoint loaded in fp32, PyTorch's own
AdamW on fp32 copies, and stochastic rounding written out here."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import assert_untouched, snapshot
from transformers import AutoModelForCausalLM

from hf_memstack import MemoryPolicy, PolicyError, estimate_memory, make_optimizer, measure_step, prepare_model
from hf_memstack.integrations.trainer import check_optimizer
from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW, stochastic_round_to_bf16

pytestmark = pytest.mark.filterwarnings("ignore:policy.precision='bf16' on a CPU without:UserWarning")


def _batch():
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------ the policy
def test_the_token_round_trips_and_the_default_is_fp32_master_weights(tmp_path):
    p = MemoryPolicy.from_string("bf16+ckpt+weights:bf16")
    assert p.master_weights == "bf16" and p.to_string() == "bf16+ckpt+weights:bf16"
    assert MemoryPolicy.from_dict(p.to_dict()) == p
    p.to_yaml(tmp_path / "p.yaml")
    assert MemoryPolicy.from_yaml(tmp_path / "p.yaml") == p
    assert MemoryPolicy.from_string("bf16+weights:fp32") == MemoryPolicy.from_string("bf16")
    assert MemoryPolicy().master_weights == "fp32"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "auto"])
def test_pure_bf16_needs_bf16_precision(precision):
    with pytest.raises(PolicyError, match=rf"master_weights='bf16'.*precision='{precision}'.*'bf16\+weights:bf16'"):
        MemoryPolicy.from_string(f"{precision}+weights:bf16")


def test_a_bad_value_names_the_allowed_ones():
    with pytest.raises(PolicyError, match=r"'weights:bf8' is not one of 'weights:fp32', 'weights:bf16'"):
        MemoryPolicy.from_string("bf16+weights:bf8")
    with pytest.raises(PolicyError, match=r"policy.master_weights"):
        MemoryPolicy(precision="bf16", master_weights="fp8")


def test_torch_dtypes_are_taken_for_their_names_as_transformers_dtype_is_written():
    p = MemoryPolicy(precision=torch.bfloat16, master_weights=torch.bfloat16)
    assert (p.precision, p.master_weights) == ("bf16", "bf16") and p == MemoryPolicy.from_string("bf16+weights:bf16")
    p.master_weights = torch.float32  # set on a built policy: the same name, validated
    assert p.master_weights == "fp32" and p.to_string() == "bf16"
    assert MemoryPolicy(precision=torch.float16).precision == "fp16"
    with pytest.raises(PolicyError, match=r"policy.master_weights=torch.int8 is not one of 'fp32', 'bf16'"):
        MemoryPolicy(precision="bf16", master_weights=torch.int8)
    with pytest.raises(PolicyError, match=r"master_weights='bf16'.*precision='fp16'"):
        p.master_weights, p.precision = "fp32", torch.float16
        p.master_weights = torch.bfloat16
    assert p.master_weights == "fp32"  # a refused value is not set


# ------------------------------------------------------------------ prepare_model
def test_mixed_precision_casts_a_bf16_checkpoint_to_fp32_master_weights(bf16_dir):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir).train()  # dtype="auto": comes back bf16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prepare_model(model, "bf16+ckpt")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds
    assert model.memstack.master_weights.cast == len(list(model.parameters()))
    assert "cast from bfloat16 to fp32" in model.memstack.describe()
    # Independent reference: the same checkpoint loaded in fp32 (its values are exactly the bf16 ones).
    reference = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).train(), "bf16+ckpt")
    assert model(**_batch()).loss.item() == reference(**_batch()).loss.item()


def test_lora_adapters_train_fp32_and_the_frozen_base_stays_bf16(bf16_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(bf16_dir),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        autocast_adapter_dtype=False,
    )
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.bfloat16}  # PEFT left them bf16 here
    prepare_model(model, "bf16")
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_pure_bf16_casts_the_trainable_weights_to_bf16(bf16_dir):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).train()
    prepare_model(model, "bf16+weights:bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers are not weights: not cast
    assert "pure bf16" in model.memstack.describe()


# ------------------------------------------------------------------ the optimizer
def test_stochastic_rounding_keeps_an_update_below_bf16_resolution_in_expectation(bf16_dir):
    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir).train(), "bf16+weights:bf16")
    optimizer = make_optimizer(model, lr=0.3 * 2**-8, weight_decay=0.0)
    assert isinstance(optimizer, BF16AdamW)
    # One weight of 2^16 values at 1.0; AdamW's first update is lr * sign(grad): 0.3 of bf16's step below 1.0 (2^-8).
    weight = model.model.embed_tokens.weight
    with torch.no_grad():
        weight.fill_(1.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p is weight else None
    optimizer.step()
    # Reference: PyTorch's AdamW on an fp32 copy, then stochastic rounding as defined: down to the bf16
    # value below with probability 1 - frac, up with probability frac (frac = the distance in bf16 steps).
    exact = torch.nn.Parameter(torch.ones(weight.shape))
    exact.grad = torch.ones_like(exact)
    torch.optim.AdamW([exact], lr=0.3 * 2**-8, weight_decay=0.0).step()
    target = exact.detach()[0, 0].item()
    below = 1.0 - 2**-8
    frac = (1.0 - target) / (1.0 - below)
    values = weight.detach().float()
    assert set(values.unique().tolist()) == {below, 1.0}  # only the two neighbours
    moved = (values == below).float().mean().item()
    sigma = (frac * (1 - frac) / values.numel()) ** 0.5
    assert abs(moved - frac) < 5 * sigma, (moved, frac)
    assert abs(values.mean().item() - target) < 5 * sigma * 2**-8
    # Plain AdamW on the same bf16 weight loses the update entirely: the problem pure bf16 must avoid.
    plain = torch.nn.Parameter(torch.ones(weight.shape, dtype=torch.bfloat16))
    plain.grad = torch.ones_like(plain)
    torch.optim.AdamW([plain], lr=0.3 * 2**-8, weight_decay=0.0).step()
    assert (plain == 1.0).all()


def test_stochastic_rounding_matches_torchaos_in_distribution():
    torchao_sr = pytest.importorskip("torchao.optim.quant_utils")._fp32_to_bf16_sr
    # Values spread over many binades, each 2^12 times: the mean of the rounded copies is the value.
    x = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 10.0 ** torch.arange(-3, 5).repeat(8)).repeat(
        4096, 1
    )
    ours = stochastic_round_to_bf16(x, generator=torch.Generator().manual_seed(1)).float()
    theirs = torchao_sr(x).float()
    # The two bf16 neighbours of each value, from its bits: truncated toward zero, and one bf16 step away from zero.
    truncated = x.view(torch.int32).bitwise_and(-65536)
    low, high = truncated.view(torch.float32), (truncated + 65536).view(torch.float32)
    for rounded in (ours, theirs):
        assert ((rounded == low) | (rounded == high)).all()
    # Per value, the share rounded away from zero is the dropped fraction (within 5 standard errors), for both.
    frac = ((x - low) / (high - low))[0]
    se = (frac * (1 - frac) / 4096).sqrt() + 1e-3
    for rounded in (ours, theirs):
        share = (rounded == high).float().mean(0)
        assert ((share - frac).abs() < 5 * se).all(), (share - frac).abs().max()


def test_the_step_holds_no_full_fp32_copy_of_a_parameter(bf16_dir):
    # torchao's eager step held ~10 fp32 copies of the largest parameter; BF16AdamW works in chunks.
    from hf_memstack.transforms.optim import bf16_adamw

    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir).train(), "bf16+weights:bf16")
    chunk, bf16_adamw._CHUNK = bf16_adamw._CHUNK, 1024
    try:
        real = measure_step(model, _batch(), make_optimizer(model, lr=1e-4), timed=False)
    finally:
        bf16_adamw._CHUNK = chunk
    moments = 2 * 2 * sum(p.numel() for p in model.parameters())
    assert real.optimizer - moments < 6 * 4 * 1024 + 64 * len(list(model.parameters())), (real.optimizer, moments)


def test_the_moments_are_bf16_and_training_lowers_the_loss(bf16_dir):
    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir).train(), "bf16+weights:bf16")
    optimizer = make_optimizer(model, lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(**_batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    state = optimizer.state[model.model.embed_tokens.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_stochastic_rounding_over_fp32_weights_is_refused(bf16_dir):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"master_weights='bf16'.*parameter\(s\) are torch.float32.*Prepare the model"):
        make_optimizer(model, "bf16+weights:bf16", lr=1e-3)
    assert_untouched(model, before)


def test_plain_adamw_over_bf16_weights_warns_with_the_fix(bf16_dir):
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    with pytest.warns(UserWarning, match=r"plain AdamW over 16-bit weights.*'bf16\+weights:bf16'"):
        optimizer = make_optimizer(model, lr=1e-3)
    assert isinstance(optimizer, torch.optim.AdamW)


def test_a_policy_other_than_the_models_is_refused(bf16_dir):
    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir), "bf16")
    with pytest.raises(ValueError, match=r"master_weights='bf16'.*prepared with 'bf16'"):
        make_optimizer(model, "bf16+weights:bf16", lr=1e-3)


def test_trainer_check_refuses_plain_adamw_under_pure_bf16_and_warns_on_16_bit_weights(bf16_dir):
    pure = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir), "bf16+weights:bf16")
    plain = torch.optim.AdamW(
        [p for p in pure.parameters() if p.requires_grad], lr=1e-3
    )  # what Trainer builds by default
    with pytest.raises(ValueError, match=r"trains pure bf16.*Trainer's optimizer is AdamW.*make_optimizer"):
        check_optimizer(pure, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_optimizer(pure, make_optimizer(pure, lr=1e-3))  # the right one: silent
    kept = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir), "fp32")  # no autocast: left bf16 (it warned)
    with pytest.warns(UserWarning, match=r"updates 2\d* torch.bfloat16 parameter\(s\) without stochastic rounding"):
        check_optimizer(kept, torch.optim.AdamW(kept.parameters(), lr=1e-3))


# ------------------------------------------------------------------ the estimate
@pytest.mark.parametrize("policy", ["bf16", "bf16+weights:bf16", "bf16+ckpt+weights:bf16+optim:8bit"])
def test_the_estimate_counts_the_master_weights_as_the_meter_does(bf16_dir, policy):
    if "8bit" in policy:
        pytest.importorskip("torchao")
    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir).train(), policy)
    with torch.compiler.set_stance("force_eager"):  # torchao's 8-bit step compiles per shape: eager, as traced
        real = measure_step(model, _batch(), make_optimizer(model, lr=1e-4), timed=False)
    est = estimate_memory(bf16_dir, policy, batch_size=2, seq_len=16)
    assert (est.parameters, est.gradients, est.optimizer, est.peak_bytes) == (
        real.parameters,
        real.gradients,
        real.optimizer,
        real.peak_bytes,
    )
    width = 2 if "weights:bf16" in policy else 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert est.parameters == width * est.trainable_parameters + buffers  # every parameter trains, in the master dtype


def test_a_plain_optimizer_stepping_pure_bf16_weights_warns_once(bf16_dir):
    model = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir).train(), "bf16+weights:bf16")
    plain = torch.optim.AdamW(model.parameters(), lr=1e-5)  # a hand-written loop's optimizer
    model(**_batch()).loss.backward()
    with pytest.warns(
        UserWarning, match=r"AdamW steps \d+ parameter\(s\) that prepare_model keeps in pure bf16.*make_optimizer"
    ):
        plain.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.step()  # once per optimizer
        make_optimizer(model, lr=1e-5).step()  # BF16AdamW: silent


def test_an_optimizer_holding_none_of_what_trains_is_refused(bf16_dir):
    from peft import LoraConfig, get_peft_model

    base = prepare_model(AutoModelForCausalLM.from_pretrained(bf16_dir), "bf16")
    early = make_optimizer(base, lr=1e-3)  # built before PEFT added the adapters (TRL's peft_config does that later)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"holds none of the model's \d+ trainable parameters.*get_peft_model"):
        check_optimizer(model, early)


def test_a_training_forward_leaves_a_stand_in_tensor_in_its_dtype():
    # torch.func.functional_call (and the estimator's trace of an FSDP rank) swaps plain tensors in for
    # parameters while the module runs: the reconcile before a training forward cast the caller's bf16
    # tensor to fp32 in place, as if it were a parameter PEFT had made trainable.
    from tiny import tiny_llama

    model = prepare_model(tiny_llama(), "bf16")
    stand_in = model.model.norm.weight.detach().to(torch.bfloat16).requires_grad_()
    ids = torch.randint(3, 100, (1, 8))
    torch.func.functional_call(model, {"model.norm.weight": stand_in}, (), {"input_ids": ids, "labels": ids})
    assert stand_in.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.float32  # the parameter itself: the fp32 master weight
