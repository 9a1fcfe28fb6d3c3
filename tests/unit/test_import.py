"""A quiet, light import: ``import hf_memstack`` prints nothing and loads no optional backend,
``hf-memstack --help`` answers without torch, and the import-time noise of torchao and
bitsandbytes is dropped where our code triggers it, and only that noise.

Each check runs in a fresh interpreter (this one has imported everything already)."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_memstack

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("torchao", "bitsandbytes", "trl", "peft", "matplotlib")
# What torchao, torch's pytree (for torchao's enums) and bitsandbytes print on import (see _quiet.py).
NOISE = ("_C_mxfp8", "_C_cutlass", "is an Enum subclass", "gemm_4bit_forward")


def _python(code: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )


def _loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {modules!r} if m in sys.modules))"
    done = _python(probe)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's printed list


def test_import_prints_nothing() -> None:
    done = _python("import hf_memstack")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_import_loads_no_backend() -> None:
    # Not torch nor Transformers either: the package's names load their modules on first use.
    assert _loaded_after("import hf_memstack", (*OPTIONAL, "accelerate", "torch", "transformers")) == []


@pytest.mark.parametrize(
    "argv", [["--help"], ["estimate", "--help"], ["plan", "--help"], ["find-batch-size", "--help"]]
)
def test_cli_help_does_not_import_torch(argv: list[str]) -> None:
    code = (
        "import contextlib, io\nfrom hf_memstack.cli.main import main\nout = io.StringIO()\n"
        f"with contextlib.redirect_stdout(out):\n    assert main({argv!r}) == 0\nassert 'usage: hf-memstack' in out.getvalue()"
    )
    assert _loaded_after(code, ("torch", "transformers", *OPTIONAL)) == []


def test_every_public_name_imports() -> None:
    # In this process the names may already be loaded; a fresh one takes each through __getattr__.
    code = (
        "import hf_memstack\nfrom hf_memstack import *\n"
        "missing = [n for n in hf_memstack.__all__ if n not in globals()]\nassert not missing, missing\n"
        "assert set(hf_memstack.__all__) <= set(dir(hf_memstack))\n"
        "import hf_memstack.transforms.quant.apply as q\nassert hf_memstack.transforms.quant.apply is q"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert not [n for n in NOISE if n in done.stderr], done.stderr
    assert sorted({*hf_memstack._LAZY, "__version__"}) == sorted(hf_memstack.__all__)  # one list, no orphan
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = hf_memstack.no_such_name


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="quant:nf4 needs torchao")
def test_nf4_prepare_is_quiet() -> None:
    code = (
        "from hf_memstack import describe, prepare_model\nfrom tiny import tiny_llama\nm = tiny_llama()\n"
        "for n, p in m.named_parameters():\n    p.requires_grad_('proj' not in n)\n"
        "m = prepare_model(m, 'bf16+quant:nf4')\nprint(describe(m))"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert "in 4 bits (torchao" in done.stdout
    assert not [n for n in NOISE if n in done.stderr], done.stderr


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs PEFT")
def test_peft_import_for_an_estimate_is_quiet() -> None:
    # PEFT imports bitsandbytes (its kernels-community line on an AVX512-BF16 CPU) and torchao.
    done = _python(
        "from hf_memstack.planning.estimate.trainable import peft_config_from\nprint(peft_config_from('lora').r)"
    )
    assert done.returncode == 0, done.stderr
    assert not [n for n in NOISE if n in done.stderr], done.stderr


def _emit(logger: str, msg: str, *args: object) -> list[str]:
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger(logger)
    handler = Keep()
    log.addHandler(handler)
    try:
        log.warning(msg, *args)
    finally:
        log.removeHandler(handler)
    return seen


def test_quiet_drops_only_the_named_noise() -> None:
    import enum

    from hf_memstack._quiet import quiet_imports

    class TorchaoEnum(enum.Enum):
        A = 1

    class OtherEnum(enum.Enum):
        A = 1

    TorchaoEnum.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    pytree = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    so = "/venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    with quiet_imports():
        assert _emit("torchao", f"Failed to load {so}: Could not load this library: {so}") == []
        assert _emit("torch.utils._pytree", pytree, TorchaoEnum) == []
        assert (
            _emit("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: x")
            == []
        )
        # What matters still shows: torchao's own ops library, another library's enum, other messages.
        assert _emit("torchao", "Failed to load /venv/torchao/_C.abi3.so: undefined symbol") != []
        assert _emit("torch.utils._pytree", pytree, OtherEnum) != []
        assert _emit("bitsandbytes.backends.cpu.ops", "something else") != []
    # And outside the block nothing is dropped.
    assert _emit("torchao", f"Failed to load {so}: Could not load this library: {so}") != []


def test_cli_dtype_choices_are_the_estimators() -> None:
    from hf_memstack.cli.estimate import DTYPE_CHOICES
    from hf_memstack.planning.estimate.weights_dtype import DTYPE_CHOICES as ESTIMATOR_CHOICES

    assert DTYPE_CHOICES == ESTIMATOR_CHOICES


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="quant:nf4 needs torchao")
def test_cli_estimate_prints_only_its_answer(tmp_path: Path) -> None:
    # The estimate builds the model (Transformers loads torchao), quantizes it (torchao) and wraps it
    # in LoRA (PEFT loads bitsandbytes): none of their import lines or PEFT's deprecation shows.
    from tiny import llama_config

    llama_config().save_pretrained(tmp_path)
    argv = ["estimate", str(tmp_path), "--policy", "bf16+quant:nf4", "--batch-size", "2", "--seq-len", "32"]
    done = _python(f"from hf_memstack.cli.main import main\nraise SystemExit(main({[*argv, '--lora-r', '4']!r}))")
    assert done.returncode == 0, done.stderr
    assert "| bf16+quant:nf4 |" in done.stdout
    assert done.stderr == ""
