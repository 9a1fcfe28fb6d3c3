"""4-bit base weights under FSDP2 on 2 CPU processes (gloo): torchao's NF4 weights are sharded
with their own all-gather, LoRA adapters train on them, and the loss follows one process training
the same QLoRA model on the whole batch (the reference); each rank holds about half the 4-bit bytes."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks, train_losses
from tiny import tiny_llama

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3


def _qlora(policy):
    from peft import LoraConfig, get_peft_model

    from hf_memstack import prepare_model

    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return prepare_model(get_peft_model(tiny_llama(), lora), policy)


def _batch(lo=0, hi=GLOBAL_BATCH):
    ids = torch.randint(3, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100))
    return {"input_ids": ids[lo:hi], "labels": ids[lo:hi].clone()}


def _train(model, lo, hi):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return train_losses(model, optimizer, lambda _: _batch(lo, hi), range(STEPS))


def _four_bit_bytes(model):
    from hf_memstack import record_of, tensor_bytes

    return sum(tensor_bytes(m.weight) for m in record_of(model).quant.layers)


def _sharded(rank, world, policies):
    from hf_memstack import verify

    per = GLOBAL_BATCH // world
    out = {}
    for policy in policies:
        model = _qlora(policy)
        report = verify(model, _batch(rank * per, (rank + 1) * per))
        out[policy] = (report.ok, str(report), _train(model, rank * per, (rank + 1) * per), _four_bit_bytes(model))
    return out


TOLERANCE = {"fp32+ckpt+fsdp+quant:nf4": 5e-4, "bf16+ckpt+fsdp+quant:nf4": 2e-2}


@pytest.mark.slow
def test_qlora_under_fsdp_matches_one_process():
    per_rank = run_ranks(_sharded, list(TOLERANCE), timeout=400)  # one launch for both precisions
    for policy, tolerance in TOLERANCE.items():
        alone_model = _qlora(policy.replace("+fsdp", ""))
        alone, alone_bytes = _train(alone_model, 0, GLOBAL_BATCH), _four_bit_bytes(alone_model)
        reports = [r[policy] for r in per_rank]
        assert all(ok for ok, *_ in reports), [text for _, text, *_ in reports]
        assert all("4-bit: 14 tensor(s)" in text and "12/12 got gradients" in text for _, text, *_ in reports)
        # Every rank's half of the batch holds the same number of tokens: the mean of the ranks' losses is the global loss.
        sharded = [sum(step) / len(step) for step in zip(*(losses for _, _, losses, _ in reports))]
        assert max(abs(a - b) for a, b in zip(sharded, alone)) < tolerance, (policy, sharded, alone)
        assert sharded[-1] < sharded[0]
        for *_, shard_bytes in reports:  # half the codes and scales each; each shard keeps its own code table and mean
            assert 0.5 * alone_bytes < shard_bytes < 0.55 * alone_bytes, (policy, shard_bytes, alone_bytes)
