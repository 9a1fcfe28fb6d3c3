"""What hf-memstack prints and draws: the estimate's table, JSON and verdicts, and the --plot picture.

Kept apart from cli/main.py, which parses the command line and runs the estimator, planner or finder:
the layout of the results changes without touching how they are computed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .._text import printable
from ..sizes import format_bytes
from .estimate import Refused, Row

if TYPE_CHECKING:
    from ..planning import MemoryEstimate

__all__ = ["plot_breakdown", "print_estimates", "require_matplotlib"]


def print_estimates(rows: list[Row], verdicts: list[bool], *, budget: int | None, mode: str, as_json: bool) -> None:
    """Print one row per policy's estimate (or refusal), with its verdict when there is a budget (JSON for scripts)."""
    if as_json:
        _print_json(rows, verdicts, budget)
        return
    estimates = [e for e in rows if not isinstance(e, Refused)]
    _print_table(rows, verdicts, budgeted=budget is not None, kept=mode == "eval")
    for note in dict.fromkeys(n for e in estimates for n in e.notes):
        print(f"note: {printable(note)}")  # notes may quote a received config's text
    for r in rows:
        if isinstance(r, Refused):
            print(f"{printable(r.policy)}: refused: {printable(r.reason)}")
    if budget is not None:
        _print_verdicts(rows, verdicts, budget)


def _print_json(rows: list[Row], verdicts: list[bool], budget: int | None) -> None:
    # Without a budget there is no verdict: null, not true (a script reading "fits" must not be told
    # that a 135 GiB peak fits). A refused row has no estimate: its policy and the reason, and it
    # does not fit (it cannot be used).
    budgeted = budget is not None
    print(
        json.dumps(
            {
                "estimates": [
                    {"policy": e.policy, "refused": e.reason, "fits": False if budgeted else None}
                    if isinstance(e, Refused)
                    else {**e.as_dict(), "refused": None, "fits": ok if budgeted else None}
                    for e, ok in zip(rows, verdicts)
                ],
                "budget": budget,
                "fits": any(verdicts) if budgeted else None,
                "fitting_policies": [e.policy for e, ok in zip(rows, verdicts) if ok] if budgeted else None,
                "refused_policies": [e.policy for e in rows if isinstance(e, Refused)],
            },
            indent=2,
        )
    )


def _print_table(rows: list[Row], verdicts: list[bool], *, budgeted: bool, kept: bool) -> None:
    print(
        "| policy | weights | trainable | parameters | gradients | optimizer | activations | temporaries | peak | peak phase |"
        + (" kept logits |" if kept else "")
        + (" fits |" if budgeted else "")
    )
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if kept else "") + ("---|" if budgeted else ""))
    for e, ok in zip(rows, verdicts):
        if isinstance(e, Refused):  # its reason is printed below the table: too long for a cell
            print(f"| {e.policy} | refused |" + " - |" * (8 + kept) + (" refused |" if budgeted else ""))
            continue
        # The load dtype, and the trainable weights' own when the policy changes it (fp32 master weights).
        weights = e.weights_dtype + (
            f" (trains {e.trainable_dtype})" if e.trainable_dtype not in (e.weights_dtype, "none") else ""
        )
        print(
            f"| {e.policy} | {weights} | {e.trainable_parameters:,} of {e.total_parameters:,} | {format_bytes(e.parameters)} | "
            f"{format_bytes(e.gradients)} | {format_bytes(e.optimizer)} | {format_bytes(e.activations)} | "
            f"{format_bytes(e.temporaries)} | {format_bytes(e.peak_bytes)} | {e.peak_phase} |"
            + (f" {format_bytes(e.eval_logits_bytes)} |" if kept else "")
            + (f" {'yes' if ok else 'no'} |" if budgeted else "")
        )


def _print_verdicts(rows: list[Row], verdicts: list[bool], budget: int) -> None:
    refused = sum(isinstance(e, Refused) for e in rows)
    for e, ok in zip(rows, verdicts):
        if isinstance(e, Refused):
            print(f"{e.policy}: refused (see above)")
            continue
        what = f"peak {format_bytes(e.peak_bytes)}" + (
            f" + kept logits {format_bytes(e.eval_logits_bytes)}" if e.mode == "eval" else ""
        )
        print(f"{e.policy}: {'fits' if ok else 'does not fit'} in {format_bytes(budget)} ({what})")
    if len(rows) > 1:
        print(
            f"{sum(verdicts)} of {len(rows)} policies fit"
            + (f" ({refused} refused)" if refused else "")
            + (": exit 0" if any(verdicts) else ": none does, exit 1")
        )


def require_matplotlib() -> None:
    """Fail before any work when --plot cannot draw: not a table first and the failure after it."""
    try:
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install 'hf_memstack[plot]' (or drop --plot); "
            "nothing was estimated"
        ) from None


def plot_breakdown(items: list[tuple[str, MemoryEstimate]], path: str, budget: int | None) -> None:
    """Write a stacked bar per (name, estimate) of its bytes by category, and the budget's line, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ["parameters", "gradients", "optimizer", "activations", "temporaries"]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(items)), 4))
    bottoms = [0.0] * len(items)
    for cat in cats:
        values = [getattr(e, cat) / 2**30 for _, e in items]
        ax.bar([name for name, _ in items], values, bottom=bottoms, label=cat)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if budget:
        ax.axhline(budget / 2**30, color="black", linestyle="--", label="budget")
    ax.set_ylabel("GiB per device")
    ax.set_title("estimated peak of one training step")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
