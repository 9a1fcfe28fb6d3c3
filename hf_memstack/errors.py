"""The exception types hf_memstack raises on purpose, so callers can catch them by type instead
of matching message text. Each subclasses ``ValueError`` (bad input), so code written against
earlier releases, which caught ``ValueError``, keeps working."""

from __future__ import annotations

__all__ = ["BudgetTooSmallError", "DistributedMismatchError", "PolicyError"]


class PolicyError(ValueError):
    """A policy that cannot be applied; ``problems`` lists each one (all are reported at once)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid memory policy ({len(self.problems)} problem(s)):\n{lines}")


class BudgetTooSmallError(ValueError):
    """The memory budget cannot hold even the smallest training step: the answer "does not fit",
    as opposed to an input error. ``needed_bytes`` is what the smallest step took (None when it
    ran out of memory before it could be measured)."""

    def __init__(self, message: str, *, budget_bytes: int, needed_bytes: int | None = None):
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        super().__init__(message)


class DistributedMismatchError(ValueError, RuntimeError):
    """The ranks of a process group disagree (policy, model, or a pre-flight check failed on some
    rank): raised on every rank, before any collective that could wait forever. Also a
    ``RuntimeError``, which earlier releases raised for these cases."""

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...] = ()):
        self.failed_ranks = failed_ranks
        super().__init__(message)
