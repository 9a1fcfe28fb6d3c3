"""The eval-mode warning: heard by a loop that trains in eval mode, at its first such forward; not
by the project's own Trainer snippet, whose model comes from from_pretrained in eval mode."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
from tiny import make_batch

from hf_memstack import prepare_model

README = Path(__file__).resolve().parents[2] / "README.md"


def _eval_mode(caught) -> list[str]:
    return [str(w.message) for w in caught if "eval mode" in str(w.message)]


def test_preparing_an_eval_mode_model_does_not_warn(load_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_model(load_model("llama").eval(), "fp32+ckpt")  # what from_pretrained hands back
    assert not _eval_mode(caught)


def test_a_forward_with_gradients_in_eval_mode_warns_once(load_model):
    model = prepare_model(load_model("llama").eval(), "fp32+ckpt")
    batch = make_batch("llama")
    twin = copy.deepcopy(model)  # prepared models still deep-copy (the check is no closure)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch

        with torch.no_grad():
            model(**batch)  # evaluation: nothing to say
        assert not _eval_mode(caught)
        model(**batch).loss.backward()  # training in eval mode: checkpointing is off
        model(**batch).loss.backward()
    messages = _eval_mode(caught)
    assert len(messages) == 1 and "call model.train()" in messages[0], messages
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin.train()(**batch).loss.backward()  # train mode: silent
    assert not _eval_mode(caught)


def test_no_warning_without_checkpointing(load_model):
    model = prepare_model(load_model("llama").eval(), "fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**make_batch("llama")).loss.backward()
    assert not _eval_mode(caught)


@pytest.mark.slow
def test_the_readme_trainer_snippet_on_an_eval_mode_model_does_not_warn(
    load_model, word_tokenizer, tmp_path, monkeypatch
):
    import datasets
    from transformers import DataCollatorForLanguageModeling

    snippet = re.search(r"<!-- snippet: trainer -->\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    texts = [" ".join(["the cat sat on a mat"] * (1 + i % 3)) for i in range(32)]
    train = datasets.Dataset.from_dict({"text": texts}).map(
        lambda r: word_tokenizer(r["text"]), remove_columns=["text"]
    )
    scope = {
        "__name__": "__readme__",
        "model": load_model("llama").eval(),
        "train": train,
        "collator": DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(snippet, "README.md:trainer", "exec"), scope)
    assert scope["trainer"].state.global_step > 0
    assert not _eval_mode(caught)
