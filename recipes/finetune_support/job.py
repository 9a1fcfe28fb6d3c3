"""The run being trained: ``Job`` (everything ``train()`` and ``save()`` need, built by the script's
``setup()``), its ``TrainerState``, and the main process's ``printer``.

They live here, not in ``recipes/finetune.py``, so that the support modules that take a Job
(checkpoint.py, stops.py) import it from beside them: the script imports this package, and this
package never imports the script (``tests/unit/test_layout.py`` holds that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from .common import Route, printable
from .flags import FinetuneConfig
from .run_dir import RunDir
from .sequence import SequenceGroups, sequence_groups
from .stops import resume_command

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from collections.abc import Callable

    import torch
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderShard
    from accelerate.scheduler import AcceleratedScheduler
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import NotRequired  # typing's from Python 3.11

    from hf_memstack.measure.memory import StepMemory
    from hf_memstack.policy import MemoryPolicy
    from hf_memstack.transforms.precision.apply import ResolvedPrecision

# The script this package serves sits beside it (recipes/finetune.py next to recipes/finetune_support/).
_SCRIPT = Path(__file__).resolve().parent.parent / "finetune.py"


def script_path() -> str:
    """The script's path as a command would name it: relative to the working directory when under it."""
    path = _SCRIPT
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def printer(accelerator: Accelerator) -> Callable[..., None]:
    """The main process's ``print``, every line through ``printable``: log lines quote names and
    values from received files (a file of yours in the output directory, a checkpoint's step or
    settings), which may hold terminal escapes that would retitle or recolor the terminal."""

    def log(*parts: object, **kwargs: Any) -> None:
        accelerator.print(*(printable(str(p)) for p in parts), **kwargs)

    return log


class LogRow(TypedDict):
    """One log line's numbers (train's ``_log_row``), kept in ``TrainerState.log_history`` and the report."""

    step: int
    loss: float
    lr: float
    tokens_per_s: float
    samples_per_s: float
    peak_memory_mib: NotRequired[float]  # left out where nothing measured the peak


@dataclass
class TrainerState:
    """Where the run is; saved as trainer_state.json in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    log_history: list[LogRow] = field(default_factory=list)


@dataclass(kw_only=True)
class Job:
    """Everything train() and save() need, validated and loaded; nothing written yet when setup returns it."""

    cfg: FinetuneConfig
    accelerator: Accelerator
    route: Route
    policy: MemoryPolicy
    precision: ResolvedPrecision
    task: str
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module  # prepared: under its policy, and Accelerate's (DDP, FSDP2) where it wraps it
    optimizer: torch.optim.Optimizer  # Accelerate's AcceleratedOptimizer, except on the fully_shard route
    scheduler: AcceleratedScheduler
    train_dl: DataLoaderShard
    val_dl: DataLoaderShard
    state: TrainerState
    run_dir: RunDir
    record: dict[str, object]  # run_record's: the settings that define the run
    batch_size: int
    grad_accum: int
    total_steps: int
    device_type: str
    meter_first_step: bool
    first_step: StepMemory | None = None  # the memory meter's StepMemory of the first micro-step
    peak_bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    argv: list[str] = field(default_factory=list)  # the command line, for the resume command of a message

    @property
    def log(self) -> Callable[..., None]:
        return printer(self.accelerator)

    def resume_command(self, changes: dict[str, str | None] | None = None) -> str:
        """This run's command with ``--resume-from latest`` (and ``changes``: stops.resume_command)."""
        return resume_command(
            self.argv, self.cfg, script=script_path(), world=self.accelerator.num_processes, changes=changes
        )

    @property
    def groups(self) -> SequenceGroups:
        """This process's sequence group and data-parallel rank (``sp:N``; N=1: every rank its own group)."""
        return sequence_groups(self.policy, self.accelerator.num_processes, self.accelerator.process_index)

    @property
    def trainable_parameters(self) -> int:
        """Parameters the optimizer updates (this rank's shards under FSDP)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


class RunState(TypedDict, total=False):
    """What the interrupt line reads (stops.interrupted): the config once parsed, the job once set up."""

    cfg: FinetuneConfig
    job: Job
