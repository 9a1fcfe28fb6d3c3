"""How the batch-size finder's ranks agree: every decision that could differ between ranks (a
probe fitted, a cache entry is valid, the next size) goes through one all-reduce of the minimum.

Every agreement is one :func:`~._ranks.share_error`: it carries a code for the point of the
search, so a rank that reached a different point than its peers (a bug, or diverging inputs) is
detected and raises on every rank, instead of silently reducing unrelated values together. An
error on one rank is agreed the same way, so every rank leaves with it and none waits in a collective.
"""

from __future__ import annotations

import torch.distributed as dist

from ..distributed._ranks import RankFailure, same_arguments_on_every_rank, share_error, world_size
from ..errors import BudgetTooSmallError, DistributedMismatchError

__all__ = ["agree", "agree_arguments", "agree_no_error", "is_local_leader", "world_size"]


def is_local_leader() -> bool:
    """The rank that writes node-local files: local rank 0 (every node has its own cache folder)."""
    import os

    if world_size() == 1:
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def agree(tag: str, a: int, b: int = 0) -> tuple[int, int]:
    """The minimum of ``a`` and of ``b`` over all ranks (themselves with one process).

    Raises:
        DistributedMismatchError: on every rank, when the ranks reached different points of the search.
    """
    low_a, low_b = share_error(f"find_batch_size: {tag}", None, values=(a, b))
    return low_a, low_b


def agree_arguments(**arguments: object) -> None:
    """Check that every rank passed the same search arguments (one all-gather). A rank with a
    smaller ``max_batch_size`` or another ``mode`` would end its search while its peers probe on,
    and they would wait in the next agreement until the group's timeout.

    Raises:
        DistributedMismatchError: on every rank, naming each rank's differing argument and rank 0's value.
    """
    same_arguments_on_every_rank("find_batch_size", "only the budget may differ", **arguments)


def agree_no_error(error: BaseException | None, tag: str, *, budget: int, fits: bool = True) -> bool:
    """Agree that no rank failed (one all-reduce, also carrying ``fits``); returns whether every rank fits.

    Raises:
        the rank's own error on the rank that failed; on every other rank a
        :class:`BudgetTooSmallError` (when the failure was one) or a :class:`DistributedMismatchError`
        naming the failed rank(s) and their errors.
    """

    def on_the_others(failed: list[RankFailure]) -> BaseException:
        text = "; ".join(f.describe() for f in failed)
        if all(f.error_type == BudgetTooSmallError.__name__ for f in failed):
            return BudgetTooSmallError(f"another rank's budget cannot hold the step ({text})", budget_bytes=budget)
        return DistributedMismatchError(
            f"find_batch_size failed on another rank ({tag}): {text}", failed_ranks=tuple(f.rank for f in failed)
        )

    return bool(share_error(tag, error, values=(int(fits),), peer_error=on_the_others)[0])
