"""find_batch_size on vision-language batches that are not batch-major (issue 40): Qwen2-VL's
``pixel_values`` hold every image's patches (``[16 * n, 1176]``), so no first dimension is n. The
finder asks ``make_batch(n)`` for n samples and counts them by ``input_ids``/``labels``; it refused
such batches ("their first dimension must be exactly 1")."""

from __future__ import annotations

import pytest
import torch
from tiny_vlm import tiny_vlm, vlm_batch

from hf_memstack import find_batch_size, prepare_model, simulated_memory_limit
from hf_memstack.batch_size.probe import batch_signature
from hf_memstack.measure.step import train_step


def _qwen2_vl_batches(n: int) -> dict[str, torch.Tensor]:
    return vlm_batch("qwen2_vl", n, seed=n)


def _fits(model, opt, n: int, budget: int) -> bool:
    """A steady-state step at batch size ``n`` stays within ``budget``, counted as the finder counts."""
    with simulated_memory_limit("64GiB", count=[model, opt]) as mem:
        train_step(model, _qwen2_vl_batches(n), opt)
    return mem.peak_bytes <= budget


def _bisect(model, opt, budget: int, high: int) -> int:
    """The largest batch size whose step fits ``budget``, by bisection over real steps (1 fits, ``high`` does not)."""
    low = 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _fits(model, opt, mid, budget) else (low, mid)
    return low


def test_patch_major_pixel_batches_are_sized_as_a_bisection_sizes_them():
    model = prepare_model(tiny_vlm("qwen2_vl"), "fp32")
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, _qwen2_vl_batches(2), opt)  # the optimizer's state, as during training
    assert _qwen2_vl_batches(3)["pixel_values"].shape == (16 * 3, 1176)
    with simulated_memory_limit("64GiB", count=[model, opt]) as mem:
        train_step(model, _qwen2_vl_batches(6), opt)
    budget = mem.peak_bytes  # 6 samples fit by construction; the bisection says where it ends
    assert not _fits(model, opt, 12, budget)
    best = _bisect(model, opt, budget, high=12)

    result = find_batch_size(
        model, _qwen2_vl_batches, torch.optim.AdamW(model.parameters()), budget=budget, cache=False
    )
    assert 0.95 * best <= result.batch_size <= best, result.summary()
    assert result.peak_bytes <= budget
    assert any(p.batch_size == result.batch_size and p.fits for p in result.probes)  # the answer was run


def test_a_sample_of_larger_images_is_another_cache_key():
    """The cache key holds a patch-major tensor's rows per sample: a job with 4 x larger images
    does not reuse the answer of smaller ones (batch-major tensors keep their key)."""
    small = _qwen2_vl_batches(1)
    large = {**small, "pixel_values": torch.randn(64, 1176), "image_grid_thw": torch.tensor([[1, 8, 8]])}
    assert batch_signature(small) != batch_signature(large)
    text = {k: small[k] for k in ("input_ids", "labels")}
    assert batch_signature(text) == [["input_ids", "torch.int64", 24], ["labels", "torch.int64", 24]]


@pytest.mark.parametrize(
    "make, fragments",
    [
        # Nothing counts the samples: every tensor must have n rows, and the message names the field.
        (
            lambda n: {"pixel_values": torch.randn(16 * n, 8), "x": torch.randn(n, 3)},
            ("batch['pixel_values'] (16, 8)", "exactly 1", "input_ids, labels or attention_mask", "make_batch(n)"),
        ),
        # The counting fields hold another number of samples: named, whatever the pixels hold.
        (lambda n: _qwen2_vl_batches(n + 1), ("batch['input_ids'] (2, 24)", "batch['labels'] (2, 24)", "exactly 1")),
    ],
)
def test_a_batch_of_another_sample_count_is_refused_naming_the_field(make, fragments):
    model = prepare_model(tiny_vlm("qwen2_vl"), "fp32")
    with pytest.raises(ValueError) as error:
        find_batch_size(model, make, torch.optim.AdamW(model.parameters()), budget="1GiB", cache=False)
    for fragment in fragments:
        assert fragment in str(error.value)
