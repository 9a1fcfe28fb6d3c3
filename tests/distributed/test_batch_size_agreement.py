"""The finder on 2 gloo ranks: they agree on every probe and the size, on whether the cache holds,
and any failure on one rank ends every rank with an error instead of a hang. One launch runs
every scenario (a launch costs more than the searches); each test checks one of them."""

from pathlib import Path

import pytest
import torch
from dist_utils import outcome, run_ranks
from tiny import batches, tiny_llama

pytestmark = pytest.mark.distributed

SMALL, LARGE = 12 * 2**20, 24 * 2**20
# Large enough that its per-device share (GLOBAL / 2) never caps the search: the budgets decide.
GLOBAL = 512


_make = batches("llama", seq=32)


def _scenarios(rank, world, cache_dirs):
    from hf_memstack import find_batch_size, prepare_model

    model = prepare_model(tiny_llama(), "bf16")
    opt = torch.optim.AdamW(model.parameters())
    out = {}

    def find(**kwargs):
        r = find_batch_size(
            model, kwargs.pop("make", _make), opt, **{"cache": False, "global_batch_size": GLOBAL, **kwargs}
        )
        return r.batch_size, r.world_size, r.grad_accum, r.cache, [(p.batch_size, p.fits) for p in r.probes]

    out["agree"] = outcome(lambda: find(budget=[LARGE, SMALL][rank]))
    # Per-node caches: after one search only rank 0 (local rank 0) wrote an entry.
    out["cache_first"] = outcome(lambda: find(budget=SMALL, cache=True, cache_dir=cache_dirs[rank]))
    out["cache_second"] = outcome(lambda: find(budget=SMALL, cache=True, cache_dir=cache_dirs[rank]))

    def make_or_fail(n):
        if rank == 1 and n >= 4:
            raise RuntimeError("the dataset's disk went away")
        return _make(n)

    before = [p.detach().clone() for p in model.parameters()]
    out["error_in_probe"] = outcome(lambda: find(budget=SMALL, make=make_or_fail))
    out["restored"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    out["preflight"] = outcome(lambda: find(budget=[SMALL, 2**10][rank]))  # rank 1: below the weights
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    dirs = [str(tmp_path_factory.mktemp(f"cache{r}")) for r in range(2)]
    return run_ranks(_scenarios, dirs, world=2), dirs


def _alone(budget):
    from hf_memstack import find_batch_size, prepare_model

    model = prepare_model(tiny_llama(), "bf16")
    return find_batch_size(model, _make, torch.optim.AdamW(model.parameters()), budget=budget, cache=False).batch_size


def test_two_ranks_agree_on_the_smaller_budget(ranks):
    (_, (bs0, world0, acc0, _, probes0)), (_, (bs1, world1, acc1, _, probes1)) = (r["agree"] for r in ranks[0])
    assert bs0 == bs1 and world0 == world1 == 2
    assert probes0 == probes1  # the same probes, in the same order, with agreed outcomes
    assert bs0 == _alone(SMALL) < _alone(LARGE)  # the rank with less memory decides
    assert acc0 == acc1 == -(-GLOBAL // (bs0 * 2))


def test_ranks_agree_whether_the_cache_holds(ranks):
    results, dirs = ranks
    first = [r["cache_first"] for r in results]
    second = [r["cache_second"] for r in results]
    assert [s for s, _ in first + second] == ["ok"] * 4
    assert list((Path(dirs[0]) / "batch_size").glob("*.json"))  # rank 0 wrote its entry
    assert not (Path(dirs[1]) / "batch_size").exists()  # rank 1 (local rank 1) did not
    # Rank 0 holds a valid entry, rank 1 none: both search again, together, to the same size.
    assert [v[3] for _, v in second] == ["miss", "miss"]
    assert second[0][1][0] == second[1][1][0] == first[0][1][0] and second[0][1][4] == second[1][1][4]


def test_an_error_on_one_rank_ends_every_rank(ranks):
    results, _ = ranks
    (kind0, msg0), (kind1, msg1) = (r["error_in_probe"] for r in results)
    assert (kind1, msg1) == ("RuntimeError", "the dataset's disk went away")
    assert kind0 == "DistributedMismatchError" and "rank 1: RuntimeError: the dataset's disk went away" in msg0
    assert all(r["restored"] for r in results)  # the weights are back on both ranks


def test_a_preflight_failure_on_one_rank_ends_every_rank(ranks):
    results, _ = ranks
    (kind0, msg0), (kind1, msg1) = (r["preflight"] for r in results)
    assert kind1 == kind0 == "BudgetTooSmallError"
    assert "smaller than the model's parameters alone" in msg1 and "rank 1" in msg0


# A vocabulary large enough that the weights, gradients and Adam state (about 4 MiB) dominate
# the step: half of them is far more than the kernels' scratch, which differs between CPUs.
FSDP_VOCAB = 2048


def _fsdp(rank, world):
    from hf_memstack import find_batch_size, prepare_model
    from hf_memstack.measure.simulated import simulated_memory_limit
    from hf_memstack.measure.step import train_step

    model = prepare_model(tiny_llama(vocab_size=FSDP_VOCAB), "fp32+fsdp")
    opt = torch.optim.AdamW(model.parameters())
    model(**_make(2)).loss.backward()  # leave (sharded) gradients in place
    local = [p.to_local().detach().clone() for p in model.parameters()]
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    result = find_batch_size(model, _make, opt, budget="10MiB", max_batch_size=64, cache=False)
    restored = all(torch.equal(a, p.to_local()) for a, p in zip(local, model.parameters()))
    restored &= all(torch.equal(g, p.grad.to_local()) for g, p in zip(grads, model.parameters()))
    peak_at_2 = next(p.peak_bytes for p in result.probes if p.batch_size == 2)
    clean = not opt.state
    # The same step measured independently on this rank: its local shards plus what the step allocates.
    train_step(model, _make(2), opt)
    with simulated_memory_limit("1GiB", count=[model, opt]) as mem:
        train_step(model, _make(2), opt)
    return (
        result.batch_size,
        [(p.batch_size, p.fits) for p in result.probes],
        peak_at_2,
        mem.peak_bytes,
        restored,
        clean,
    )


def test_fsdp_counts_local_shards_and_restores_them():
    from hf_memstack import prepare_model
    from hf_memstack.measure.accounting import model_state_bytes

    (bs0, probes0, peak0, direct0, restored0, clean0), (bs1, probes1, peak1, direct1, restored1, clean1) = run_ranks(
        _fsdp, world=2
    )
    assert bs0 == bs1 >= 2 and probes0 == probes1 and restored0 and restored1 and clean0 and clean1
    # Each rank's probe is the step's real peak on that rank: its local shards of the weights,
    # gradients and optimizer state plus what the step allocates. Counting the global sizes of the
    # sharded parameters (numel() of a DTensor) would add about half the model's state (2.7 MiB).
    global_params = model_state_bytes(prepare_model(tiny_llama(vocab_size=FSDP_VOCAB), "fp32")).parameters
    for peak, direct in ((peak0, direct0), (peak1, direct1)):
        assert abs(peak - direct) < 0.05 * global_params, (peak, direct, global_params)
