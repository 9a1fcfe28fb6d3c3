"""What the final report adds for people: the closing line's loss summary and the memory picture
(memory.png, --memory-plot)."""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from .safe_paths import write_new

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from typing_extensions import NotRequired  # typing's from Python 3.11

    from hf_memstack.measure.memory import StepMemory

    from .common import Route
    from .job import LogRow


class LoraReport(TypedDict):
    """report.json's lora: the adapters' rank, scaling alpha and target layers (None without --lora-r)."""

    r: int
    alpha: float
    target: str


class Report(TypedDict):
    """report.json: what the run was, how it ran and what it reached (the script's ``save``; ``main`` returns it)."""

    task: str
    model: str
    policy: str
    precision: str
    batch_size: int
    grad_accum: int
    world_size: int
    route: Route
    fsdp: dict[str, object] | None  # how the model was sharded (None: not sharded)
    steps: int
    seconds: float
    peak_memory_bytes: int | None
    first_step_memory: dict[str, object] | None  # the memory meter's first step, by category
    first_logged_loss: float | None
    last_logged_loss: float | None
    final_metrics: dict[str, float]
    history: list[LogRow]
    model_dir: str
    trainable_parameters: int
    lora: LoraReport | None
    non_finite_as_null: NotRequired[list[str]]  # where a non-finite number was written as null


class Stopped(TypedDict):
    """What ``main`` returns after --stop-after: where it stopped, and the rows logged so far."""

    stopped_at: int
    history: list[LogRow]


def finite_json(value: object) -> tuple[str, list[str]]:
    """``value`` as JSON text every reader accepts, and where it held a non-finite number.
    ``json.dumps`` writes NaN and Infinity bare, which is not JSON (a resumed checkpoint's logged
    loss can be NaN): those become null, and the places they were are returned (``history[0].loss``)."""
    replaced: list[str] = []

    def finite(v: object, where: str) -> object:
        if isinstance(v, float) and not math.isfinite(v):
            replaced.append(where)
            return None
        if isinstance(v, dict):
            return {k: finite(x, f"{where}.{k}" if where else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return v

    return json.dumps(finite(value, ""), indent=2, allow_nan=False), replaced


def loss_summary(history: list[LogRow], log_every: int) -> str:
    """The first and last logged losses; with one log line (a run shorter than --log-every), that one."""
    if not history:
        return ""
    if len(history) == 1:
        return (
            f"loss {history[0]['loss']:.4f} (one log line, the mean over steps 1-{history[0]['step']}; a lower --log-every "
            f"than {log_every} shows the trend); "
        )
    return f"loss {history[0]['loss']:.4f} (step {history[0]['step']}) -> {history[-1]['loss']:.4f} (step {history[-1]['step']}); "


def plot_memory(path: Path, first_step: StepMemory | None, history: list[LogRow], report: Mapping[str, object]) -> None:
    """A picture of where the memory went: the first step's breakdown, and peak memory over the run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--memory-plot needs matplotlib: pip install 'hf_memstack[plot]'", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if first_step is not None:
        bottom = 0.0
        for cat in ["parameters", "gradients", "optimizer", "activations", "temporaries"]:
            value = getattr(first_step, cat) / 2**20
            a.bar(["first step (meter)"], [value], bottom=bottom, label=cat)
            bottom += value
        a.set_ylabel("MiB at the step's peak")
        a.legend(fontsize=8)
    else:
        a.text(0.5, 0.5, "the meter runs on CPU, eager, unsharded runs", ha="center")
    measured = [h for h in history if "peak_memory_mib" in h]
    b.plot([h["step"] for h in measured], [h["peak_memory_mib"] for h in measured], marker="o")
    b.set_xlabel("optimizer step")
    b.set_ylabel("peak memory MiB")
    fig.suptitle(f"{report['model']} [{report['policy']}] batch {report['batch_size']}", fontsize=9)
    fig.tight_layout()
    picture = io.BytesIO()
    fig.savefig(picture, format="png", dpi=100)
    plt.close(fig)
    write_new(path, picture.getvalue())  # a symlink planted at memory.png is replaced, never written through
