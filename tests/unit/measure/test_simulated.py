"""simulated_memory_limit: the real OutOfMemoryError at the allocation that passes the budget,
on real tensors and a real training step; nothing left behind."""

import gc

import pytest
import torch
from tiny import make_batch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from hf_memstack import measure_step, prepare_model, simulated_memory_limit
from hf_memstack.measure.simulated import current_limit, untracked
from hf_memstack.measure.step import backward, forward_loss, train_step


def test_raises_exactly_when_live_bytes_would_pass_the_budget():
    from accelerate.utils.memory import should_reduce_batch_size

    with simulated_memory_limit(1000, count=()) as mem:
        a = torch.empty(400, dtype=torch.uint8)
        b = torch.empty(150, dtype=torch.float32)  # 600 bytes: exactly at the budget is allowed
        assert (mem.live_bytes, mem.peak_bytes) == (1000, 1000)
        view = a[:10]  # a view shares its base's storage: no new bytes
        assert mem.live_bytes == 1000
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(1, dtype=torch.uint8)
        assert info.value.requested_bytes == 1 and should_reduce_batch_size(info.value)  # Accelerate retries on it
        del a  # the view still holds the storage
        assert mem.live_bytes == 1000
        del view
        assert mem.live_bytes == 600
        c = torch.empty(400, dtype=torch.uint8)  # the freed bytes are usable again
        assert (mem.live_bytes, mem.peak_bytes, mem.out_of_memory_errors) == (1000, 1000, 1)
    del b, c


def test_counts_what_exists_at_entry():
    weights = torch.zeros(100)  # 400 bytes
    with (
        pytest.raises(torch.OutOfMemoryError, match="counted at entry take 400 B"),
        simulated_memory_limit(399, count=[weights]),
    ):
        pass
    with simulated_memory_limit(500, count=[weights]) as mem:
        assert mem.live_bytes == 400
        with pytest.raises(torch.OutOfMemoryError):
            torch.zeros(26)
    with simulated_memory_limit("1GiB") as mem:  # count="all": every CPU tensor alive now
        assert mem.live_bytes >= 400


def test_out_of_memory_mid_backward_on_a_real_model(load_model):
    model = prepare_model(load_model("llama"), "fp32")
    batch = make_batch("llama", batch_size=8, seq=32)
    with simulated_memory_limit("1GiB", count=[model]) as mem:
        loss = forward_loss(model, batch)
        after_forward = mem.peak_bytes
        backward(loss)
        full = mem.peak_bytes
    assert full > after_forward
    model.zero_grad(set_to_none=True)
    del loss
    budget = (after_forward + full) // 2
    with simulated_memory_limit(budget, count=[model]) as mem:
        loss = forward_loss(model, batch)  # the forward fits
        with pytest.raises(torch.OutOfMemoryError, match="Simulated device out of memory"):
            backward(loss)  # raised by an allocation inside autograd's backward
    assert mem.out_of_memory_errors == 1


def test_a_caught_error_leaves_nothing_counted(load_model):
    """After the error is caught, the failed step's tensors are gone without a garbage collection
    (no reference cycle through the raising frame keeps them), as on a GPU."""
    model = prepare_model(load_model("llama"), "fp32")
    batch = make_batch("llama", batch_size=64, seq=32)
    gc.collect()
    gc.disable()
    try:
        with simulated_memory_limit("2MiB", count=[model]) as mem:
            before = mem.live_bytes
            try:
                forward_loss(model, batch)
            except torch.OutOfMemoryError:
                pass
            after = mem.live_bytes
    finally:
        gc.enable()
    assert mem.out_of_memory_errors == 1 and after == before


def test_composes_with_autocast_and_checkpointing(load_model):
    """Under bf16 autocast and activation checkpointing, the limit sees the same bytes as the meter
    (PyTorch's MemTracker): a step fits a budget of exactly its peak and fails one byte below."""
    model = prepare_model(load_model("llama"), "bf16+ckpt")
    opt = torch.optim.AdamW(model.parameters())
    batch = make_batch("llama", batch_size=4, seq=32)
    train_step(model, batch, opt)  # the optimizer state exists, as in every later step
    peak = measure_step(model, batch, opt, timed=False).peak_bytes
    with simulated_memory_limit(peak, count=[model, opt]) as mem:
        train_step(model, batch, opt)
    assert mem.peak_bytes == peak and mem.out_of_memory_errors == 0
    with pytest.raises(torch.OutOfMemoryError), simulated_memory_limit(peak - 1, count=[model, opt]):
        train_step(model, batch, opt)


def test_leaves_nothing_behind():
    with pytest.raises(torch.OutOfMemoryError), simulated_memory_limit(100, count=()) as mem:
        kept = torch.empty(100, dtype=torch.uint8)
        torch.empty(1, dtype=torch.uint8)
    assert _get_current_dispatch_mode_stack() == [] and current_limit() is None
    live = mem.live_bytes
    del kept
    gc.collect()
    assert mem.live_bytes == live  # no weak reference left to call back into the finished limit
    big = torch.empty(10_000, dtype=torch.uint8)  # nothing limits allocations any more
    assert big.numel() == 10_000


def test_untracked_copies_do_not_count():
    with simulated_memory_limit(1000, count=()) as mem:
        with untracked():
            host_copy = torch.empty(5000, dtype=torch.uint8)
        assert mem.live_bytes == 0 and current_limit() is not None and current_limit().budget == 1000
        del host_copy
        assert mem.live_bytes == 0


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"budget": "lots"}, ValueError, "budget='lots' is not a size"),
        ({"budget": 0}, ValueError, "budget=0 must be positive"),
        ({"budget": 100, "count": "none"}, ValueError, "count='none': pass 'all' or an iterable"),
        ({"budget": 100, "count": [3]}, TypeError, "count=3 .int.: expected 'all' or modules"),
        ({"budget": 100, "device": "tpu"}, ValueError, "device='tpu' is not one of"),
        ({"budget": 100, "count": 5}, TypeError, r"count=5 \(int\): expected 'all', a model, an optimizer or a tensor"),
        ({"budget": 100, "count": None}, TypeError, r"count=None \(NoneType\)"),
    ],
)
def test_bad_arguments(kwargs, error, fragment):
    with pytest.raises(error, match=fragment), simulated_memory_limit(**kwargs):
        pass
    assert _get_current_dispatch_mode_stack() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_a_device_that_is_not_here_is_refused():
    """device='cuda' without a GPU used to count nothing and limit nothing, silently."""
    with (
        pytest.raises(RuntimeError, match=r"device='cuda'\): no cuda device is available here.*use device='cpu'"),
        simulated_memory_limit(16, device="cuda"),
    ):
        pass
    assert _get_current_dispatch_mode_stack() == []


def test_counting_a_model_that_lives_elsewhere_is_refused():
    from tiny import PlainStack

    with torch.device("meta"):
        model = PlainStack()
    with (
        pytest.raises(
            ValueError, match=r"the 22 tensors of count= live on 'meta', none on 'cpu'.*move the tensors to 'cpu'"
        ),
        simulated_memory_limit(16, count=[model]),
    ):
        pass
    assert _get_current_dispatch_mode_stack() == []


def test_a_limit_that_saw_nothing_on_its_device_says_so():
    with (
        pytest.warns(
            UserWarning, match=r"device='cpu'\) counted nothing: no tensor lived on 'cpu' while operators ran on 'meta'"
        ),
        simulated_memory_limit(16, count=()) as mem,
    ):
        torch.ones(1000, device="meta") * 2  # 4 KB that a 16-byte device would have refused, were they counted
    assert mem.peak_bytes == 0


def test_count_takes_a_single_model_optimizer_or_tensor(load_model):
    """count=model (no list) used to fail with "'LlamaForCausalLM' object is not iterable"."""
    model = load_model("llama")
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, make_batch("llama"), opt)
    weights = sum(p.nbytes for p in model.parameters()) + sum(
        p.grad.nbytes for p in model.parameters() if p.grad is not None
    )
    weights += sum(b.nbytes for b in model.buffers())
    state = sum(v.nbytes for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    for count, expected in (
        (model, weights),
        (opt, state),
        (next(model.parameters()), next(model.parameters()).nbytes),
        ([model, opt], weights + state),
    ):
        with simulated_memory_limit("1GiB", count=count) as mem:
            assert mem.live_bytes == expected, type(count).__name__
