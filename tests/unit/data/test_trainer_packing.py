"""Packed rows through transformers.Trainer: training_arguments keeps the rows' seq_lengths (Trainer
drops the columns the forward does not take, which would train every row as one sample whose parts
attend to each other), refuses the settings that would lose them, and the callback's verify compares
the packed row with its samples alone."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def packed_rows():
    """Samples of 3 to 12 random tokens packed into rows of 32 (pack_dataset, a datasets.Dataset)."""
    import datasets

    from hf_memstack.data import pack_dataset

    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(3, 128, (3 + i % 10,), generator=g).tolist()} for i in range(40)]
    return pack_dataset(datasets.Dataset.from_list(samples), 32)


def _segments(position_ids: torch.Tensor) -> list[list[int]]:
    from hf_memstack.data import segment_lengths

    return segment_lengths(position_ids)


def test_trainer_batches_keep_each_rows_samples_apart(load_model, packed_rows, tmp_path):
    from transformers import Trainer

    from hf_memstack import prepare_model
    from hf_memstack.data import PackedCollator
    from hf_memstack.integrations.trainer import MemstackCallback, training_arguments

    model = prepare_model(load_model("llama"), "fp32")
    collator = PackedCollator(pad_token_id=0)
    args = training_arguments(
        model,
        output_dir=str(tmp_path),
        train_dataset=packed_rows,
        data_collator=collator,
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        seed=0,
    )
    assert args.remove_unused_columns is False
    callback = MemstackCallback()
    trainer = Trainer(model=model, args=args, train_dataset=packed_rows, data_collator=collator, callbacks=[callback])
    batch = next(iter(trainer.get_train_dataloader()))
    # Reference: the rows' own seq_lengths, from pack_dataset (the loader shuffles which rows come first).
    rows = {tuple(r) for r in packed_rows["seq_lengths"]}
    for segments in _segments(batch["position_ids"]):
        # A row's segments are its samples, then at most one padding segment up to the batch's width.
        samples = [r for r in rows if tuple(segments[: len(r)]) == r and len(segments) - len(r) <= 1]
        assert samples and len(samples[0]) > 1, (segments, sorted(rows)[:3])
    trainer.train()
    checks = {c.name: c for c in callback.first_step.verify.checks}
    assert "packing" in checks and checks["packing"].ok, callback.first_step.verify


def test_a_plain_trainer_keeps_the_boundaries_trainer_would_drop(load_model, packed_rows, tmp_path):
    """Trial finding (issue 22): TrainingArguments built by hand (remove_unused_columns=True, the
    default) dropped seq_lengths, and every packed row trained as one sample. pack_dataset's rows now
    carry position_ids too, which Trainer keeps for a forward that takes them."""
    from transformers import Trainer, TrainingArguments

    from hf_memstack import prepare_model
    from hf_memstack.data import PackedCollator

    model = prepare_model(load_model("llama"), "fp32")
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], use_cpu=True
    )
    assert args.remove_unused_columns
    trainer = Trainer(model=model, args=args, train_dataset=packed_rows, data_collator=PackedCollator(pad_token_id=0))
    batch = next(iter(trainer.get_train_dataloader()))
    rows = {tuple(r) for r in packed_rows["seq_lengths"]}
    for segments in _segments(batch["position_ids"]):
        assert any(tuple(segments[: len(r)]) == r and len(r) > 1 for r in rows), segments


def test_settings_that_would_merge_a_rows_samples_are_refused(load_model, packed_rows, tmp_path):
    from transformers import DataCollatorWithFlattening

    from hf_memstack import prepare_model
    from hf_memstack.data import PackedCollator
    from hf_memstack.integrations.trainer import training_arguments

    model = prepare_model(load_model("llama"), "fp32")
    # Rows built by hand with seq_lengths alone: Trainer's column removal would leave no boundary.
    bare = packed_rows.remove_columns("position_ids")
    with pytest.raises(ValueError, match=r"remove_unused_columns=True.*seq_lengths.*leave remove_unused_columns unset"):
        training_arguments(
            model,
            output_dir=str(tmp_path),
            train_dataset=bare,
            data_collator=PackedCollator(),
            per_device_train_batch_size=2,
            remove_unused_columns=True,
            report_to=[],
        )
    # Transformers' flattening collator reads input_ids and labels only: each packed row would be one sample.
    with pytest.raises(ValueError, match=r"data_collator=DataCollatorWithFlattening.*PackedCollator"):
        training_arguments(
            model,
            output_dir=str(tmp_path),
            train_dataset=packed_rows,
            data_collator=DataCollatorWithFlattening(),
            per_device_train_batch_size=2,
            report_to=[],
        )


def test_the_finder_never_picks_more_rows_than_the_dataset_has(load_model, packed_rows, tmp_path):
    from hf_memstack import prepare_model
    from hf_memstack.data import PackedCollator
    from hf_memstack.integrations.trainer import training_arguments

    model = prepare_model(load_model("llama"), "fp32")
    args = training_arguments(
        model,
        output_dir=str(tmp_path),
        train_dataset=packed_rows,
        data_collator=PackedCollator(),
        budget="256MiB",
        report_to=[],
    )
    assert 1 <= args.per_device_train_batch_size <= len(packed_rows)
