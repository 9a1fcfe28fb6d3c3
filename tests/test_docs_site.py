"""The documentation site: it builds strictly (no broken link or anchor, no page outside the nav, every
API entry found), and every Python snippet of README.md and docs/*.md runs.

A snippet is a ```python block directly under an HTML comment naming it: <!-- snippet: NAME -->. A python
block without a name fails the test (nothing is skipped silently). A snippet that needs objects a reader
already has (a model, a batch, a loader) gets them from SCOPES, built on the tests' tiny models; every other
snippet runs on its own. Each runs in a fresh temporary directory (several write files: policy.yaml, out/).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- snippet: ([\w-]+) -->\n)?```python\n(.*?)```", re.S)


def snippets() -> list[tuple[str, str, str]]:
    """(page, name, code) for every python block; a block without a name is returned with name ''."""
    found = []
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text()):
            found.append(
                (
                    page.relative_to(ROOT).as_posix(),
                    match.group(1) or "",
                    match.group(2),
                )
            )
    return found


def test_every_python_block_is_a_named_snippet():
    unnamed = [page for page, name, _ in snippets() if not name]
    assert not unnamed, f"python blocks without <!-- snippet: NAME --> in {unnamed}"
    per_page = [(page, name) for page, name, _ in snippets()]
    assert len(per_page) == len(set(per_page)), "a snippet name is used twice on one page"


# --- the objects the snippets' readers already have -----------------------------------------------


def _tiny_batch(vocab: int = 32, n: int = 4, seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (n, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def _trainer_scope(load_model, word_tokenizer) -> dict[str, Any]:
    import datasets
    from transformers import DataCollatorForLanguageModeling

    texts = [" ".join(["the cat sat on a mat"] * (1 + i % 3)) for i in range(64)]
    train = datasets.Dataset.from_dict({"text": texts}).map(
        lambda r: word_tokenizer(r["text"]), remove_columns=["text"]
    )
    return {
        "model": load_model("llama"),
        "train": train,
        "collator": DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
    }


def _fp16_scope(load_model, word_tokenizer) -> dict[str, Any]:
    from hf_memstack import prepare_model

    model = prepare_model(load_model("llama"), "fp16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = model(**_tiny_batch(model.config.vocab_size)).loss
    return {"torch": torch, "model": model, "optimizer": optimizer, "loss": loss}


def _optim_scope(load_model, word_tokenizer) -> dict[str, Any]:
    model = load_model("llama")
    return {
        "model": model,
        "loader": [_tiny_batch(model.config.vocab_size) for _ in range(2)],
    }


def _qlora_scope(load_model, word_tokenizer, tmp_path: Path) -> dict[str, Any]:
    model = load_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    return {
        "name": str(tmp_path / "bf16"),
        "batch": _tiny_batch(model.config.vocab_size),
    }


def _packing_scope(load_model, word_tokenizer) -> dict[str, Any]:
    lengths = [5, 9, 3, 12, 7, 4, 8, 6]
    tokenized = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in lengths]
    return {"tokenized": tokenized, "tok": word_tokenizer}


def _packing_trainer_scope(load_model, word_tokenizer) -> dict[str, Any]:
    from hf_memstack import prepare_model

    return {
        **_packing_scope(load_model, word_tokenizer),
        "model": prepare_model(load_model("llama"), "bf16+ckpt"),
    }


SCOPES: dict[str, Callable[..., dict[str, Any]]] = {
    "trainer": _trainer_scope,
    "fp16-loop": _fp16_scope,
    "optim-in-backward": _optim_scope,
    "packing": _packing_scope,
    "packing-trainer": _packing_trainer_scope,
}
NEEDS_TMP = {"qlora": _qlora_scope}
# Snippets that run under torchrun, 2 gloo processes (below), and what each leaves behind.
LAUNCHED: dict[str, Callable[[Path, str], bool]] = {
    "fsdp-torchrun": lambda out, _: (out / "out" / "model" / "config.json").is_file(),
    "sp-torchrun": lambda _, printed: "step 2: loss" in printed,
    "sp-trainer": lambda _, printed: "train_loss" in printed,
}


def _to_run() -> list[tuple[str, str, str]]:
    """Each distinct snippet once: the README's quickstart and trainer snippets run in tests/test_readme.py
    (with assertions on what they print and train), and a page that repeats one of them verbatim (docs/index.md's
    quickstart, the Trainer page's snippet) is covered by that run."""
    readme = {code for page, name, code in snippets() if page == "README.md" and name in ("quickstart", "trainer")}
    seen: set[str] = set()
    out = []
    for page, name, code in snippets():
        if not name or name in LAUNCHED or code in readme or code in seen:
            continue
        seen.add(code)
        out.append((page, name, code))
    return out


@pytest.mark.parametrize(
    "page,name,code",
    _to_run(),
    ids=lambda v: v if isinstance(v, str) and "\n" not in v else "",
)
def test_snippet_runs(page, name, code, load_model, word_tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {"__name__": "__docs__"}
    if name in SCOPES:
        scope.update(SCOPES[name](load_model, word_tokenizer))
    elif name in NEEDS_TMP:
        scope.update(NEEDS_TMP[name](load_model, word_tokenizer, tmp_path))
    exec(compile(code, f"{page}:{name}", "exec"), scope)
    # A snippet that prints verify's report shows a reader what a correct setup reports: no row may fail.
    printed = capsys.readouterr().out
    assert "[FAIL]" not in printed, printed


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LAUNCHED))
def test_launched_snippet_runs_under_torchrun(name, pretrained_dirs, tmp_path):
    [(page, _, code)] = [s for s in snippets() if s[1] == name]
    script = tmp_path / "train.py"
    script.write_text(f"path = {str(pretrained_dirs['llama'])!r}\n" + code)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert LAUNCHED[name](tmp_path, done.stdout), done.stdout[-3000:]


# --- the site --------------------------------------------------------------------------------------


def test_the_site_builds_strictly(tmp_path):
    """mkdocs build --strict: a broken link or anchor, a page missing from the nav, a docstring
    mkdocstrings cannot find, each is a warning, and strict turns it into a failure."""
    import importlib.util

    assert importlib.util.find_spec("mkdocs"), "mkdocs is in the dev extra: pip install -c constraints.txt -e '.[dev]'"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    import yaml

    text = (ROOT / "mkdocs.yml").read_text()
    config = yaml.safe_load(text)
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", text, re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == listed, (pages - listed, listed - pages)
    assert config["strict"] is True


def test_readme_links_only_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[\w-]+\.md)(?:#[\w-]+)?\)", (ROOT / "README.md").read_text())
    assert links and all((ROOT / link).is_file() for link in links), [
        link for link in links if not (ROOT / link).is_file()
    ]
