"""sp:N's per-forward guard on 2 gloo ranks: ranks of a sequence group given batches of different widths
or row counts (a sampler keyed by the global rank) both stop with the same message naming each rank's
shape and shard_batch, promptly, instead of gloo's "Received data size doesn't match expected size"."""

import pytest
import torch
from dist_utils import run_ranks, timed
from tiny import make_batch, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROMPT = 20.0  # far below dist_utils' 60 s group timeout: no rank waits in a collective for the other


def _mismatched(rank, world):
    from hf_memstack import prepare_model
    from hf_memstack.transforms.sequence_parallel import shard_batch

    torch.set_num_threads(1)
    model = prepare_model(tiny_llama(), "fp32+sp:2")
    out = {}
    for case, (rows, seq) in {"width": (2, 32 if rank == 0 else 30), "rows": (2 if rank == 0 else 3, 32)}.items():
        batch = make_batch("llama", batch_size=rows, seq=seq, seed=rank)
        out[case] = timed(lambda b=batch: model(**shard_batch(b, sp_rank=rank, sp_size=2)).loss)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_mismatched, timeout=300)


@pytest.mark.parametrize(
    ("case", "shapes"),
    [
        ("width", "rank 0 2 rows x 16 tokens, rank 1 2 rows x 15 tokens"),
        ("rows", "rank 0 2 rows x 16 tokens, rank 1 3 rows x 16 tokens"),
    ],
)
def test_ranks_of_a_group_given_different_shapes_both_raise_one_message(ranks, case, shapes):
    (kind0, msg0), seconds0 = ranks[0][case]
    (kind1, msg1), seconds1 = ranks[1][case]
    assert kind0 == kind1 == "ValueError"
    assert msg0 == msg1
    assert shapes in msg0 and "shard_batch(batch, sp_rank=rank % 2, sp_size=2)" in msg0
    assert max(seconds0, seconds1) < PROMPT
