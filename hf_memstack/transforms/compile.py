"""apply_compile: torch.compile the whole model or each repeated block (regional), counting the
graphs compiled and the calls into them so that :func:`hf_memstack.measure.verify` can tell a compile
that really runs from one that silently runs eager."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..policy import CompileConfig
from .blocks import Blocks

if TYPE_CHECKING:
    from torch._dynamo.backends.registry import CompiledFn, CompilerFn

__all__ = ["CompileStats", "apply_compile", "check_backend", "compile_policy_problems", "verify_compile"]

# Backends that torch lists but that need another package at compile time.
_BACKEND_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla", "openxla_eval": "torch_xla", "ts": None, "aot_ts": None}


@dataclass(slots=True)
class CompileStats:
    """Live counters, updated as compiled graphs are built and run."""

    graphs_compiled: int = 0
    graph_calls: int = 0
    compile_seconds: float = 0.0
    regions: list[str] = field(default_factory=list)


def check_backend(cfg: CompileConfig) -> None:
    """Raise RuntimeError when ``cfg.backend`` cannot compile here (before the model is touched)."""
    if cfg.mode == "none":
        return
    available = torch._dynamo.list_backends(exclude_tags=())
    if cfg.backend not in available:
        raise RuntimeError(
            f"policy.compile.backend={cfg.backend!r} is not a torch.compile backend here; available: "
            f"{', '.join(sorted(available))}. Use 'inductor' (default) or 'aot_eager' to debug"
        )
    package = _BACKEND_PACKAGES.get(cfg.backend, "")
    if package is None or (package and importlib.util.find_spec(package) is None):
        raise RuntimeError(
            f"policy.compile.backend={cfg.backend!r} needs "
            f"{'a package that is not installed (' + package + ')' if package else 'TorchScript, which this PyTorch no longer compiles with'}; "
            "use backend='inductor' or 'aot_eager'"
        )


class _CountingBackend:
    """Wraps a backend: each graph it compiles bumps ``graphs_compiled``, each call ``graph_calls``."""

    def __init__(self, inner: CompilerFn, stats: CompileStats):
        self.inner = inner
        self.stats = stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> CompiledFn:
        import time

        start = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.graphs_compiled += 1
        stats = self.stats

        def run(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            stats.graph_calls += 1
            return compiled(*args)

        return run


def _backend(cfg: CompileConfig, stats: CompileStats) -> _CountingBackend:
    if cfg.backend == "inductor":
        inner: CompilerFn = torch._TorchCompileInductorWrapper(cfg.inductor_mode, None, cfg.dynamic)
    else:
        inner = torch._dynamo.lookup_backend(cfg.backend)
    return _CountingBackend(inner, stats)


def apply_compile(model: nn.Module, cfg: CompileConfig, *, blocks: Blocks | None) -> CompileStats:
    """Compile ``model`` in place with ``nn.Module.compile`` (the module keeps its class and methods).

    ``full`` compiles the model's call; ``regional`` compiles each block's call: blocks of one class
    share one compiled graph, so compile time does not grow with depth. Run this after
    checkpointing so compile sees the checkpointed blocks (the checkpoint is traced inside).
    """
    stats = CompileStats()
    if cfg.mode == "none":
        return stats
    check_backend(cfg)
    backend = _backend(cfg, stats)
    kwargs = {"backend": backend, "dynamic": cfg.dynamic, "fullgraph": cfg.fullgraph}
    if cfg.mode == "full":
        model.compile(**kwargs)
        stats.regions.append("<model>")
    else:
        if blocks is None:
            raise ValueError("regional compile needs the model's blocks")
        for name, block in zip(blocks.names, blocks.modules):
            block.compile(**kwargs)
            stats.regions.append(name)
    return stats


def compile_policy_problems(
    model: nn.Module, inner: nn.Module, stats: CompileStats, config: CompileConfig
) -> list[str]:
    """verify's ``policy`` part for compile: nothing compiled the model again after prepare_model."""
    compiled_outside = type(model).__name__ == "OptimizedModule" or (
        config.mode != "full" and getattr(inner, "_compiled_call_impl", None) is not None
    )
    if compiled_outside and not stats.regions:
        return [
            "the model was compiled after prepare_model (e.g. TrainingArguments(torch_compile=True)) but the "
            "policy has no compile: put compile in the policy instead, so it is placed after checkpointing"
        ]
    if compiled_outside:
        return [
            f"the model was compiled again after prepare_model (e.g. TrainingArguments(torch_compile=True)) on top of "
            f"the policy's {config.mode} compile: set torch_compile=False"
        ]
    return []


def verify_compile(stats: CompileStats, run_step: Callable[[], object]) -> tuple[bool, str, int]:
    """verify's ``compile`` check: ``run_step`` (a compiled forward + backward) called into the
    compiled graphs, at least once per region; also the graph breaks it hit. Returns (ok, detail, calls)."""
    before = stats.graph_calls
    breaks_before = dict(_graph_breaks())
    run_step()
    calls = stats.graph_calls - before
    breaks = {k: v - breaks_before.get(k, 0) for k, v in _graph_breaks().items() if v > breaks_before.get(k, 0)}
    n = len(stats.regions)
    # Each region's forward is at least one compiled call; fewer means a region ran eager.
    ok = calls >= n
    detail = f"{calls} calls into compiled graphs for {n} compiled region(s) ({stats.graphs_compiled} graph(s) compiled so far)"
    if not ok:
        detail += ": some compiled code did not run, part of the model ran eager"
    if breaks:
        detail += "; graph breaks: " + "; ".join(
            f"{r.splitlines()[0][:160]} (x{c})" for r, c in list(breaks.items())[:3]
        )
    return ok, detail, calls


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])
