"""The run's Accelerator, with the settings the recipe relies on (Accelerate's defaults would drop
a 600 s timeout, treat CPU torchrun processes wrongly, or step the schedule N times per step)."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

from .flags import FinetuneConfig

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_memstack.transforms.precision.apply import ResolvedPrecision


def make_accelerator(
    cfg: FinetuneConfig,
    precision: ResolvedPrecision,
    device_type: str,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
) -> Accelerator:
    """The run's Accelerator: its mixed precision, FSDP plugin, trackers, seedable loaders and timeout."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    from hf_memstack.transforms.precision.apply import ACCELERATE_NAMES

    # Accelerate drops an InitProcessGroupKwargs value equal to its class default (600 s): a
    # millisecond more keeps the timeout that was asked for.
    timeout = datetime.timedelta(seconds=cfg.train.dist_timeout)
    if timeout == datetime.timedelta(seconds=600):
        timeout += datetime.timedelta(milliseconds=1)
    return Accelerator(
        # Accelerate only treats torchrun's processes as a gloo group on CPU when told it is on CPU.
        cpu=device_type == "cpu",
        mixed_precision=ACCELERATE_NAMES[precision.name],
        fsdp_plugin=fsdp_plugin,
        log_with=[t.strip() for t in cfg.output.report_to.split(",")] if cfg.output.report_to else None,
        project_dir=cfg.output.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=device_type == "cuda"),
        # The schedule is stepped once per optimizer step below: with Accelerate's default it would
        # step once per process per optimizer step, ending N times too early on N processes.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
