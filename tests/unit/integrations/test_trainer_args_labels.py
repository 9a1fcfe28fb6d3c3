"""training_arguments measures the share of positions that carry a label (the rows loss:chunked's
head runs over) from the dataset and collator it is given, and says it beside the finder's batch
size; data with one label a row, or none it can read, makes no claim and changes nothing."""

from __future__ import annotations

import pytest

WORDS = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()


def _pairs() -> list[tuple[str, str]]:
    # Prompts of 5..9 words, responses of 1..3: most positions are prompt, masked.
    return [
        (
            " ".join(WORDS[(i + j) % 18] for j in range(5 + i % 5)),
            " ".join(WORDS[(3 * i + j) % 18] for j in range(1 + i % 3)),
        )
        for i in range(30)
    ]


def _rows(tok, *, labels: bool) -> list[dict]:
    rows = []
    for prompt, response in _pairs():
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"]
        row = {"input_ids": p + r, "attention_mask": [1] * (len(p) + len(r)), "text": prompt}
        if labels:
            row["labels"] = [-100] * len(p) + r
        rows.append(row)
    return rows


def _printed(load_model, tok, tmp_path, capsys, dataset, collator, arch: str = "llama") -> str:
    from hf_memstack import prepare_model
    from hf_memstack.integrations.trainer import training_arguments

    model = prepare_model(load_model(arch), "fp32+loss:chunked" if arch == "llama" else "fp32")
    capsys.readouterr()
    training_arguments(
        model, output_dir=str(tmp_path), train_dataset=dataset, data_collator=collator, budget="256MiB", report_to=[]
    )
    return capsys.readouterr().out


def test_prompt_masked_rows_say_their_label_fraction(load_model, word_tokenizer, tmp_path, capsys):
    import datasets
    from transformers import DataCollatorForSeq2Seq

    rows = _rows(word_tokenizer, labels=True)
    # Hand count (one token a word): the response words carry labels; every token but a row's last predicts one.
    labelled = sum(len(r.split()) for _, r in _pairs())
    positions = sum(len(p.split()) + len(r.split()) - 1 for p, r in _pairs())
    expected = labelled / positions
    assert expected < 0.4
    printed = _printed(
        load_model,
        word_tokenizer,
        tmp_path,
        capsys,
        datasets.Dataset.from_list(rows),
        DataCollatorForSeq2Seq(word_tokenizer),  # Trainer drops "text" first: the collator would choke on it
    )
    assert "from the batch-size finder" in printed
    assert f"label fraction {expected:.2f} measured over {len(rows)} rows" in printed, printed


def test_the_collators_labels_and_no_labels(load_model, word_tokenizer, tmp_path, capsys):
    """Rows without labels: DataCollatorForLanguageModeling labels every token (1.00); a
    classifier's collator gives one label a row, and nothing about labels is said."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    rows = [{k: v for k, v in r.items() if k != "text"} for r in _rows(word_tokenizer, labels=False)]
    lm = _printed(
        load_model, word_tokenizer, tmp_path, capsys, rows, DataCollatorForLanguageModeling(word_tokenizer, mlm=False)
    )
    assert f"label fraction 1.00 measured over {len(rows)} rows" in lm, lm
    classes = [{**r, "labels": i % 2} for i, r in enumerate(rows)]
    cls = _printed(
        load_model, word_tokenizer, tmp_path, capsys, classes, DataCollatorWithPadding(word_tokenizer), "bert"
    )
    assert "from the batch-size finder" in cls and "label fraction" not in cls


@pytest.mark.parametrize("bad", [[{"input_ids": [3, 4, 5], "labels": [-100, -100, -100]}] * 4])
def test_unmeasurable_data_makes_no_claim(load_model, word_tokenizer, tmp_path, capsys, bad):
    """Every label masked: the finder still answers (the loss is Trainer's problem to report), no fraction is said."""
    from transformers import DataCollatorForSeq2Seq

    printed = _printed(load_model, word_tokenizer, tmp_path, capsys, bad, DataCollatorForSeq2Seq(word_tokenizer))
    assert "from the batch-size finder" in printed and "label fraction" not in printed
