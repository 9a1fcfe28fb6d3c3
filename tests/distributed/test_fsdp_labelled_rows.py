"""The chunked head over labelled rows only, under FSDP2 on 2 CPU processes (gloo), each rank with a
different number of labelled positions (issue 41): no rank waits on another in the head, and with
Trainer's ``num_items_in_batch`` the gradients equal one process's on the whole batch."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from tiny import tiny_llama

pytestmark = pytest.mark.distributed

SEQ = 16


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, :13] = -100  # rank 0's sample: 2 labelled positions
    return {"input_ids": ids, "labels": labels}  # rank 1's sample: all 15


def _counted(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != -100).sum()


def _sharded(rank: int, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    from hf_memstack import prepare_model

    model = prepare_model(tiny_llama(), "fp32+fsdp+loss:chunked")
    batch = _batch()
    mine = {k: v[rank : rank + 1] for k, v in batch.items()}
    loss = model(**mine, num_items_in_batch=_counted(batch)).loss
    loss.backward()
    # FSDP averages the ranks' gradients: times the world size, the gradient of the global sum / items.
    grads = {n: p.grad.full_tensor() * world for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def test_ranks_with_different_labelled_counts_match_one_process():
    model = tiny_llama()
    batch = _batch()
    loss = model(**batch, num_items_in_batch=_counted(batch)).loss
    loss.backward()
    per_rank = run_ranks(_sharded)
    assert sum(r[0] for r in per_rank) == pytest.approx(float(loss), rel=1e-5)
    for name, p in model.named_parameters():
        got = per_rank[0][1][name]
        assert torch.allclose(got, p.grad, rtol=1e-4, atol=1e-6), name
