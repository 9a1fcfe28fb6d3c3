"""mlp:tiled: the blocks' MLPs over tiles of tokens give the untiled model's loss and gradients,
under every checkpointing mode, with LoRA on the MLP projections and with compile; the step holds
less; models it cannot tile are refused and left untouched."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from tiny import PlainStack, assert_untouched, make_batch, snapshot
from torch import nn

from hf_memstack import MemoryPolicy, estimate_memory, measure_step, prepare_model, verify
from hf_memstack.errors import PolicyError


def _tiled(policy: str, tile: int = 8, **mlp) -> MemoryPolicy:
    data = MemoryPolicy.from_string(policy).to_dict()
    return MemoryPolicy.from_dict({**data, "mlp": {"mode": "tiled", "tile_tokens": tile, **mlp}})


def _loss_and_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a: tuple[float, dict], b: tuple[float, dict]) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-6)
    assert a[1].keys() == b[1].keys() and a[1]
    for name in a[1]:
        torch.testing.assert_close(b[1][name], a[1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "arch, policy",
    [
        ("llama", "fp32"),
        ("llama", "fp32+ckpt"),
        ("llama", "fp32+ckpt:2"),
        ("llama", "fp32+ckpt:selective:alternate"),
        ("gpt2", "fp32+ckpt:selective"),
    ],
)
def test_tiled_mlps_give_the_untiled_gradients(load_model, arch, policy):
    batch = make_batch(arch, batch_size=2, seq=20)
    untiled = _loss_and_grads(prepare_model(load_model(arch), policy), batch)
    model = prepare_model(load_model(arch), _tiled(policy))
    assert model.memstack.mlp.tiled == (0, 1) and model.memstack.mlp.tile_tokens == 8
    _assert_same(untiled, _loss_and_grads(model, batch))
    report = verify(model, batch)
    assert report.ok, str(report)
    # 40 tokens in tiles of 8: 5 tiles in the forward, each recomputed in the backward (more when the block
    # checkpoint's recompute runs them too, before it stops early at the last saved tile input).
    found = re.search(r"at least (\d+) tile\(s\) each in the forward, (\d+) recomputed", report.check("mlp").detail)
    assert found is not None and int(found[1]) == 5 and int(found[2]) >= 5


def test_a_plain_module_stack_with_the_mlp_named(load_model):
    batch = make_batch("plain", batch_size=2, seq=20)
    untiled = _loss_and_grads(prepare_model(load_model("plain"), "fp32+ckpt"), batch)
    model = prepare_model(load_model("plain"), _tiled("fp32+ckpt", module_name="ff"))
    assert model.memstack.checkpointing.method == "torch"
    _assert_same(untiled, _loss_and_grads(model, batch))


@pytest.mark.parametrize("order", ["peft first", "policy first"])
def test_lora_on_the_mlp_projections(load_model, order):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]
    )
    batch = make_batch("llama", batch_size=2, seq=20)
    torch.manual_seed(3)
    base = get_peft_model(load_model("llama"), lora)
    for p in base.parameters():  # non-zero B matrices: the adapters' gradients flow through every tile
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    untiled = _loss_and_grads(prepare_model(copy.deepcopy(base), "fp32+ckpt"), batch)
    if order == "peft first":
        model = prepare_model(copy.deepcopy(base), _tiled("fp32+ckpt"))
    else:
        model = prepare_model(load_model("llama"), _tiled("fp32+ckpt"))
        model = get_peft_model(model, lora)
        model.load_state_dict(base.state_dict())
    got = _loss_and_grads(model, batch)
    assert len(got[1]) == 16  # only the adapters train
    _assert_same(untiled, got)


@pytest.mark.slow
def test_regional_compile(load_model):
    batch = make_batch("llama", batch_size=2, seq=20)
    untiled = _loss_and_grads(prepare_model(load_model("llama"), "fp32+ckpt"), batch)
    model = prepare_model(load_model("llama"), _tiled("fp32+compile:regional+ckpt"))
    for _ in range(2):  # the second step runs the compiled graphs
        _assert_same(untiled, _loss_and_grads(model, batch))
    assert model.memstack.compile.graph_calls >= 2


@pytest.mark.slow
def test_the_step_holds_less_and_the_estimator_counts_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    # A wide MLP and a long sequence: the MLP's intermediates dominate the recompute of a block.
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=512,
    )
    batch = {"input_ids": torch.arange(384).remainder(61).unsqueeze(0) + 3}
    batch["labels"] = batch["input_ids"]
    peaks, estimates = {}, {}
    for name, policy in (("untiled", MemoryPolicy.from_string("fp32+ckpt")), ("tiled", _tiled("fp32+ckpt", tile=64))):
        torch.manual_seed(0)
        model = prepare_model(LlamaForCausalLM(config).train(), policy)
        peaks[name] = measure_step(model, batch, torch.optim.AdamW(model.parameters())).forward_backward_peak
        estimates[name] = estimate_memory(config, policy, batch_size=1, seq_len=384).forward_backward_peak
    assert peaks["tiled"] < 0.8 * peaks["untiled"], peaks
    for name in peaks:
        assert estimates[name] == pytest.approx(peaks[name], rel=0.1)


class _MixingFeedForward(nn.Module):
    """Not token-wise: each token's output depends on the mean over the sequence."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x - x.mean(dim=-2, keepdim=True))


def test_refusals_leave_the_model_untouched(load_model):
    from transformers import MixtralConfig, MixtralForCausalLM

    llama = load_model("llama")
    before = snapshot(llama)
    with pytest.raises(ValueError, match=r"policy.mlp.module_name='ffwd': block\(s\) \[0, 1\] .* no such MLP"):
        prepare_model(llama, _tiled("fp32", module_name="ffwd"))
    assert_untouched(llama, before)

    stack = PlainStack()
    for block in stack.layers:
        block.ff = _MixingFeedForward(PlainStack.DIM)
    before = snapshot(stack)
    with pytest.raises(ValueError, match=r"block.ff \(_MixingFeedForward\) does not compute each token on its own"):
        prepare_model(stack, _tiled("fp32", module_name="ff"))
    assert_untouched(stack, before)

    moe = MixtralForCausalLM(
        MixtralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    before = snapshot(moe)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        prepare_model(moe, "fp32+mlp:tiled")
    assert_untouched(moe, before)


def test_the_policy_token_and_its_validation():
    policy = MemoryPolicy.from_string("bf16+ckpt+mlp:tiled")
    assert policy.mlp.mode == "tiled" and policy.to_string() == "bf16+ckpt+mlp:tiled"
    assert MemoryPolicy.from_dict(policy.to_dict()) == policy
    with pytest.raises(PolicyError) as e:
        MemoryPolicy(mlp={"mode": "tiled", "tile_tokens": 0, "module_name": ""})
    assert "policy.mlp.tile_tokens=0 must be a positive integer" in str(e.value)
    assert "policy.mlp.module_name='' must be the MLP's name" in str(e.value)
    with pytest.raises(PolicyError, match="only apply to mode='tiled'"):
        MemoryPolicy(mlp={"tile_tokens": 64})
    with pytest.raises(PolicyError, match=r"'mlp:wide' is not one of 'mlp:tiled'"):
        MemoryPolicy.from_string("bf16+mlp:wide")
