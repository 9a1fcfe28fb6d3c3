"""``hf-memstack estimate --policy a,b``: several policies are alternatives, each estimated or refused
on its own - one this model or job cannot take (``quant:nf4`` over a mixture-of-experts router)
leaves the others' answers standing. Also the options estimate and plan share (--device, --dtype, a
vision-language model's --image-size and --images-per-sample, --packed)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ..policy import MemoryPolicy

if TYPE_CHECKING:
    from ..planning import MemoryEstimate

__all__ = [
    "Refused",
    "Row",
    "device_option",
    "dtype_option",
    "estimate_each",
    "image_options",
    "keep_outputs_option",
    "label_fraction_option",
    "packed_option",
    "refusal_lines",
    "verdict",
]


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


def device_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help=f"{what}; default: this machine")


# planning.weights_dtype.DTYPE_CHOICES, spelled here: importing it imports torch, and --help must not
# (tests/unit/test_import.py keeps the two equal).
DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")


def dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="the weights' dtype: auto (default: what from_pretrained gives - the config's dtype, else the saved "
        "weights'; fp32 for a config naming none), or fp32, bf16, fp16 to estimate another load",
    )


def keep_outputs_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-outputs",
        action="store_true",
        help="the training loop keeps the model's outputs through the backward (outputs = model(**batch); "
        "outputs.loss.backward()): count them (fp32 logits under bf16/fp16); default: dropped, as Trainer and the recipe do",
    )


def packed_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--packed",
        action="store_true",
        help="rows packed with several samples each, position_ids restarting, as --packing on / "
        "DataCollatorWithFlattening make them (estimate_memory's and plan_policy's packed=True)",
    )


def image_options(parser: argparse.ArgumentParser) -> None:
    """A vision-language model's images (estimate_memory's image_size= and images_per_sample=)."""
    parser.add_argument(
        "--image-size",
        type=_count("--image-size", 1),
        default=None,
        help="vision-language models: pixels a side of each image given to the processor (default: the family's, "
        "from the config - said in the notes)",
    )
    parser.add_argument(
        "--images-per-sample",
        type=_count("--images-per-sample", 0),
        default=None,
        help="vision-language models: images in each sample (default 1; 0: text only); their tokens count in --seq-len",
    )


def _count(flag: str, least: int) -> Callable[[str], int]:
    import argparse

    def parse(value: str) -> int:
        if not value.strip().isdigit() or int(value) < least:
            raise argparse.ArgumentTypeError(f"{flag}={value!r} must be an integer of at least {least}")
        return int(value)

    return parse


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
