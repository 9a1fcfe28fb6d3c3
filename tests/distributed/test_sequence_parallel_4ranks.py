"""sp:2 x dp:2 on 4 gloo ranks: the ("dp", "sp") mesh of issue 43's tests. Two sequence groups of two ranks,
each group its own rows; the step through the library's reduction (shard_batch, backward_loss,
average_gradients or FSDP2's averaging, reported_loss) equals the unsharded step over all the rows on
one process - loss and every gradient - without FSDP and with FSDP2 sharding over the four ranks."""

import pytest
from dist_utils import run_ranks
from test_sequence_parallel_reduce import _against_unsharded, _sharded_step
from tiny import make_batch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROWS, SEQ, N = 2, 16, 2


def _rows():
    batch = make_batch("llama", batch_size=2 * ROWS, seq=SEQ, seed=4)
    # Ignored labels, the same count in every row: each group's mean is over as many tokens as the other's,
    # so the mean of the two groups' losses is the whole batch's.
    batch["labels"][:, :3] = -100
    return batch


def _two_groups(rank, world):
    batch = _rows()
    group = rank // N  # contiguous ranks form a sequence group: ranks 0-1 and 2-3
    mine = {k: v[group * ROWS : (group + 1) * ROWS] for k, v in batch.items()}
    results = {}
    for policy in ("fp32+sp:2", "fp32+fsdp+sp:2"):
        loss, grads = _sharded_step(rank, policy, mine)
        results[policy] = _against_unsharded(loss, grads, batch) if rank == 0 else None
    return results


def test_sp2_by_dp2_on_4_ranks_equals_the_unsharded_step():
    [results, *_] = run_ranks(_two_groups, world=4, timeout=600)
    for policy, (dloss, dgrad) in results.items():
        assert dloss < 1e-5, (policy, dloss)
        assert dgrad < 1e-5, (policy, dgrad)
