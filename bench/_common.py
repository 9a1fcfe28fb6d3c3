"""Shared by the benchmark scripts: the reference model, its batch, the machine's description, real model shapes,
a recipe run in a subprocess, and a measured step against the estimator."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ROOT / "recipes" / "finetune.py"  # the recipe the loss-curve benchmarks run

# Llama-2-7B's and Llama-3-70B's shapes (their configs' own numbers), for the estimator and the planner.
LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "llama-2-7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
    },
    "llama-3-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
}


def reference_config(layers: int, hidden: int, vocab: int = 32000, **overrides: Any) -> Any:
    """The benches' Llama shape: heads of 64, a key/value head per 256 of width, an MLP of 8/3 the width."""
    from transformers import LlamaConfig

    shape: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 8 / 3) // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 64),
        "num_key_value_heads": max(1, hidden // 256),
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return LlamaConfig(**{**shape, **overrides})


def reference_model(layers: int, hidden: int, vocab: int = 32000, seed: int = 0) -> torch.nn.Module:
    """A Llama-shaped causal LM built from a config (random weights, fp32), in train mode."""
    from transformers import LlamaForCausalLM

    cfg = reference_config(layers, hidden, vocab)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).train()


def reference_batch(
    batch: int, seq: int, vocab: int = 32000, seed: int = 0, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}"


def run_dir(tmp: str | Path, policy: str, seed: int) -> Path:
    """A folder of ``tmp`` for one run, named after its policy and seed."""
    return Path(tmp) / f"{policy.replace('+', '_').replace(':', '-')}_{seed}"


def recipe_run(script: Path, policy: str, seed: int, steps: int, out: Path, *flags: str) -> dict[str, Any]:
    """One run of a recipe script (recipes/finetune.py's flags: logged every 10 steps, no evaluation during the run)
    in a subprocess, writing to ``out``: ``policy``, ``seed``, ``seconds``, the logged ``losses`` as (step, loss)
    and the ``final`` metrics. ``flags``: more of the script's flags. Exits with its stderr if it fails."""
    cmd = [sys.executable, str(script), "--policy", policy, "--seed", str(seed), "--max-steps", str(steps), *flags]
    cmd += ["--log-every", "10", "--eval-every", "0", "--output-dir", str(out)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{policy} seed {seed} failed:\n{done.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    return {
        "policy": policy,
        "seed": seed,
        "seconds": time.perf_counter() - start,
        "losses": [(h["step"], h["loss"]) for h in report["history"]],
        "final": report["final_metrics"],
    }


def last_quarter_loss(run: dict[str, Any]) -> float:
    """A recipe run's mean training loss over the last quarter of its logged steps (less noisy than the last one)."""
    losses = [loss for _, loss in run["losses"]]
    return statistics.fmean(losses[-max(1, len(losses) // 4) :])


def measured_against_estimate(
    cfg: Any, policy: Any, batch: dict[str, torch.Tensor], estimate_cfg: Any = None, **estimate_kwargs: Any
) -> dict[str, float]:
    """A fresh Llama of ``cfg`` (seed 0) prepared with ``policy``: the meter's peak for one step on ``batch``
    (the library's optimizer), the estimator's for a batch of that shape, and the estimate's relative error.
    ``estimate_cfg``: the config the estimator reads (default ``cfg``, as ``prepare_model`` left it)."""
    from transformers import LlamaForCausalLM

    from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model

    torch.manual_seed(0)
    model = prepare_model(LlamaForCausalLM(cfg).train(), policy)
    measured = measure_step(model, batch, make_optimizer(model, lr=1e-4), timed=False).peak_bytes
    b, t = batch["input_ids"].shape
    estimate = estimate_memory(
        cfg if estimate_cfg is None else estimate_cfg, policy, batch_size=b, seq_len=t, **estimate_kwargs
    )
    return {"measured": measured, "estimated": estimate.peak_bytes, "error": estimate.peak_bytes / measured - 1}
