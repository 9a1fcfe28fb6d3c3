"""The memory rungs beyond the blocks under FSDP2 on 2 CPU processes (gloo): the chunked loss head
on a sharded model, selective checkpointing inside the shards, and an optimizer stepping in the
backward on sharded parameters - each against one process training on the whole batch with the
model's own loss, block checkpointing off and plain AdamW (the independent reference)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks, train_losses
from tiny import tiny_llama

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3
POLICIES = [
    "fp32+ckpt+fsdp+loss:chunked",
    "fp32+ckpt:selective:alternate+fsdp",
    "fp32+fsdp+loss:chunked+optim:in_backward",
]


def _batch(lo=0, hi=GLOBAL_BATCH):
    ids = torch.randint(3, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt without loss
    return {"input_ids": ids[lo:hi], "labels": labels[lo:hi]}


def _train(model, optimizer, lo, hi):
    return train_losses(model, optimizer, lambda _: _batch(lo, hi), range(STEPS))


def _sharded(rank, world):
    from hf_memstack import make_optimizer, prepare_model, verify

    per = GLOBAL_BATCH // world
    out = {}
    for policy in POLICIES:
        model = prepare_model(tiny_llama(), policy)
        report = verify(model, _batch(rank * per, (rank + 1) * per))
        out[policy] = (
            report.ok,
            str(report),
            _train(model, make_optimizer(model, lr=1e-2), rank * per, (rank + 1) * per),
        )
    # An evaluation forward before the optimizer is built: the root must not stay unsharded (its
    # parameters() would then be the gathered copies, and the optimizer would update those).
    from torch.distributed.tensor import DTensor

    model = prepare_model(tiny_llama(), "fp32+fsdp")
    with torch.no_grad():
        model(**_batch(rank * per, (rank + 1) * per))
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    out["eval_first"] = (sharded, _train(model, make_optimizer(model, lr=1e-2), rank * per, (rank + 1) * per))
    # Replicated (DDP-style) parameters: each rank would step before the gradients are averaged.
    try:
        make_optimizer(prepare_model(tiny_llama(), "fp32+optim:in_backward"), lr=1e-2)
        out["replicated"] = "built"
    except ValueError as e:
        out["replicated"] = str(e)
    return out


def test_memory_rungs_inside_fsdp_match_one_process():
    alone_model = tiny_llama()
    # One process, the whole batch, the model's own loss, plain AdamW. Every rank's half has the same
    # number of counted tokens, so the mean of the ranks' mean losses is the global mean.
    alone = _train(alone_model, torch.optim.AdamW(alone_model.parameters(), lr=1e-2), 0, GLOBAL_BATCH)
    per_rank = run_ranks(_sharded)
    for policy in POLICIES:
        reports = [r[policy] for r in per_rank]
        assert all(ok for ok, _, _ in reports), [text for _, text, _ in reports]
        sharded = [sum(step) / len(step) for step in zip(*(losses for _, _, losses in reports))]
        assert sharded == pytest.approx(alone, rel=1e-5), (policy, sharded, alone)
        assert sharded[-1] < sharded[0]
    assert all(r["eval_first"][0] for r in per_rank)
    after_eval = [sum(step) / len(step) for step in zip(*(r["eval_first"][1] for r in per_rank))]
    assert after_eval == pytest.approx(alone, rel=1e-5)
    for r in per_rank:
        assert "on 2 processes without FSDP" in r["replicated"] and "policy 'fsdp'" in r["replicated"], r["replicated"]


def _pure_bf16(rank, world):
    import warnings

    from hf_memstack import make_optimizer, prepare_model
    from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW

    per = GLOBAL_BATCH // world
    model = prepare_model(tiny_llama(), "bf16+fsdp+weights:bf16")
    dtypes = {str(p.dtype) for p in model.parameters()}
    optimizer = make_optimizer(model, lr=1e-2)
    with warnings.catch_warnings(record=True) as rounding:
        warnings.simplefilter("always")
        losses = _train(model, optimizer, rank * per, (rank + 1) * per)
    # A hand-written loop's plain AdamW over the same sharded bf16 parameters.
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, plain, rank * per, (rank + 1) * per)
    said = [str(w.message) for w in caught if "pure bf16 (weights:bf16)" in str(w.message)]
    return (
        dtypes,
        type(optimizer) is BF16AdamW,
        losses,
        said,
        [str(w.message) for w in rounding if "pure bf16" in str(w.message)],
    )


def test_pure_bf16_under_fsdp_trains_with_stochastic_rounding_and_a_plain_optimizer_warns():
    """fully_shard replaces every parameter: the step check's tag must be on the sharded ones."""
    for dtypes, built, losses, said, quiet in run_ranks(_pure_bf16):
        assert dtypes == {"torch.bfloat16"} and built
        assert losses[-1] < losses[0], losses
        assert len(said) == 1 and "AdamW steps" in said[0] and "make_optimizer" in said[0], said
        assert not quiet  # BF16AdamW rounds stochastically: no warning
