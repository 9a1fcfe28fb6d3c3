"""--policy auto on prompt/response data: the recipe measures the share of positions that carry a
label from its training rows, logs it, and the planner counts the chunked head over it; a
classifier's run (the default job's kind) is planned as before, over every position."""

from __future__ import annotations

import json

import pytest
from recipe_utils import AUTO_BATCH, lm_args

import hf_memstack


@pytest.fixture
def planned(monkeypatch):
    """The label_fraction each plan_policy call got (the real planner still plans)."""
    seen: list[float] = []
    real = hf_memstack.plan_policy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("label_fraction", 1.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_memstack, "plan_policy", spy)
    return seen


def _auto(args: list[str]) -> list[str]:
    args[args.index("--policy") + 1] = "auto"
    return [*args, "--memory-budget", "1GiB"]


def _pairs(tiny_lm, tmp_path) -> str:
    """A file of instruction-like rows: prompts of 6..9 words, responses of 1..3."""
    words = " ".join(tiny_lm["lines"]).split()
    rows = [
        {"prompt": " ".join(words[i : i + 6 + i % 4]), "response": " ".join(words[i + 20 : i + 21 + i % 3])}
        for i in range(100)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(data)


def _hand_count(recipe, args: list[str]) -> tuple[float, int]:
    """The training rows' label fraction counted from their words (word-level tokenizer: one token a
    word): each response word and the EOS carry a label, every token but a row's last predicts one,
    the prompt's labels are -100."""
    train, _, _, _ = recipe.load_raw_data(recipe.parse_config(args))  # the training split, as the recipe splits it
    labelled = sum(len(r["response"].split()) + 1 for r in train)
    positions = sum(len(r["prompt"].split()) + len(r["response"].split()) for r in train)
    return labelled / positions, len(train)


def _pair_args(tiny_lm, tmp_path, *extra: str) -> list[str]:
    data = _pairs(tiny_lm, tmp_path)
    args = lm_args(tiny_lm, tmp_path / "o", "--prompt-field", "prompt", "--response-field", "response", *extra)
    args[args.index("--dataset") + 1] = data
    return args


def test_planner_gets_the_measured_label_fraction(recipe, tiny_lm, tmp_path, capsys, planned):
    args = _auto(_pair_args(tiny_lm, tmp_path, "--max-steps", "1"))
    expected, rows = _hand_count(recipe, args)
    assert 0.15 < expected < 0.45  # far from the 1.0 planned before

    recipe.main(args)
    assert planned == [pytest.approx(expected, abs=1e-12)]
    out = capsys.readouterr().out
    assert f"label fraction {expected:.2f} measured over {rows} rows" in out


def test_batch_size_finder_says_the_label_fraction(recipe, tiny_lm, tmp_path, capsys):
    args = _pair_args(tiny_lm, tmp_path, *AUTO_BATCH)
    expected, rows = _hand_count(recipe, args)
    recipe.main(args)
    assert f"label fraction {expected:.2f} measured over {rows} rows" in capsys.readouterr().out


def test_plain_text_and_classifier_runs_plan_every_position(recipe, tiny_lm, tmp_path, capsys, planned):
    recipe.main(_auto(lm_args(tiny_lm, tmp_path / "lm", "--max-steps", "1")))
    assert planned == [pytest.approx(1.0)]  # plain text: every position but a row's last is learnt
    assert "label fraction 1.00 measured" in capsys.readouterr().out
    planned.clear()
    data = tmp_path / "cls.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(tiny_lm["lines"])))
    args = _auto(lm_args(tiny_lm, tmp_path / "cls", "--max-steps", "1"))
    args[args.index("--dataset") + 1] = str(data)
    report = recipe.main(args)
    assert report["task"] == "classification"
    assert planned == [1.0]  # nothing measured: a classifier has one label a row
    assert "label fraction" not in capsys.readouterr().out
