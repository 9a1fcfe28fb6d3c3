"""measure_label_fraction on a real prompt/response dataset (word-level tokenizer: one token a
word, so the expected fraction is counted from the words, not from the code under test): the rows'
own labels, a padding collator, Transformers' LM collator, packed rows; bounded sampling; bad input."""

from __future__ import annotations

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
)

from hf_memstack.data import PackedCollator, measure_label_fraction, pack_dataset

WORDS = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
# Prompts of 3..9 words, responses of 1..4 words: about a third of the positions carry a label.
PAIRS = [
    (
        " ".join(WORDS[(i + j) % 18] for j in range(3 + i % 7)),
        " ".join(WORDS[(2 * i + j) % 18] for j in range(1 + i % 4)),
    )
    for i in range(40)
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *WORDS])}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def _rows(tok, *, labels: bool = True) -> list[dict]:
    """Prompt tokens masked, the response and its EOS learnt (as the recipe and TRL build them)."""
    out = []
    for prompt, response in PAIRS:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response + " [EOS]", add_special_tokens=False)["input_ids"]
        row = {"input_ids": p + r, "attention_mask": [1] * (len(p) + len(r))}
        if labels:
            row["labels"] = [-100] * len(p) + r
        out.append(row)
    return out


def _hand_count() -> float:
    # Every response word and the EOS are predicted from the token before them (the prompt is
    # never empty); every token but a row's last predicts a next one.
    labelled = sum(len(r.split()) + 1 for _, r in PAIRS)
    positions = sum(len(p.split()) + len(r.split()) + 1 - 1 for p, r in PAIRS)
    return labelled / positions


def test_rows_own_labels_match_the_hand_count(tok):
    found = measure_label_fraction(datasets.Dataset.from_list(_rows(tok)))
    assert found is not None
    assert found.fraction == pytest.approx(_hand_count(), abs=1e-12)
    assert 0.2 < found.fraction < 0.5  # a prompt-masked set, far from 1.0
    assert found.rows == len(PAIRS)
    assert "label fraction" in found.summary() and f"{len(PAIRS)} rows" in found.summary()


def test_padding_collator_does_not_dilute(tok):
    """Batches padded to their longest row (labels padded with -100), and to a fixed width: the same fraction."""
    rows = _rows(tok)
    for collator in (
        DataCollatorForSeq2Seq(tok, padding="longest"),
        DataCollatorForSeq2Seq(tok, padding="max_length", max_length=32),
    ):
        found = measure_label_fraction(rows, collator, batch_size=7)
        assert found is not None and found.fraction == pytest.approx(_hand_count(), abs=1e-12)


def test_language_modeling_collator_makes_the_labels(tok):
    """No labels in the rows: Transformers' LM collator labels every non-pad token, so all positions count."""
    rows = _rows(tok, labels=False)
    assert measure_label_fraction(rows) is None  # nothing to measure without the collator: no claim
    found = measure_label_fraction(rows, DataCollatorForLanguageModeling(tok, mlm=False), batch_size=8)
    assert found is not None and found.fraction == pytest.approx(1.0)


def test_packed_rows_with_and_without_their_collator(tok):
    rows = _rows(tok)
    packed = pack_dataset([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows], 32)
    labelled = sum(len(r.split()) + 1 for _, r in PAIRS)
    tokens = sum(len(p.split()) + len(r.split()) + 1 for p, r in PAIRS)
    expected = labelled / (tokens - len(packed))  # each packed row's last token predicts nothing
    assert len(packed) < len(rows)
    for collator in (None, PackedCollator(pad_token_id=1, pad_to=32)):
        found = measure_label_fraction(packed, collator)
        assert found is not None and found.fraction == pytest.approx(expected, abs=1e-12)


def test_shift_labels_rows(tok):
    rows = [{"input_ids": r["input_ids"], "shift_labels": r["labels"][1:] + [-100]} for r in _rows(tok)]
    found = measure_label_fraction(rows)
    assert found is not None and found.fraction == pytest.approx(_hand_count(), abs=1e-12)


def test_bounded_and_deterministic_sample(tok):
    rows = _rows(tok)
    read: list[int] = []

    class Counting(list):
        def __getitem__(self, i):
            read.append(i)
            return list.__getitem__(self, i)

    data = Counting(rows)
    first = measure_label_fraction(data, max_rows=8)
    assert len(read) == 8 and len(set(read)) == 8
    assert max(read) >= len(rows) // 2  # spread over the dataset, not only its head
    assert measure_label_fraction(data, max_rows=8) == first
    assert first is not None and first.rows == 8
    iterated = measure_label_fraction(iter(rows), max_rows=5)
    assert iterated is not None and iterated.rows == 5


def test_classifier_labels_make_no_claim(tok):
    rows = [{"input_ids": r["input_ids"], "labels": i % 2} for i, r in enumerate(_rows(tok))]
    assert measure_label_fraction(rows) is None
    # Through a padding collator the labels stay one per row: still no per-token labels.
    assert measure_label_fraction(rows, DataCollatorWithPadding(tok)) is None


@pytest.mark.parametrize(
    ("data", "error", "fragment"),
    [
        ([], ValueError, "empty"),
        ([{"text": "a"}], ValueError, "no 'input_ids'"),
        ([[1, 2, 3]], ValueError, "no 'input_ids'"),
        ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], ValueError, "2 labels for 3 input_ids"),
        ([{"input_ids": [1, 2, 3], "labels": [5, -100, -100]}], ValueError, "none of the 2 positions"),
        (42, TypeError, "neither indexable nor iterable"),
    ],
)
def test_bad_input(data, error, fragment):
    with pytest.raises(error, match=fragment):
        measure_label_fraction(data)


def test_bad_bounds():
    with pytest.raises(TypeError, match="max_rows=0"):
        measure_label_fraction([{"input_ids": [1, 2]}], max_rows=0)
    with pytest.raises(TypeError, match="batch_size=True"):
        measure_label_fraction([{"input_ids": [1, 2]}], batch_size=True)
