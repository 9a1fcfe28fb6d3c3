"""The README's quick-start snippet, run verbatim."""

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
