"""training_arguments' batch-size finder sizes the batches Trainer's loader builds, and says what it chose."""

from __future__ import annotations

import pytest


@pytest.fixture
def labelled(word_tokenizer):
    """Sentences of 6 to 24 words with a label, tokenized, the text column kept (Trainer drops it)."""
    import datasets

    texts = [" ".join(["the cat sat on a mat"] * (1 + i % 4)) for i in range(40)]
    ds = datasets.Dataset.from_dict({"text": texts, "label": [i % 3 for i in range(40)]})
    return ds.map(lambda r: word_tokenizer(r["text"]))


def test_training_arguments_probes_the_batches_trainer_runs(
    load_model, word_tokenizer, labelled, tmp_path, monkeypatch, capsys
):
    """Issue 18: the probes were built from one sample with every column, so a dataset that still
    holds its text (Trainer removes columns the model does not take before collating) broke the
    finder; and the batch it chose was logged at INFO, where nobody sees it."""
    from transformers import DataCollatorWithPadding, Trainer

    import hf_memstack.batch_size as finder
    from hf_memstack import prepare_model
    from hf_memstack.integrations.trainer import training_arguments

    shapes: list[tuple[int, tuple[int, ...]]] = []
    real = finder.find_batch_size

    def spy(model, make_batch, *args, **kwargs):  # the real finder, its batches recorded
        def recorded(n):
            batch = make_batch(n)
            shapes.append((n, tuple(batch["input_ids"].shape)))
            return batch

        return real(model, recorded, *args, **kwargs)

    monkeypatch.setattr(finder, "find_batch_size", spy)
    model = prepare_model(load_model("bert"), "fp32")
    collator = DataCollatorWithPadding(word_tokenizer)
    capsys.readouterr()
    args = training_arguments(
        model, output_dir=str(tmp_path), train_dataset=labelled, data_collator=collator, budget="64MiB", report_to=[]
    )
    printed = capsys.readouterr().out
    trainer = Trainer(model=model, args=args, train_dataset=labelled, data_collator=collator)
    widths = [batch["input_ids"].shape[1] for batch in trainer.get_train_dataloader()]
    assert shapes, "the finder built no batch"
    assert all(shape == (n, max(widths)) for n, shape in shapes), (shapes, sorted(set(widths)))
    assert (
        printed.count(f"per_device_train_batch_size={args.per_device_train_batch_size} from the batch-size finder") == 1
    ), printed
