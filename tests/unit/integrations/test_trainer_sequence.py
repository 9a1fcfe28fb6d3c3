"""sp:N on the Trainer path, in one process: the collator's slice, the dropped right padding, and what
the arguments cannot honour (refused before anything trains, each naming its fix). The training
itself runs on 2 gloo ranks: tests/distributed/test_sequence_parallel_trainer.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from tiny import tiny_llama

from hf_memstack import prepare_model
from hf_memstack.transforms.sequence_parallel import drop_right_padding, shard_batch


@pytest.fixture
def fake_world() -> Iterator[int]:
    """A fake process group of 2 ranks, this process rank 0 (prepare_model's sp:2 needs one)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield 2
    finally:
        dist.destroy_process_group()


def _padded() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return {"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100), "attention_mask": mask}


def test_a_right_padding_mask_over_unlabelled_pads_is_dropped():
    batch = _padded()
    out = drop_right_padding(batch)
    assert "attention_mask" not in out and torch.equal(out["input_ids"], batch["input_ids"])
    assert "attention_mask" in batch  # the caller's batch is left as it was
    ones = drop_right_padding({**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    assert "attention_mask" not in ones


@pytest.mark.parametrize("case", ["labelled pad", "left padding"])
def test_a_mask_that_changes_the_loss_is_kept_for_shard_batch_to_refuse(case):
    batch = _padded()
    if case == "labelled pad":
        batch["labels"] = batch["input_ids"].clone()
    else:
        batch["attention_mask"] = batch["attention_mask"].flip(-1)
    out = drop_right_padding(batch)
    assert torch.equal(out["attention_mask"], batch["attention_mask"])
    with pytest.raises(ValueError, match="padded"):
        shard_batch(out, sp_rank=0, sp_size=2)


def test_the_trainer_collator_gives_this_ranks_slice_without_the_group_count():
    from hf_memstack.integrations.trainer_sequence import GroupShardCollator

    def collate(features):
        return _padded()

    collator = GroupShardCollator(collate, sp_rank=1, sp_size=2, pad=0)
    got = collator([{}])
    want = shard_batch(drop_right_padding(_padded()), sp_rank=1, sp_size=2)
    assert "num_items_in_batch" not in got  # Trainer counts the step's targets over every rank itself
    assert got.keys() == want.keys() - {"num_items_in_batch"}
    for key, value in got.items():
        assert torch.equal(value, want[key]), key
    assert "attention_mask" not in collator.whole([{}])


def test_the_arguments_an_sp_run_cannot_honour_are_refused_together(fake_world, tmp_path):
    from transformers import TrainingArguments

    from hf_memstack.integrations.trainer import check_training_arguments

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        eval_strategy="steps",
        label_smoothing_factor=0.1,
        average_tokens_across_devices=False,
        train_sampling_strategy="batch_rebalance",
        report_to=[],
    )
    with pytest.raises(ValueError) as e:
        check_training_arguments(model, args)
    message = str(e.value)
    for fix in (
        "set eval_strategy='no'",
        "label_smoothing_factor=0.1",
        "set it True (the default)",
        "use 'random', 'sequential' or 'group_by_length'",
    ):
        assert fix in message


def test_plain_arguments_pass_an_sp_model(fake_world, tmp_path):
    from transformers import TrainingArguments

    from hf_memstack.integrations.trainer import check_training_arguments

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    assert check_training_arguments(model, TrainingArguments(output_dir=str(tmp_path), use_cpu=True)) == []


def test_the_batch_size_finder_is_refused_under_sp(fake_world, tmp_path):
    from hf_memstack.integrations.trainer import training_arguments

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    with pytest.raises(ValueError, match=r"budget='1GiB'\) with sp:2.*per_device_train_batch_size"):
        training_arguments(model, output_dir=str(tmp_path), budget="1GiB")


def test_global_batch_size_counts_one_batch_per_sequence_group(fake_world, tmp_path):
    from hf_memstack.integrations.trainer import training_arguments

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    args = training_arguments(
        model, output_dir=str(tmp_path), per_device_train_batch_size=2, global_batch_size=8, report_to=[]
    )
    assert args.gradient_accumulation_steps == 4  # 2 ranks, 1 group: 2 rows x 1 group x 4 = 8


def test_a_callback_that_finds_no_trainer_names_add_memstack_callback(fake_world):
    from hf_memstack.integrations.trainer_sequence import refuse_uninstalled

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    with pytest.raises(ValueError, match=r"sp:2: MemstackCallback.*add_memstack_callback\(trainer\)"):
        refuse_uninstalled(None, model)
    refuse_uninstalled(None, tiny_llama())  # nothing to do without sp:N
