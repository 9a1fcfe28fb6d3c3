"""What every part of the recipe shares: the error a bad input raises (RecipeError), the task and
sharding routes, the data file formats and model aliases, and ``agree`` (every rank learns whether
any failed, so one bad rank ends them all with its message)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    from collections.abc import Callable

    import torch
    from accelerate import Accelerator

    # A collated batch, as the model's forward takes it.
    Batch = dict[str, torch.Tensor]
    # One tokenized row of a datasets.Dataset: its columns as the tokenizer and packing made them
    # (datasets ships no types, and the columns differ by task).
    Sample = dict[str, Any]
    # The loaders' collate_fn (and the finder's): rows to a batch.
    Collate = Callable[[list[Sample]], Batch]

Task = Literal["auto", "causal-lm", "classification"]
# How the model is sharded, decided once in setup: not at all; by Accelerate's FSDP2 plugin (GPUs);
# or by prepare_model's fully_shard, outside Accelerate (CPU/gloo, where Accelerate has no FSDP,
# and hybrid_shard, whose plugin needs a ParallelismConfig).
Route = Literal["none", "accelerate", "fully_shard"]


class RecipeError(SystemExit):
    """A bad input: printed as one message, exit status 2, nothing written."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def is_alias(name: str) -> bool:
    from hf_memstack.models import MODEL_ALIASES

    return name in MODEL_ALIASES


def looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).suffix in FORMATS or Path(name).expanduser().exists()


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control and format characters (NUL, ESC, the
    right-to-left override U+202E, ...) escaped as ``\\x00``, ``\\u202e``; line breaks kept.
    Messages quote names from received files (a config.json's model_type), which may hold them."""
    return "".join(c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode("ascii") for c in text)


def agree(accelerator: Accelerator, error: RecipeError | None) -> None:
    """Every process learns whether any failed, so that one bad rank ends all of them with its message
    instead of leaving the others waiting in the next collective."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        messages: list[str | None] = [None] * accelerator.num_processes
        dist.all_gather_object(messages, error.message if error else None)
        failed = [(r, m) for r, m in enumerate(messages) if m]
        if failed:
            if len({m for _, m in failed}) == 1:
                raise RecipeError(failed[0][1])
            raise RecipeError("\n".join(f"rank {r}: {m}" for r, m in failed))
    if error is not None:
        raise error
