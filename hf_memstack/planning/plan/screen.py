"""How the planner reads a ``ckpt:N`` rung without tracing it: between the same policy without
checkpointing and with every block checkpointed (or its weights and optimizer state in that one's
place), so that a rung far over the budget costs no trace (a ``ckpt:N`` trace holds 3N blocks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...policy import MemoryPolicy
from .estimates import Estimates

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["SCREEN", "SCREEN_BELOW", "every_n_between", "num_blocks"]


# A ckpt:N rung whose interpolated peak is this far above the budget is not traced (a ckpt:N trace
# holds 3N blocks, the others 5). On a 7B LoRA at 2,048 tokens the interpolation read 1.7-2.3% above
# the traced ckpt:2-4 peaks (bench/estimate_speed.py): 15% leaves a rung that could fit traced.
SCREEN = 1.15
# The reading with the states in place of full checkpointing's peak lies below the interpolation by
# full checkpointing's activations, so it is over the rung's trace only where those are nearly nothing,
# and then by the interpolation's own 1.7-2.3%: 5% over the budget. A rung screened out wrongly costs
# speed (a slower rung is chosen), never a fit. At 15%, bench/estimate_speed.py's 7B LoRA at 12 GiB
# traced its 4-bit ckpt:3 (13 blocks), whose reading was already more than 5% over and which missed.
SCREEN_BELOW = 1.05


def every_n_between(
    est: Estimates, policy: str, batch_size: int, floor: int, *, trace_full: bool
) -> tuple[int, bool] | None:
    """A ``ckpt:N`` rung's peak read between the same policy without checkpointing (traced as an
    earlier rung: else None) and with every block checkpointed, by the share of blocks that keep
    their activations (Transformers checkpoints blocks 0, N, 2N...); and whether that is a lower
    bound. Full checkpointing's peak is its trace's when it was traced (or ``trace_full``), else
    ``floor``, the states it holds at every moment: below its peak, so the reading is below the
    interpolation's, a lower bound (where it screens nothing, tracing full checkpointing for it
    would be a third trace where two answer)."""
    p = MemoryPolicy.coerce(policy)
    if p.checkpointing.mode != "every_n":
        return None
    d = p.to_dict()
    try:
        plain = MemoryPolicy.from_dict({**d, "checkpointing": {"mode": "none"}}).to_string()
        full = MemoryPolicy.from_dict({**d, "checkpointing": {"mode": "full"}}).to_string()
    except ValueError:
        return None
    if not est.has(plain, batch_size):
        return None
    below = not (trace_full or est.has(full, batch_size))
    layers = num_blocks(est.config)
    kept = layers - -(-layers // p.checkpointing.every_n)  # blocks not checkpointed
    none_peak = est(plain, batch_size).peak_bytes
    full_peak = min(floor, none_peak) if below else est(full, batch_size).peak_bytes
    return full_peak + (none_peak - full_peak) * kept // layers, below


def num_blocks(config: PretrainedConfig) -> int:
    return int(
        getattr(config, "num_hidden_layers", 0)  # 0 and None alike: not set, try the next name
        or getattr(config, "n_layer", 0)
        or getattr(config, "num_layers", 4)
    )
