"""Bad data files: each ends with one message naming the file, the line (row) and the field, and
nothing is written. Was: raw tracebacks from datasets/pyarrow, without a line number."""

import json

import pytest
from recipe_utils import fails, lm_args, run


def _jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


GOOD = [{"text": f"sentence number {i} about the cat", "label": i % 2} for i in range(10)]

CASES = {
    # name: (file name, bytes, extra flags, fragments after the file's path)
    "row without the label": (
        "d.jsonl",
        _jsonl(*GOOD[:4], {"text": "no label here"}, *GOOD[4:]),
        [],
        [", line 5: field 'label' is missing", "every row needs a label"],
    ),
    "mixed str and int labels": (
        "d.jsonl",
        _jsonl(*GOOD[:6], {"text": "a str label", "label": "sports"}, *GOOD[6:]),
        [],
        [
            ", line 7: field 'label' is 'sports' (str) but the label at",
            "line 1 is a int",
            "use one type for every label",
        ],
    ),
    "missing text field": (
        "d.jsonl",
        _jsonl(*GOOD[:2], {"body": "wrong field", "label": 1}, *GOOD[2:]),
        [],
        [", line 3: field 'text' is missing", "the row's fields: ['body', 'label']"],
    ),
    "latin-1 bytes": (
        "d.jsonl",
        _jsonl(*GOOD[:3], b'{"text": "caf\xe9 au lait", "label": 0}', *GOOD[3:]),
        [],
        [", line 4: not UTF-8 (byte 0xe9 at column 14)", "save the file as UTF-8"],
    ),
    "broken json": (
        "d.jsonl",
        _jsonl(*GOOD[:8], b'{"text": "unterminated, "label": 1', *GOOD[8:]),
        [],
        [", line 9: not valid JSON", "each line must be one JSON object"],
    ),
    "empty file": ("d.jsonl", b"", [], [": has no rows", "at least 2 rows"]),
    "one-row file": ("d.jsonl", _jsonl(GOOD[0]), [], [": has 1 row(s)", "--validation-file"]),
    "a row that is a list": (
        "d.jsonl",
        _jsonl(*GOOD[:5], [1, 2], *GOOD[5:]),
        [],
        [", line 6: a JSON list where a row object belongs"],
    ),
    "float label": (
        "d.jsonl",
        _jsonl(*GOOD[:2], {"text": "x y z", "label": 1.5}, *GOOD[2:]),
        [],
        [", line 3: field 'label' is 1.5", "an integer or a string"],
    ),
    "null text": ("d.jsonl", _jsonl({"text": None, "label": 0}, *GOOD), [], [", line 1: field 'text' is None"]),
    "one class only": (
        "d.jsonl",
        _jsonl(*[{**r, "label": 3} for r in GOOD]),
        [],
        [": field 'label' has one value (3) in every row", "at least 2 classes"],
    ),
    "csv with an extra value": (
        "d.csv",
        b"text,label\nhello there,0\nhi, there,1\nbye now,1\n",
        [],
        [", line 3: more values than the header's 2 columns", "quote values"],
    ),
    "json array, broken": (
        "d.json",
        b'[{"text": "a", "label": 0},\n {"text": "b" "label": 1}]',
        [],
        [", line 2: not valid JSON"],
    ),
    "prompt longer than seq-len": (
        "d.jsonl",
        _jsonl(*[{"prompt": "the cat sat on a mat " * 4, "response": "dog ran"}] * 10),
        ["--prompt-field", "prompt", "--response-field", "response", "--task", "causal-lm"],
        ["the prompt fills all --seq-len=16 tokens", "raise --seq-len"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_data_file_names_file_row_and_field(recipe, tiny_lm, tmp_path, capsys, name):
    filename, content, extra, fragments = CASES[name]
    data = tmp_path / filename
    data.write_bytes(content)
    out = tmp_path / "out"
    args = lm_args(tiny_lm, out, *extra)
    args[args.index("--dataset") + 1] = str(data)
    fails(recipe, args, capsys, *[str(data) + f if f.startswith((",", ":")) else f for f in fragments])
    assert not out.exists()


def test_validation_file_with_other_label_type(recipe, tiny_lm, tmp_path, capsys):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_bytes(_jsonl(*GOOD))
    val.write_bytes(_jsonl({"text": "a", "label": "0"}, {"text": "b", "label": "1"}))
    args = lm_args(tiny_lm, tmp_path / "out", "--validation-file", val)
    args[args.index("--dataset") + 1] = str(train)
    fails(recipe, args, capsys, f"{val}, line 1: field 'label' is '0' (str) but the label at {train}, line 1 is a int")


def test_good_csv_and_text_files_train(recipe, tiny_lm, tmp_path):
    """The readers that replaced datasets' loaders still read what they should: CSV labels that
    look like integers are integers (as datasets reads them), text files are one row per line."""
    csv = tmp_path / "d.csv"
    csv.write_text("text,label\n" + "".join(f'"the cat, number {i}",{i % 3}\n' for i in range(30)))
    args = lm_args(tiny_lm, tmp_path / "c", "--max-steps", "2")
    args[args.index("--dataset") + 1] = str(csv)
    report = run(recipe, args)
    assert report["task"] == "classification"
    txt = tmp_path / "d.txt"
    txt.write_text("\n".join(tiny_lm["lines"][:40]) + "\n\n")
    args = lm_args(tiny_lm, tmp_path / "t", "--max-steps", "2")
    args[args.index("--dataset") + 1] = str(txt)
    assert run(recipe, args)["task"] == "causal-lm"
