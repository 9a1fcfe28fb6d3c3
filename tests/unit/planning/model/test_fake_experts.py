"""Mixture-of-experts models on the estimator's fake tensors: a tiny Mixtral and Qwen2-MoE saved in
bf16 and fp32 and loaded the default way; every field of the estimate against the meter on the real
step (Transformers' default grouped_mm experts, fp32 ones included, which PyTorch's fake kernel
refuses on its own), the extrapolation across depth against the full trace, the planner, and the
eager experts refused with the fix named."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from hf_memstack import estimate_memory, make_optimizer, measure_step, plan_policy, prepare_model
from hf_memstack.planning.estimate import peft_config_from

SEQ, BATCH, VOCAB = 32, 2, 256


def _config(arch: str, layers: int = 3):
    common = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "num_experts_per_tok": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=4, **common)
    return Qwen2MoeConfig(num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64, **common)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch, cls in (("mixtral", MixtralForCausalLM), ("qwen2-moe", Qwen2MoeForCausalLM)):
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            torch.manual_seed(0)
            cls(_config(arch)).to(dtype).save_pretrained(root / f"{arch}-{name}")
            out[arch, name] = root / f"{arch}-{name}"
    return out


def _measured(path, policy: str, trainable: str):
    model = AutoModelForCausalLM.from_pretrained(path)  # dtype="auto": a bf16 checkpoint comes back bf16
    assert model.config._experts_implementation == "grouped_mm"  # Transformers' default, what is traced
    peft_config = peft_config_from(trainable)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU bf16 emulation; 16-bit trainable weights under mixed precision
        model = prepare_model(model.train(), policy)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.compiler.set_stance("force_eager"):  # torchao's step (weights:bf16) compiles per shape: eager, as traced
        return measure_step(
            model, {"input_ids": ids, "labels": ids.clone()}, make_optimizer(model, lr=1e-4), timed=False
        )


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
@pytest.mark.parametrize(
    ("weights", "policy", "trainable"),
    [
        ("fp32", "fp32", "all"),  # fp32 experts: torch._grouped_mm's fake kernel alone refuses them
        ("bf16", "bf16", "all"),  # fp32 master weights of bf16 experts
        ("bf16", "bf16+ckpt", "lora"),
        ("fp32", "bf16+ckpt+loss:chunked", "lora"),
        ("bf16", "bf16+ckpt+weights:bf16", "all"),
    ],
)
def test_every_field_of_a_mixture_of_experts_estimate_is_the_meters(saved, arch, weights, policy, trainable):
    real = _measured(saved[arch, weights], policy, trainable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_memory(saved[arch, weights], policy, batch_size=BATCH, seq_len=SEQ, trainable=trainable)
    assert est.weights_dtype == weights
    assert (est.parameters, est.gradients, est.optimizer) == (real.parameters, real.gradients, real.optimizer)
    assert (est.peak_bytes, est.peak_phase, est.forward_backward_peak) == (
        real.peak_bytes,
        real.peak_phase,
        real.forward_backward_peak,
    )
    rest = real.peak_bytes - real.parameters - real.gradients - real.optimizer
    assert est.activations == min(real.saved_activations, rest) and est.temporaries == rest - est.activations


def _fields(estimate) -> dict:
    values = dataclasses.asdict(estimate)
    values.pop("notes")
    # The depth extrapolation's per-block reading, which a full trace does not take.
    values.pop("activations_per_block")
    values.pop("blocks")
    return values


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe"])
@pytest.mark.parametrize(("policy", "trainable"), [("bf16+ckpt", {"r": 16}), ("bf16+ckpt:2+loss:chunked", "all")])
def test_a_mixture_of_experts_estimate_extrapolates_to_the_full_trace(arch, policy, trainable):
    config = _config(arch, layers=14)
    job = {"batch_size": 1, "seq_len": 64, "trainable": trainable}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = estimate_memory(config, policy, **job)
        full = estimate_memory(config, policy, extrapolate=False, **job)
    assert any("extrapolated" in n for n in fast.notes)
    assert _fields(fast) == _fields(full)


def test_a_mixture_of_experts_model_is_planned_without_the_4bit_rung_prepare_model_refuses():
    # LoRA wraps the routers too, which torchao's 4-bit weights cannot replace (prepare_model refuses
    # quant:nf4 there): the plan offers the other rungs and says what fits.
    config = _config("mixtral", layers=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roomy = plan_policy(config, budget="64MiB", seq_len=SEQ, trainable="lora")
        tight = plan_policy(config, budget="3MiB", seq_len=SEQ, trainable="lora")
    assert roomy.fits and roomy.estimate is not None and roomy.estimate.peak_bytes <= roomy.usable_bytes
    assert not tight.fits and tight.rows
    assert not any("quant" in row.policy for row in tight.rows)


def test_eager_experts_are_refused_naming_the_implementation_to_use():
    model = MixtralForCausalLM(_config("mixtral"))
    model.set_experts_implementation("eager")  # each expert's tokens picked by the router's values
    with pytest.raises(ValueError, match=r"experts_implementation='eager'.*set_experts_implementation\('grouped_mm'\)"):
        estimate_memory(model, "bf16", batch_size=BATCH, seq_len=SEQ)
    model.set_experts_implementation("grouped_mm")
    assert estimate_memory(model, "bf16", batch_size=BATCH, seq_len=SEQ).peak_bytes > 0


def test_a_hybrid_model_with_the_chunked_loss_is_estimated_as_prepare_model_takes_it():
    # Found by a new-user trial: the chunked loss is checked on a copy cut to one block, and Jamba's
    # first block is a Mamba one - a model without an attention layer, which Transformers' cache
    # refuses, read as a refusal of the loss. The copy now holds one block of every kind.
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        mamba_d_state=8,
        use_mamba_kernels=False,
    )
    assert config.layers_block_type[0] == "mamba"
    _assert_chunked_loss_estimate_is_the_meters(config, JambaForCausalLM)


def _assert_chunked_loss_estimate_is_the_meters(config, cls) -> None:
    est = estimate_memory(config, "fp32+loss:chunked", batch_size=BATCH, seq_len=SEQ)
    torch.manual_seed(0)
    model = prepare_model(cls(config).train(), "fp32+loss:chunked")
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    real = measure_step(model, {"input_ids": ids, "labels": ids.clone()}, make_optimizer(model, lr=1e-4), timed=False)
    assert (est.peak_bytes, est.parameters, est.optimizer) == (real.peak_bytes, real.parameters, real.optimizer)


@pytest.mark.parametrize(
    ("experts", "per_token", "field"),
    [(4, 5, "num_experts_per_tok"), (4, 0, "num_experts_per_tok"), (0, 2, "num_local_experts")],
)
def test_a_config_routing_to_experts_it_does_not_have_is_refused_naming_the_fields(experts, per_token, field):
    config = _config("mixtral")
    config.num_local_experts, config.num_experts_per_tok = experts, per_token
    with pytest.raises(
        ValueError, match=rf"num_local_experts={experts} and num_experts_per_tok={per_token}.*{field} must be"
    ):
        estimate_memory(config, "bf16", batch_size=BATCH, seq_len=SEQ)


@pytest.mark.parametrize("placement", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_a_model_whose_first_block_is_dense_is_estimated_with_the_chunked_loss(placement):
    # Found by a new-user trial: a Qwen3-MoE whose block 0 is dense (its config places the dense and
    # sparse blocks by their own fields, not layer_types) was checked on a copy cut to that block,
    # which has no router: Transformers' router loss failed on no router logits (exit 3 from the CLI,
    # for the whole plan). The copy now holds a block of every kind read from the blocks themselves.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        **placement,
    )
    _assert_chunked_loss_estimate_is_the_meters(config, Qwen3MoeForCausalLM)
