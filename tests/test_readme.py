"""The README's snippets, run verbatim, and its test command: the README half of the snippet tests
(tests/test_docs_site.py runs docs/*.md's and builds the site strictly)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_snippet_runs_verbatim(capsys):
    text = README.read_text()
    match = re.search(r"<!-- snippet: quickstart -->\n```python\n(.*?)```", text, re.S)
    assert match, "the README lost its quick-start snippet"
    exec(compile(match.group(1), "README.md:quickstart", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert "checkpointing: full via transformers" in out
    assert "[ok] checkpointing" in out and "[FAIL]" not in out
    assert "peak" in out and "[memtracker" in out


def test_readme_test_command_is_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    command = 'pip install -c constraints.txt -e ".[dev]" && python -m pytest'
    assert command in README.read_text() and command in ci


def _snippet(name: str) -> str:
    match = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert match, f"the README lost its {name} snippet"
    return match.group(1)


def test_trainer_snippet_runs_verbatim(load_model, word_tokenizer, tmp_path, monkeypatch):
    """The Trainer snippet with its three inputs defined: a tiny Llama, a small dataset, a collator."""
    import datasets
    from transformers import DataCollatorForLanguageModeling

    monkeypatch.chdir(tmp_path)  # it writes to ./out
    texts = [" ".join(["the cat sat on a mat"] * (1 + i % 3)) for i in range(64)]
    train = datasets.Dataset.from_dict({"text": texts}).map(
        lambda r: word_tokenizer(r["text"]), remove_columns=["text"]
    )
    scope = {
        "__name__": "__readme__",
        "model": load_model("llama"),
        "train": train,
        "collator": DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
    }
    exec(compile(_snippet("trainer"), "README.md:trainer", "exec"), scope)
    trainer = scope["trainer"]
    assert (
        trainer.state.global_step > 0
        and trainer.args.gradient_accumulation_steps * trainer.args.per_device_train_batch_size >= 64
    )
    assert scope["model"].memstack.policy.to_string() == "bf16+ckpt"
