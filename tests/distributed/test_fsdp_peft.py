"""A PEFT model under FSDP2 on a one-rank gloo group (``fully_shard`` then behaves as on more ranks
for what is checked here: the sharded model's class, DTensor parameters): the estimate of a sharded
LoRA model counts its adapters as what trains, and adapters added after sharding are refused
before the forward, with the fix."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed]

SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 500,
}
POLICY = "bf16+ckpt+fsdp+loss:chunked"


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).train()


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"])


def _both(rank, world):
    from peft import get_peft_model

    from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model

    ids = torch.randint(3, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    # 1. PEFT, then prepare_model (sharded), one step, then the estimate of that sharded object.
    model = prepare_model(get_peft_model(_tiny(), _lora()), POLICY)
    real = measure_step(model, batch, make_optimizer(model, lr=1e-3), timed=False)
    est = estimate_memory(model, POLICY, batch_size=2, seq_len=32, world_size=world, device="cpu")
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    estimate = (real.optimizer, est.optimizer, real.gradients, est.gradients, trains)
    # 2. prepare_model (sharded), then PEFT: the forward is refused.
    late = get_peft_model(prepare_model(_tiny(), "bf16+fsdp"), _lora())
    try:
        late(**batch)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    return estimate, refused


@pytest.fixture(scope="module")
def results():
    return run_ranks(_both, world=1, timeout=300)[0]


def test_estimate_of_a_sharded_peft_model_counts_its_adapters_as_trainable(results):
    real_opt, est_opt, real_grad, est_grad, trains = results[0]
    assert trains > 0
    # AdamW holds two fp32 moments per trainable parameter: the adapters', not the whole model's.
    assert est_opt == pytest.approx(real_opt, rel=0.1)
    assert est_opt < 4 * 2 * trains * 2
    assert est_grad == pytest.approx(real_grad, rel=0.1, abs=64 * 1024)


def test_peft_after_prepare_model_under_fsdp_is_refused_with_the_fix(results):
    refused = results[1]
    assert refused is not None, "the forward of adapters added after sharding ran"
    assert "added after prepare_model" in refused
    assert "lora_A" in refused
    assert "get_peft_model before prepare_model" in refused
    assert "peft_config=" in refused
