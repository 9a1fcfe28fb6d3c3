"""PackedCollator: positions restart per sample, the first label of every sample and the padding
are -100, no attention mask, and a row as wide as asked."""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_memstack.data import PackedCollator, pack_dataset


def test_rows_restart_positions_mask_each_samples_first_label_and_pad_with_a_segment():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]}, {"input_ids": [4, 3], "labels": [-100, 3]}]
    batch = PackedCollator(pad_token_id=0)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9], [-100, 3, -100, -100, -100]]


def test_flatten_is_transformers_data_collator_with_flattening():
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [1, 2, 3, 4]}]
    ours = PackedCollator(flatten=True)(pack_dataset(samples, 5))
    theirs = DataCollatorWithFlattening(return_position_ids=True)(
        [samples[2], samples[0], samples[1]], return_tensors="pt"
    )
    assert {k: v.tolist() for k, v in ours.items()} == {k: theirs[k].tolist() for k in ours}


def test_pad_to_gives_one_width_and_refuses_a_longer_row():
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]
    assert PackedCollator(pad_to=6)(rows)["input_ids"].shape == (2, 6)
    assert PackedCollator(pad_to_multiple_of=4)(rows)["input_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match="a row holds 3 tokens, more than pad_to=2"):
        PackedCollator(pad_to=2)(rows)


@pytest.mark.parametrize(
    "feature, match",
    [
        ({"text": "hello"}, "feature 0 has no 'input_ids'"),
        ({"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}, "padding inside it"),
        ({"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}, r"seq_lengths \[2, 2\] \(sum 4\)"),
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "3 input_ids, 2 labels"),
    ],
)
def test_bad_features_are_refused_with_the_fix(feature, match):
    with pytest.raises(ValueError, match=match):
        PackedCollator()([feature])


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match=r"PackedCollator.pad_to=0 must be a positive integer"):
        PackedCollator(pad_to=0)
    with pytest.raises(TypeError, match="pad_token_id"):
        PackedCollator(pad_token_id="0")  # type: ignore[arg-type]


def test_tensors_in_features_are_accepted():
    batch = PackedCollator()([{"input_ids": torch.tensor([3, 4, 5]), "seq_lengths": torch.tensor([1, 2])}])
    assert batch["position_ids"].tolist() == [[0, 0, 1]]
