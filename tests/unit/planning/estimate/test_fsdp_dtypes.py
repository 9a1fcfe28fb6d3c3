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
