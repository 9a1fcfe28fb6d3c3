"""The estimator's trace of an FSDP rank under a mixed precision (planning/estimate/fsdp_dtypes.py): the
step runs in the compute dtype as FSDP2's ``param_dtype`` makes it, gradients reach the fp32 master
weights, and the model is left with its own parameters - also after a checkpointed block's recompute,
which stops early, before the block's post-hook. The sharded run itself: tests/distributed/test_fsdp_estimate.py."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from hf_memstack import prepare_model
from hf_memstack.planning.estimate.fsdp_dtypes import compute_dtypes, copies_of


@pytest.mark.parametrize("policy", ["bf16", "bf16+ckpt"])
def test_the_step_runs_in_bf16_and_the_model_keeps_its_parameters(policy):
    model = prepare_model(tiny_llama(), policy)
    before = {n: (p, p.dtype) for n, p in model.named_parameters()}
    seen: dict[str, torch.dtype] = {}

    def record(name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            seen.setdefault(name, out.dtype)

        return hook

    for name in ("model.embed_tokens", "model.layers.0", "model.layers.0.input_layernorm", "model.norm"):
        model.get_submodule(name).register_forward_hook(record(name))
    ids = torch.randint(3, 100, (2, 8))
    with compute_dtypes(model, torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
        after_backward = {n: p for n, p in model.named_parameters()}
    # Under autocast alone these are fp32 (fp32 weights; the residual stream sums in fp32).
    assert seen == dict.fromkeys(seen, torch.bfloat16) and len(seen) == 4
    for name, (param, dtype) in before.items():
        assert after_backward[name] is param, name  # nothing left swapped in once the backward is done
        assert param.dtype == dtype == torch.float32
        assert param.grad is not None and param.grad.dtype == torch.float32, name
    copies = copies_of(model)
    block = sum(p.numel() * 2 for p in model.model.layers[0].parameters())
    assert copies is not None and copies.block_made == block
    # The backward keeps every block weight's copy (norms' and linears'), unless the block is checkpointed.
    assert copies.block == (0 if "ckpt" in policy else block)


@pytest.mark.parametrize("policy", ["bf16", "bf16+ckpt"])
def test_lora_on_experts_and_routers_runs_in_bf16_and_leaves_the_model_as_it_was(policy):
    """PEFT's default LoRA on a Mixtral wraps the experts' grouped weights and the router's weight in
    ``ParamWrapper``, which reparametrizes them with torch's ``parametrize`` in its forward. On a rank
    it folds the adapters into the bf16 gathered weights: so does the trace (it left those modules
    fp32 before, reading the folded weights and the experts' matmuls in fp32). Twice, and through a
    checkpointed recompute, the model keeps its own parameters and no copy is left behind."""
    from peft import get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    from hf_memstack.planning.estimate.trainable import peft_config_from

    torch.manual_seed(0)
    config = MixtralConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = prepare_model(get_peft_model(MixtralForCausalLM(config).train(), peft_config_from("lora")), policy)
    wrapped = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert wrapped  # the experts' and routers' weights (PEFT's all-linear on Mixtral)
    experts = next(m for m in model.modules() if type(m).__name__ == "MixtralExperts")
    router = next(m for m in model.modules() if type(m).__name__ == "MixtralTopKRouter")
    seen: dict[str, set[torch.dtype]] = {"experts": set(), "router": set()}
    experts.register_forward_pre_hook(lambda m, a: seen["experts"].add(m.gate_up_proj.dtype))
    router.register_forward_pre_hook(lambda m, a: seen["router"].add(m.weight.dtype))
    before = dict(model.named_parameters())
    ids = torch.randint(3, 100, (2, 8))
    with compute_dtypes(model, torch.bfloat16):
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
    assert seen == {"experts": {torch.bfloat16}, "router": {torch.bfloat16}}
    after = {n: id(p) for n, p in model.named_parameters()}
    assert after == {n: id(p) for n, p in before.items()}  # the same parameters, none swapped in
    assert not any(dict(m.named_buffers(recurse=False)) for m in (experts, router))  # no copy kept as a buffer
    lora = [p for n, p in before.items() if "lora_" in n and ".experts" in n]
    assert lora and all(p.grad is not None and p.grad.dtype == torch.float32 for p in lora)
