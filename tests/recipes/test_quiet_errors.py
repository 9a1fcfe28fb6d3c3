"""Issue 42: a recipe error is the recipe's message alone, not preceded by the lines torchao and
bitsandbytes log when the run first imports them (hf_memstack/_quiet.py names them)."""

from __future__ import annotations

import sys

from recipe_utils import RECIPE, launch


def test_a_recipe_error_is_not_preceded_by_import_noise(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("policy: bf16+nope\n")
    done = launch([sys.executable, RECIPE, "--config", config], timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-4000:]
    assert done.stderr.startswith("finetune.py: error: invalid configuration"), done.stderr[-4000:]
    assert "unknown token 'nope'" in done.stderr
