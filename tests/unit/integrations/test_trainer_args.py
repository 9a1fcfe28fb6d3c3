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


@pytest.mark.filterwarnings("ignore:policy.precision='bf16' on a CPU without:UserWarning")
def test_the_finder_probes_pure_bf16_with_the_optimizer_that_trains(tmp_path, monkeypatch):
    """A trial: under weights:bf16 the finder probed with torch.optim.AdamW, so the library warned
    about its own probe ("without stochastic rounding") and measured another optimizer's step."""
    import warnings

    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator

    import hf_memstack.batch_size as finder
    from hf_memstack import prepare_model
    from hf_memstack.integrations.trainer import training_arguments
    from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    model = prepare_model(LlamaForCausalLM(config).to(torch.bfloat16).train(), "bf16+weights:bf16")
    rows = [list(range(3 + i % 5, 19 + i % 5)) for i in range(16)]
    ds = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    optimizers = []
    real = finder.find_batch_size
    monkeypatch.setattr(
        finder, "find_batch_size", lambda m, mb, opt, **kw: optimizers.append(opt) or real(m, mb, opt, **kw)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        training_arguments(
            model,
            output_dir=str(tmp_path),
            train_dataset=ds,
            data_collator=default_data_collator,
            budget="256MiB",
            report_to=[],
        )
    assert [type(o) for o in optimizers] == [BF16AdamW]
    rounding = [str(w.message) for w in caught if "without stochastic rounding" in str(w.message)]
    assert not rounding, rounding
