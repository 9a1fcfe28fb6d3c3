"""The data side of a training step: boundary-aware packing of samples into rows, the collator
that turns rows into batches (``position_ids`` restarting at every sample, no 2-D mask), and the
checks that a packed batch does not silently let samples attend to each other.

Packing lives here, apart from ``transforms/`` (what ``prepare_model`` does to a model) and
``measure/`` (what a step costs), because it changes the batches, not the model: the library's
guard, ``verify``, the finder and the estimator read packed batches through
:mod:`hf_memstack.data.boundaries`, and the recipes build them with :mod:`.packing` and :mod:`.collator`; :mod:`.label_fraction`
measures the share of positions that carry a label (the chunked head's rows) for the planner.
"""

from __future__ import annotations

from .boundaries import PackedComparison, check_packed_batch, compare_packed_to_separate, is_packed, segment_lengths
from .collator import PackedCollator
from .label_fraction import LabelFraction, measure_label_fraction
from .packing import PackingPlan, PackingStats, pack_dataset, padding_stats, plan_rows

__all__ = [
    "LabelFraction",
    "PackedCollator",
    "PackedComparison",
    "PackingPlan",
    "PackingStats",
    "check_packed_batch",
    "compare_packed_to_separate",
    "is_packed",
    "measure_label_fraction",
    "pack_dataset",
    "padding_stats",
    "plan_rows",
    "segment_lengths",
]
