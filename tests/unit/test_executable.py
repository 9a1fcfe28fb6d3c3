"""find_executable_batch_size: Accelerate's decorator, predicting first - on a real tiny model
under the simulated device limit, where an oversized step really runs until it runs out of memory."""

import itertools

import pytest
import torch
from tiny import PlainStack, batches, make_batch

from hf_memstack import (
    find_executable_batch_size,
    prepare_model,
    simulated_memory_limit,
)
from hf_memstack.step import train_step


@pytest.fixture
def job(load_model):
    """A prepared Llama, its optimizer with state, and a budget whose true maximum at seq 32 is 30."""
    model = prepare_model(load_model("llama"), "fp32")
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, batches(seq=32)(2), opt)
    peaks = []
    for n in (30, 31):
        with simulated_memory_limit("64GiB", count=[model, opt]) as mem:
            train_step(model, batches(seq=32)(n), opt)
        peaks.append(mem.peak_bytes)
    return model, opt, sum(peaks) // 2


def training(calls, seq):
    def train(batch_size, model, optimizer):
        calls.append(batch_size)
        for _ in range(2):  # the second step holds the optimizer state through its backward: the steady state
            train_step(model, batches(seq=seq)(batch_size), optimizer)
        return batch_size
    return train


def test_predicts_then_runs_once(job):
    model, opt, budget = job
    calls = []
    train = find_executable_batch_size(training(calls, 32), starting_batch_size=1024, make_batch=batches(seq=32), cache=False)
    with simulated_memory_limit(budget, count=[model, opt]) as mem:
        used = train(model, opt)
    assert 0.95 * 30 <= used <= 30 and calls == [used] and mem.out_of_memory_errors == 0
    assert train.batch_size_result.batch_size == used and train.batch_size_result.steps_run <= 4


def test_falls_back_to_accelerate_retries_when_the_function_needs_more(job):
    model, opt, budget = job
    calls = []
    # The function trains on sequences of 64 while make_batch builds 32: the prediction is too large.
    train = find_executable_batch_size(training(calls, 64), starting_batch_size=1024, make_batch=batches(seq=32), cache=False)
    with simulated_memory_limit(budget, count=[model, opt]) as mem:
        used = train(model, opt)
    predicted = train.batch_size_result.batch_size
    assert calls[0] == predicted and calls[-1] == used and len(calls) > 1 and mem.out_of_memory_errors >= len(calls) - 1
    assert all(b == int(a * 0.9) for a, b in itertools.pairwise(calls))  # Accelerate's schedule after the prediction


def test_without_make_batch_it_is_accelerates_decorator(job):
    from accelerate.utils import find_executable_batch_size as accelerate_find

    model, opt, budget = job
    ours, theirs = [], []
    ours_train = find_executable_batch_size(training(ours, 32), starting_batch_size=48)
    with simulated_memory_limit(budget, count=[model, opt]), pytest.warns(UserWarning, match="no make_batch .*retrying from 48"):
        ours_train(model, opt)
    with simulated_memory_limit(budget, count=[model, opt]):
        accelerate_find(training(theirs, 32), starting_batch_size=48)(model, opt)
    assert ours == theirs == [48, 43, 38, 34, 30]  # the same schedule, down to the true maximum


def test_errors_as_accelerate_raises_them():
    model = PlainStack()
    calls = []

    @find_executable_batch_size(starting_batch_size=4)
    def always_oom(batch_size, model):
        calls.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.warns(UserWarning, match="no make_batch"), pytest.raises(RuntimeError, match="reached zero"):
        always_oom(model)
    assert calls == [4, 3, 2, 1]
    with pytest.raises(TypeError, match="Batch size was passed into `always_oom`"):
        always_oom(8, model)

    @find_executable_batch_size(starting_batch_size=4, make_batch=lambda n: make_batch("plain", batch_size=n),
                                budget="1GiB", mode="eval", cache=False)
    def broken(batch_size, model):
        calls.append(batch_size)
        raise ValueError("not a memory problem")

    calls.clear()
    with pytest.raises(ValueError, match="not a memory problem"):
        broken(model)
    assert calls == [4]  # predicted (eval, capped at 4), called once, not retried
    with pytest.raises(ValueError, match="starting_batch_size=0 must be a positive integer"):
        find_executable_batch_size(lambda batch_size: None, starting_batch_size=0)
