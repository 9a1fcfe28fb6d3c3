"""docs/architecture.md stays true: every file it names exists, and the change it walks (adding a
policy token) is the table the policy string is parsed with."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def test_every_file_the_architecture_doc_names_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`((?:hf_memstack|recipes|tests|docs)/[\w/.]+\.(?:py|md))(?:::\w+)?`", text))
    assert len(named) >= 8, named
    missing = [n for n in sorted(named) if not (ROOT / n).is_file()]
    assert not missing, missing


def test_the_token_the_doc_adds_is_not_taken_and_its_row_would_parse():
    from hf_memstack import MemoryPolicy, PolicyError
    from hf_memstack.policy import tokens

    row = re.search(r'`(Token\("ckpt:every_other".*?\))`', DOC.read_text()).group(1)
    new = eval(row, {"Token": tokens.Token})  # noqa: S307 - the doc's own example row
    try:
        MemoryPolicy.from_string("bf16+ckpt:every_other")
        raise AssertionError("ckpt:every_other is already a token: pick another example for the doc")
    except PolicyError:
        pass
    # With the row added, the string parses to the fragment and prints as ckpt:2.
    saved = tokens.TOKENS, dict(tokens._BY_SPELLING)
    try:
        tokens.TOKENS = (*tokens.TOKENS, new)
        tokens._BY_SPELLING[new.spelling] = new
        policy = MemoryPolicy.from_string("bf16+ckpt:every_other")
        assert (policy.checkpointing.mode, policy.checkpointing.every_n) == ("every_n", 2)
        assert policy.to_string() == "bf16+ckpt:2"
    finally:
        tokens.TOKENS, tokens._BY_SPELLING = saved[0], saved[1]
