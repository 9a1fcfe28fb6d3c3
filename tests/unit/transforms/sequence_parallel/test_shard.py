"""``shard_batch``: the targets shifted on the whole rows (-100 at a row's end and before a packed
sample's start), the whole batch's count, a tail that N does not divide padded as a sample of its
own, each rank's contiguous slice - and the batches it refuses."""

from __future__ import annotations

import pytest
import torch

from hf_memstack.data import PackedCollator
from hf_memstack.transforms.sequence_parallel import SequenceShardCollator, shard_batch


def _row(values: list[int]) -> torch.Tensor:
    return torch.tensor([values])


def test_targets_are_shifted_on_the_whole_row_and_each_rank_gets_its_slice():
    ids = _row([10, 11, 12, 13, 14, 15, 16, 17])
    labels = _row([-100, 11, 12, 13, 14, 15, 16, 17])
    parts = [shard_batch({"input_ids": ids, "labels": labels}, sp_rank=r, sp_size=2) for r in range(2)]
    assert parts[0]["input_ids"].tolist() == [[10, 11, 12, 13]]
    assert parts[1]["input_ids"].tolist() == [[14, 15, 16, 17]]
    # token i predicts label i + 1: rank 0's last token predicts rank 1's first label
    assert parts[0]["shift_labels"].tolist() == [[11, 12, 13, 14]]
    assert parts[1]["shift_labels"].tolist() == [[15, 16, 17, -100]]
    assert parts[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    for part in parts:
        assert part["labels"].tolist() == part["shift_labels"].tolist()
        assert all(t.is_contiguous() for t in part.values())
        assert int(part["num_items_in_batch"]) == 7  # 11..17: every rank counts the whole batch
        assert "attention_mask" not in part


def test_a_packed_samples_first_token_is_not_predicted_from_the_sample_before():
    ids = _row([10, 11, 12, 20, 21, 22, 23, 24])
    positions = _row([0, 1, 2, 0, 1, 2, 3, 4])
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}
    parts = [shard_batch(batch, sp_rank=r, sp_size=2) for r in range(2)]
    whole = torch.cat([p["shift_labels"] for p in parts], dim=1)
    assert whole.tolist() == [[11, 12, -100, 21, 22, 23, 24, -100]]
    assert torch.cat([p["position_ids"] for p in parts], dim=1).tolist() == positions.tolist()
    assert int(parts[0]["num_items_in_batch"]) == 6


def test_a_row_n_does_not_divide_gets_a_tail_sample_of_pads_never_learnt():
    ids = _row([10, 11, 12, 13, 14, 15, 16])
    parts = [
        shard_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank=r, sp_size=4, pad_token_id=0) for r in range(4)
    ]
    assert [p["input_ids"].shape[1] for p in parts] == [2, 2, 2, 2]
    assert torch.cat([p["input_ids"] for p in parts], dim=1).tolist() == [[10, 11, 12, 13, 14, 15, 16, 0]]
    assert torch.cat([p["position_ids"] for p in parts], dim=1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 0]]
    assert torch.cat([p["shift_labels"] for p in parts], dim=1).tolist() == [[11, 12, 13, 14, 15, 16, -100, -100]]
    assert int(parts[0]["num_items_in_batch"]) == 6


def test_without_labels_only_the_inputs_are_sliced_and_an_all_ones_mask_is_dropped():
    ids = torch.arange(12).view(2, 6)
    part = shard_batch({"input_ids": ids, "attention_mask": torch.ones(2, 6)}, sp_rank=1, sp_size=3)
    assert set(part) == {"input_ids", "position_ids"}
    assert part["input_ids"].tolist() == [[2, 3], [8, 9]]
    assert part["position_ids"].tolist() == [[2, 3], [2, 3]]


@pytest.mark.parametrize(
    ("batch", "kwargs", "match"),
    [
        ({"attention_mask": torch.tensor([[0, 1, 1, 1]])}, {}, r"padded \(attention_mask has zeros\).*PackedCollator"),
        ({"token_type_ids": torch.zeros(1, 4)}, {}, r"keys \['token_type_ids'\] would not be sliced"),
        ({"labels": torch.zeros(1, 3)}, {}, r"labels must be a tensor as wide as input_ids \(4 tokens\)"),
        ({}, {"sp_rank": 2}, r"sp_rank=2 must be from 0 to 1"),
        ({}, {"sp_size": 0}, r"sp_size=0 must be a positive integer"),
    ],
    ids=["padding", "unknown_key", "width", "rank", "size"],
)
def test_batches_that_cannot_be_sharded_are_refused(batch, kwargs, match):
    arguments = {"sp_rank": 0, "sp_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        shard_batch({"input_ids": torch.arange(4)[None], **batch}, **arguments)


def test_the_collator_shards_what_the_packed_collator_makes():
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12]}]
    full = PackedCollator()([{"input_ids": features[0]["input_ids"] + features[1]["input_ids"]}])
    parts = [SequenceShardCollator(PackedCollator(flatten=True), sp_rank=r, sp_size=2)(features) for r in range(2)]
    assert torch.cat([p["input_ids"] for p in parts], dim=1).tolist() == full["input_ids"].tolist()
    assert torch.cat([p["position_ids"] for p in parts], dim=1).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert torch.cat([p["shift_labels"] for p in parts], dim=1).tolist() == [[6, 7, -100, 9, 10, 11, 12, -100]]
