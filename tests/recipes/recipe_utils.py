"""Helpers for the recipe tests: load the real script as a module, run it (in process or as real
subprocesses under torchrun / accelerate launch), and prove a directory was left untouched."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "finetune.py"
# --standalone: a free port for the rendezvous, so that concurrent runs (other tests, other jobs
# on the machine) never meet on torchrun's default port 29500 and wait for each other's ranks.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
# One process through Accelerate's FSDP2 plugin (the recipe's own config): the accelerate route, on a GPU.
ACCELERATE_FSDP = [*ACCELERATE, "--config_file", ROOT / "recipes/configs/fsdp.yaml", "--num_processes", "1", RECIPE]
# --batch-size auto under a budget that caps the search well below the global batch (a few probes, 2 steps).
AUTO_BATCH = ("--batch-size", "auto", "--memory-budget", "40MiB", "--global-batch-size", "64", "--max-steps", "2")


def load_recipe() -> Any:
    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and HfArgumentParser look the module up while typing fields
    spec.loader.exec_module(module)
    return module


def reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def lm_args(tiny_lm, out, *extra) -> list[str]:
    # --dist-timeout 120: a distributed bug fails the test in two minutes instead of hanging for the default 15.
    return [
        "--model",
        str(tiny_lm["model"]),
        "--dataset",
        str(tiny_lm["data"]),
        "--output-dir",
        str(out),
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--lr",
        "3e-3",
        "--policy",
        "fp32",
        "--log-every",
        "2",
        "--eval-every",
        "0",
        "--dist-timeout",
        "120",
        *extra,
    ]


def snapshot(path: Path) -> dict[str, Any] | None:
    """Every entry under ``path`` (not following symlinks): kind, size, mtime and content digest.
    Equal snapshots mean nothing was written, removed or touched."""
    if not path.exists() and not path.is_symlink():
        return None
    out = {}
    for p in sorted([path, *path.rglob("*")]):
        st = p.lstat()
        if p.is_symlink():
            out[str(p.relative_to(path))] = ("link", os.readlink(p))
        elif p.is_dir():
            out[str(p.relative_to(path))] = ("dir", st.st_mtime_ns)
        else:
            out[str(p.relative_to(path))] = (
                "file",
                st.st_size,
                st.st_mtime_ns,
                hashlib.sha256(p.read_bytes()).hexdigest(),
            )
    return out


def run(recipe, argv) -> dict[str, Any]:
    """The recipe's main() in this process, with Accelerate's process-wide state reset first (as in a new process)."""
    reset_accelerate()
    return recipe.main([str(a) for a in argv])


def fails(recipe, argv, capsys, *fragments) -> str:
    """Run the recipe in process; it must end with a RecipeError (exit status 2) whose message holds every fragment."""
    reset_accelerate()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        recipe.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and isinstance(e.value, recipe.RecipeError), err[-2000:]
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    return err


def launch(cmd, *, env_extra=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    """A real subprocess (torchrun, accelerate launch, python), offline, one thread per process.
    On timeout the whole process group goes (torchrun's workers too) and the test fails with the
    output so far."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env.pop("HF_MEMSTACK_RECIPE_TEST_HOOK", None)
    env.update(env_extra or {})
    args = [str(c) for c in cmd]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(
            f"{' '.join(args[:6])} ... did not finish within {timeout} s; its output so far:\n{stdout[-2000:]}\n{stderr[-4000:]}"
        )
    done = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    if check:
        assert done.returncode == 0, stderr[-4000:]
    return done


def _kill_tree(pid: int) -> None:
    """The process, its group, and every descendant: torchrun starts each rank in a session of its
    own, which a killpg of torchrun's group misses (a hung rank then held the output pipes open and
    the test waited on them forever)."""
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def torchrun(tiny_lm, out, *extra, **launch_kwargs) -> subprocess.CompletedProcess:
    """The recipe on 2 processes under torchrun, on the tiny LM (``lm_args``), writing to ``out``; ``launch``'s keywords."""
    return launch([*TORCHRUN, RECIPE, *lm_args(tiny_lm, out, *extra)], **launch_kwargs)


def read_report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
