"""find_executable_batch_size: Accelerate's decorator, predicting first - on a real tiny model
under the simulated device limit, where an oversized step really runs until it runs out of memory."""

import itertools

import numpy as np
import pytest
import torch
from tiny import PlainStack, batches, make_batch

from hf_memstack import (
    find_executable_batch_size,
    prepare_model,
    simulated_memory_limit,
)
from hf_memstack.measure.step import train_step


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
    train = find_executable_batch_size(
        training(calls, 32), starting_batch_size=1024, make_batch=batches(seq=32), cache=False
    )
    with simulated_memory_limit(budget, count=[model, opt]) as mem:
        used = train(model, opt)
    assert 0.95 * 30 <= used <= 30 and calls == [used] and mem.out_of_memory_errors == 0
    assert train.batch_size_result.batch_size == used and train.batch_size_result.steps_run <= 4


def test_falls_back_to_accelerate_retries_when_the_function_needs_more(job):
    model, opt, budget = job
    calls = []
    # The function trains on sequences of 64 while make_batch builds 32: the prediction is too large.
    train = find_executable_batch_size(
        training(calls, 64), starting_batch_size=1024, make_batch=batches(seq=32), cache=False
    )
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
    with (
        simulated_memory_limit(budget, count=[model, opt]),
        pytest.warns(UserWarning, match="no make_batch .*retrying from 48"),
    ):
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

    @find_executable_batch_size(
        starting_batch_size=4,
        make_batch=lambda n: make_batch("plain", batch_size=n),
        budget="1GiB",
        mode="eval",
        cache=False,
    )
    def broken(batch_size, model):
        calls.append(batch_size)
        raise ValueError("not a memory problem")

    calls.clear()
    with pytest.raises(ValueError, match="not a memory problem"):
        broken(model)
    assert calls == [4]  # predicted (eval, capped at 4), called once, not retried
    with pytest.raises(ValueError, match="starting_batch_size=0 must be a positive integer"):
        find_executable_batch_size(lambda batch_size: None, starting_batch_size=0)


def test_closure_style_gets_the_prediction_with_model_and_optimizer_passed(job):
    """Accelerate's canonical style: the function closes over model and optimizer. Passed to the
    decorator, they give the one-attempt answer."""
    model, opt, budget = job
    calls = []

    def train(batch_size):
        calls.append(batch_size)
        for _ in range(2):
            train_step(model, batches(seq=32)(batch_size), opt)
        return batch_size

    predicted = find_executable_batch_size(
        train, starting_batch_size=1024, make_batch=batches(seq=32), model=model, optimizer=opt, cache=False
    )
    with simulated_memory_limit(budget, count=[model, opt]) as mem:
        used = predicted()
    assert 0.95 * 30 <= used <= 30 and calls == [used] and mem.out_of_memory_errors == 0
    assert predicted.batch_size_result.batch_size == used


def test_closure_style_without_model_warns_naming_what_to_pass():
    model = PlainStack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def train(batch_size):
        calls.append(batch_size)
        return model, opt

    unpredicted = find_executable_batch_size(
        train, starting_batch_size=4, make_batch=lambda n: make_batch("plain", batch_size=n)
    )
    with pytest.warns(
        UserWarning,
        match=r"no model, optimizer .*train closes over model and opt: pass model=model, optimizer=opt "
        r"to the decorator: no prediction, retrying from 4",
    ):
        unpredicted()
    assert calls == [4] and unpredicted.batch_size_result is None


def _always_out_of_memory(calls):
    def run(batch_size):
        calls.append(batch_size)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return run


def _reducer(sizes):
    """A reduce_batch_size_fn returning ``sizes`` in turn; past them it fails the test (the old decorator looped forever)."""
    it = iter(sizes)

    def reduce():
        try:
            return next(it)
        except StopIteration:
            raise AssertionError("reduce_batch_size_fn called again: the retries did not stop") from None

    return reduce


@pytest.mark.parametrize(
    "sizes, error, match",
    [
        (
            [-3],
            ValueError,
            r"reduce_batch_size_fn returned a negative size, and batch size 8 ran out of memory: each call must return a smaller",
        ),
        (
            [6, 6],
            ValueError,
            r"reduce_batch_size_fn returned 6 after returning 6 on its previous call, and batch size 6 ran out "
            r"of memory: each call must return a smaller",
        ),
        (
            [6, 9],
            ValueError,
            r"reduce_batch_size_fn returned 9 after returning 6 on its previous call, and batch size 6 ran out",
        ),
        # New-user trial: a hook above the start said "returned 32 after 32", not the size that failed (16).
        (
            [32, 32],
            ValueError,
            r"returned 32 after returning 32 on its previous call, and batch size 8 ran out of memory",
        ),
        (
            [4.5],
            TypeError,
            r"reduce_batch_size_fn returned 4.5 \(float\); it must return the next batch size as an int",
        ),
        ([6, 3, 0], RuntimeError, r"No executable batch size found, reached zero"),  # Accelerate's end
        ([np.int64(6), np.int64(3), 0], RuntimeError, r"reached zero"),  # numpy's integers are integers
    ],
)
def test_a_reduce_hook_that_would_loop_forever_is_refused(sizes, error, match):
    calls = []
    run = find_executable_batch_size(
        _always_out_of_memory(calls), starting_batch_size=8, reduce_batch_size_fn=_reducer(sizes)
    )
    with pytest.warns(UserWarning, match="no make_batch"), pytest.raises(error, match=match):
        run()
    assert calls[0] == 8 and all(b < a for a, b in itertools.pairwise(calls))


def test_a_reduce_hook_counting_down_from_the_start_skips_sizes_above_the_prediction():
    """The hook counts from starting_batch_size while the prediction started lower: its sizes at or
    above the one that ran out of memory are skipped, not run."""
    calls, hook = [], {"size": 1024}

    def reduce():
        hook["size"] //= 2
        return hook["size"]

    @find_executable_batch_size(
        starting_batch_size=1024,
        reduce_batch_size_fn=reduce,
        mode="eval",
        budget="4MiB",
        make_batch=lambda n: make_batch("plain", batch_size=n),
        cache=False,
    )
    def evaluate(batch_size, model):
        calls.append(batch_size)
        if batch_size > 20:  # the function needs more than make_batch builds (longer batches)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    used = evaluate(PlainStack())
    predicted = evaluate.batch_size_result.batch_size
    assert 20 < predicted < 512 and calls[0] == predicted  # the hook's 512 (and 256 when above) never ran
    assert calls[1:] == [s for s in (256, 128, 64, 32, 16) if s < predicted] and used == 16


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mode": "Train"}, ValueError, r"mode='Train' is not one of 'train', 'eval'"),
        ({"mode": "eval", "model": "llama"}, TypeError, r"model=str must be a torch.nn.Module"),
        ({"optimizer": object()}, TypeError, r"optimizer=object must be a torch.optim.Optimizer"),
        ({"starting_batch_size": -4}, ValueError, r"starting_batch_size=-4 must be a positive integer"),
        ({"reduce_batch_size_fn": 8}, TypeError, r"reduce_batch_size_fn=8 must be callable"),
        # New-user trial: a hook taking the batch size failed with a bare TypeError at the first OOM only.
        (
            {"reduce_batch_size_fn": lambda bs: bs // 2},
            TypeError,
            r"reduce_batch_size_fn\(bs\) cannot be called with no arguments .*Accelerate's find_executable_batch_size calls it with none",
        ),
    ],
)
def test_bad_arguments_are_refused_when_decorating(kwargs, error, match):
    with pytest.raises(error, match=match):
        find_executable_batch_size(**kwargs)  # the decorator-with-arguments form: refused before any function
    with pytest.raises(error, match=match):
        find_executable_batch_size(lambda batch_size: None, **kwargs)


def test_positional_and_keyword_mixes():
    with pytest.raises(TypeError, match=r"function=64 must be callable.*did you mean starting_batch_size=64"):
        find_executable_batch_size(64)
    calls = []
    run = find_executable_batch_size(_always_out_of_memory(calls), 3)  # Accelerate's positional starting size
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="reached zero"):
        run()
    assert calls == [3, 2, 1]

    @find_executable_batch_size(starting_batch_size=2)
    def takes_rest(batch_size, *rest, scale=1):
        return batch_size * scale, rest

    with pytest.warns(UserWarning):
        assert takes_rest("a", "b", scale=3) == (6, ("a", "b"))  # *args: any count of positional arguments fits
    with pytest.raises(TypeError, match="Batch size was passed into `takes_rest`"):
        takes_rest(batch_size=4)
