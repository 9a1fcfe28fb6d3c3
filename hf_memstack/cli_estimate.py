"""``hf-memstack estimate --policy a,b``: several policies are alternatives, each estimated or refused
on its own - one this model or job cannot take (``quant:nf4`` over a mixture-of-experts router)
leaves the others' answers standing."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from .policy import MemoryPolicy

if TYPE_CHECKING:
    from .planning import MemoryEstimate

__all__ = ["Refused", "Row", "estimate_each", "label_fraction_option", "refusal_lines", "verdict"]


@dataclass(frozen=True, slots=True)
class Refused:
    """A policy of several that the estimator refused for this model or job: its row says so and why."""

    policy: str
    reason: str


Row = Union["MemoryEstimate", Refused]


def estimate_each(policies: list[str], estimate: Callable[[str], MemoryEstimate]) -> list[Row]:
    """Each policy's estimate, or its refusal (what the estimator raises for bad input: ValueError,
    TypeError, ImportError). A policy that does not parse is a typo, refused for the whole command
    before any trace; a single policy's refusal is raised as it always was."""
    for policy in policies:
        MemoryPolicy.coerce(policy)
    rows: list[Row] = []
    for policy in policies:
        try:
            rows.append(estimate(policy))
        except (ValueError, TypeError, ImportError) as e:
            if len(policies) == 1:
                raise
            rows.append(Refused(policy, str(e)))
    return rows


def refusal_lines(rows: list[Row]) -> list[str]:
    """Why every policy was refused, each reason once - with its policy when they differ."""
    refused = [r for r in rows if isinstance(r, Refused)]
    reasons = list(dict.fromkeys(r.reason for r in refused))
    return reasons if len(reasons) == 1 else [f"{r.policy}: {r.reason}" for r in refused]


def verdict(row: Row, budget: int | None) -> bool:
    """Whether a row's policy can be used: answered, and within ``budget`` when there is one. What an
    estimate needs of the device is the step's peak; evaluating, the forward's peak plus the logits
    Trainer keeps there until the loop ends (eval_accumulation_steps moves them off it)."""
    if isinstance(row, Refused):
        return False
    needed = row.peak_bytes + row.eval_logits_bytes if row.mode == "eval" else row.peak_bytes
    return budget is None or needed <= budget


def label_fraction_option(parser: argparse.ArgumentParser) -> None:
    """``--label-fraction`` of ``estimate`` and ``plan``: the share of positions the chunked head runs over."""
    parser.add_argument(
        "--label-fraction",
        type=_label_fraction,
        default=1.0,
        help="the share of token positions with a label (not -100), e.g. 0.4 when prompts take 60%% of the tokens: "
        "loss:chunked runs its head over those only (default 1.0: every position)",
    )


def _label_fraction(value: str) -> float:
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(f"--label-fraction={value!r} must be a number in (0, 1], e.g. 0.5")
    return fraction
