"""The chunked loss rung's speed factor at a label fraction: ``loss:chunked`` runs the output head
over the labelled positions only (a prompt-masked batch's head costs its labelled share), so its
step is faster than the factor measured with every position labelled, by the head's share of the step.

The model: a step at every position (label fraction 1.0) is the backbone's work and the head's,
``s`` the head's share of it; at a fraction ``f`` the head does ``f`` of its work, so the step takes
``1 - s (1 - f)`` of its time, and the rung's factor over the model's own loss (which runs every
position through the head) is ``MEASURED_SPEED["loss_chunked"] / (1 - s (1 - f))`` - the measured
1.07 at ``f = 1`` whatever the model. The head's time scales with ``f``: measured by
``bench/loss_head.py`` (vocabulary 32k, the head and its loss alone), the same chunks over the
labelled positions only took 0.42x / 0.19x of Transformers' loss at 50% / 80% masked, against
0.82-0.89x at every position: 0.47-0.51 and 0.21-0.23 of it, about ``f``.

``s`` is counted in FLOPs per position, forward and backward (3x the forward's): the head's
``6 h V``; the backbone's ``6 N`` over its parameters other than the embeddings and the head, and
attention's ``12 L h T`` over the row's ``T`` positions (not halved by the causal mask), weighted by
:data:`BACKBONE_COST`. Measured on the ladder model (bf16, the AMD EPYC of ``bench/results/``), a FLOPs
share of 0.42 held 0.27 of the time: the chunked step took 2.04 s (``ladder.json``, batch 4 x 256)
and the chunked head alone over 1,024 tokens 0.56 s (``loss_head_bf16.json``: 1.11 s over 2,048) -
the backbone's narrower matmuls, its elementwise work and AdamW's update of every weight cost about
1.9x a head FLOP. A mixture of experts counts every expert where a token runs a few: its share is
under-counted, and its factor promises less than its step gives. A LoRA run drops the
frozen weights' gradients in the head and the backbone alike (``4 h V`` and ``4 N``): the share barely
moves. ``s`` is at most :data:`MOST_HEAD_SHARE`. The ladder's rungs run eagerly: a model compiled
whole (``compile``) runs every position through its head (a graph takes no data-dependent row count),
and gains nothing from the fraction.

The chunked head is lighter than the model's own loss and, at a label fraction below 1, faster: a
plan whose policy fits without it (the ladder's first rung, plain mixed precision) takes it anyway
when it is faster by :data:`FASTER_BY` or more (:func:`add_chunked_for_speed`) - where the ladder
would offer it (a causal LM whose head the chunked loss takes) and the loop drops the outputs (the
chunked head returns no logits). At every position (``f = 1``) the plan is the walk's, as it always was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ...policy import MemoryPolicy
from ..estimate.depth import num_layers, text_config
from .estimates import max_batch
from .result import PlanRow
from .rungs import MEASURED_SPEED, Requirement, RungContext
from .states_floor import parameter_count
from .walk import choose

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from .estimates import Estimates
    from .result import Plan

__all__ = [
    "BACKBONE_COST",
    "FASTER_BY",
    "MOST_HEAD_SHARE",
    "add_chunked_for_speed",
    "chunked_loss_speed",
    "head_share",
    "speed_note",
]

BACKBONE_COST = 1.9
"""What a backbone FLOP costs in head FLOPs (measured on the ladder model: see the module's docstring);
on a GPU, whose wide matmuls run the backbone nearer the head's rate, it under-counts the head's share."""

MOST_HEAD_SHARE = 0.9
"""The largest share of a step the head is taken to be. A step holds work no matmul count sees
(AdamW's update of every weight, the embedding's gradient, the elementwise ops, the data): a model
whose head is nearly all its FLOPs (a tiny hidden size under a large vocabulary) is not promised a
step of less than a tenth of its time, whatever the fraction - the factor is bounded by
``MEASURED_SPEED["loss_chunked"] / (1 - MOST_HEAD_SHARE)``."""


FASTER_BY = 1.15
"""The least predicted speed-up for which a plan that fits without the chunked head takes it. The
CPU timings behind the factors differ by 5-8% within noise (selective checkpointing's two variants
read 0.95x and 1.00x on the ladder; the chunked head alone 0.82-0.89x of Transformers' loss over
interleaved runs, issue 41), so the measured 1.07x at every position is no promise, and the head's
factor is measured on one model: a gain is taken when it is about twice that spread."""


def head_share(config: PretrainedConfig, *, task: str, dtype: torch.dtype, seq_len: int) -> float:
    """The output head's share of a training step's FLOPs at every position (see the module's
    docstring), at most :data:`MOST_HEAD_SHARE`; 0.0 where the config names no hidden size or vocabulary."""
    text = text_config(config)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if hidden <= 0 or vocab <= 0:
        return 0.0
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    embeddings = vocab * hidden * (1 if tied else 2)  # the input embedding, and the head when untied
    backbone = max(0, parameter_count(config, task=task, dtype=dtype) - embeddings)
    head_flops = 6 * hidden * vocab
    backbone_flops = BACKBONE_COST * (6 * backbone + 12 * (num_layers(config) or 0) * hidden * seq_len)
    return min(MOST_HEAD_SHARE, head_flops / (head_flops + backbone_flops))


def chunked_loss_speed(share: float, label_fraction: float) -> float:
    """The chunked loss rung's step speed over the model's own loss, with the head ``share`` of the
    step at every position and ``label_fraction`` of the positions labelled."""
    share = min(max(share, 0.0), MOST_HEAD_SHARE)
    return MEASURED_SPEED["loss_chunked"] / (1 - share * (1 - label_fraction))


def speed_note(share: float, label_fraction: float) -> str:
    """The plan's line on the chunked head's speed at a label fraction below 1 ('' at 1.0)."""
    if label_fraction >= 1:
        return ""
    return (
        f"loss:chunked's head runs over the labelled {label_fraction:.0%} of the positions (label fraction "
        f"{label_fraction:.2f}; the head ~{share:.0%} of a step's work at every position): its rungs step "
        f"{chunked_loss_speed(share, label_fraction):.2f}x the model's own loss, against "
        f"{MEASURED_SPEED['loss_chunked']:.2f}x at every position; compiled, prefer compile:regional "
        "(a model compiled whole runs every position through its head)"
    )


def add_chunked_for_speed(
    plan: Plan,
    est: Estimates,
    context: RungContext,
    *,
    label_fraction: float,
    keep_outputs: bool,
    batch_size: int | Literal["max"],
    usable: float,
) -> None:
    """Make ``plan`` (one that fits) the same policy with ``loss:chunked`` when the chunked head is
    faster by :data:`FASTER_BY` or more at ``label_fraction`` (below 1), the ladder offers it
    (``context``: a causal LM whose head it takes) and the loop does not keep the outputs (it returns
    no logits); it is estimated, and chosen only if it fits (it holds less: no logits, no fp32 copy).
    Its row joins the table, and :attr:`Plan.chunked_for_speed` says why."""
    factor = context.chunked_loss_speed
    chosen = plan.policy
    if (
        chosen is None
        or chosen.loss.mode != "default"
        or label_fraction >= 1
        or keep_outputs
        or factor < FASTER_BY
        or Requirement.CAUSAL_LM not in context.satisfied
    ):
        return
    faster = MemoryPolicy.from_dict({**chosen.to_dict(), "loss": {"mode": "chunked"}}).to_string()
    was = next((r for r in plan.rows if MemoryPolicy.coerce(r.policy) == chosen), None)
    speed = (was.relative_speed if was is not None else 1.0) * factor
    if batch_size == "max":
        fitted, estimate = max_batch(est, faster, usable)
    else:
        estimate = est(faster, int(batch_size))
        fitted = int(batch_size) if estimate.peak_bytes <= usable else 0
    maximum = fitted if batch_size == "max" else None
    plan.rows.append(PlanRow(faster, estimate.peak_bytes, fitted >= 1, speed, maximum))
    if fitted < 1 or fitted < plan.batch_size:
        return  # lighter than the policy that fit, so not expected: the walk's answer stands
    before = chosen.to_string()
    choose(plan, faster, fitted, estimate)
    plan.chunked_for_speed = (
        f"loss:chunked added for speed: the head runs over the labelled {label_fraction:.0%} of the positions, "
        f"x{factor:.2f} predicted over {before} (which fits too); a loop that reads the logits keeps the "
        "outputs (plan_policy(keep_outputs=True), hf-memstack plan --keep-outputs) and is planned without it"
    )
    # A model compiled whole runs every position through its head: regional compilation keeps the gain.
    plan.suggestions[0] = (
        f"add compile:regional ('{faster}+compile:regional') for speed: it needs no more memory, and "
        "keeps the head over the labelled positions (compile, the whole model, runs it over every position)"
    )
