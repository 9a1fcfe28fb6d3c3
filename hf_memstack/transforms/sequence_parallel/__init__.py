"""Ulysses sequence parallelism (``sp:N``): each of N ranks holds ``1/N`` of every row's tokens, and
each attention layer exchanges q/k/v (all-to-all) so that every rank attends with ``H/N`` heads over
the whole rows; everything else (norms, MLPs, the chunked loss) runs on the rank's own tokens.

apply.py      check_sequence_parallel / apply_sequence_parallel: the refusals, the group, the switch
attention.py  the attention implementation ``hf_memstack_ulysses`` and its mask function
exchange.py   the all-to-all and the position ids' all-gather as custom ops (fake shapes, backward)
guard.py      the check at the top of each forward: the group's ranks got one shape, no router loss, no
              Trainer without the hooks
group.py      the process group: N contiguous ranks, with the default group's timeout
reduce.py     backward_loss / average_gradients / reported_loss: the loss and gradients summed over the group
shard.py      shard_batch / SequenceShardCollator / drop_right_padding: one full batch -> this rank's slice
verify.py     verify's ``sequence parallel`` line: the sharded step against the same step unsharded

Touch points outside this folder (``tests/unit/test_layout.py`` keeps the list true: every module
outside it that imports from here or reads the policy field this folder implements is listed, and each
``name`` below is in the file named):

- ``hf_memstack/policy/tokens.py``: the ``Token("sp:N"`` row of the token table
- ``hf_memstack/policy/config.py``: ``SequenceParallelConfig``, the policy's field
- ``hf_memstack/prepare.py``: ``check_process_group``, ``check_sequence_parallel``, ``apply_sequence_parallel``
- ``hf_memstack/record.py``: ``SequenceParallelResult`` on the record
- ``hf_memstack/data/boundaries.py``: ``ULYSSES_ATTENTION`` keeps packed samples apart (the packing guard)
- ``hf_memstack/measure/verify.py``: ``verify_sequence_parallel`` (its line), ``shard_for_rank`` (the other checks' batch)
- ``hf_memstack/integrations/trainer_sequence.py``: ``TRAINER_MARK``, ``sequence_parallel_size``, ``drop_right_padding``
  and ``shard_batch``: the Trainer's loader re-keyed by sequence group, each rank's slice; reads
  ``policy.sequence_parallel`` (what the Trainer's arguments cannot honour)
- ``hf_memstack/integrations/trainer.py``: ``sequence_parallel_size`` and ``shard_for_rank`` (the callback's first-batch pass)
- ``hf_memstack/integrations/trainer_args.py``: reads ``policy.sequence_parallel`` (no batch-size finder; a group reads one batch)
- ``recipes/finetune.py``: ``backward_loss`` and ``average_gradients`` in ``micro_step``
- ``recipes/finetune_support/sequence.py``: ``shard_batch`` on each batch, ``sequence_parallel`` groups
- ``recipes/finetune_support/batching.py``: ``sequence_parallel_size`` (the data-parallel width)
- ``hf_memstack/planning/estimate/sequence_shards.py``: ``ULYSSES_ATTENTION``, ``register_ulysses_attention``,
  ``active_group``, ``set_active_group``, ``register_group`` and ``rows_as_traced``: one rank traced through
  Ulysses on fake exchanges (a shapes-only group), its rows' samples laid out; reads ``policy.sequence_parallel``
- ``hf_memstack/planning/plan/advice.py``: reads ``policy.sequence_parallel`` (more ranks for the sequence)
- ``hf_memstack/planning/plan/rungs.py``: reads ``policy.sequence_parallel`` (the sharding's speed factor)
- ``hf_memstack/planning/plan/walk.py``: reads ``p.sequence_parallel`` (a rung's own degree is not lent over)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy_exports

if TYPE_CHECKING:
    from .apply import SequenceParallelPlan, SequenceParallelResult, apply_sequence_parallel, check_sequence_parallel
    from .attention import (
        ULYSSES_ATTENTION,
        active_group,
        kv_replication,
        register_ulysses_attention,
        set_active_group,
        ulysses_attention_forward,
        ulysses_mask,
    )
    from .exchange import SequenceParallelGroup, gather_positions, head_to_seq, register_group, seq_to_head
    from .group import check_process_group, sequence_parallel_group
    from .reduce import average_gradients, backward_loss, reported_loss, sequence_parallel_size
    from .shard import SequenceShardCollator, drop_right_padding, shard_batch, shifted_targets
    from .verify import verify_sequence_parallel

# public name -> the module of this folder that defines it
_EXPORTS = {
    "SequenceParallelPlan": ".apply",
    "SequenceParallelResult": ".apply",
    "apply_sequence_parallel": ".apply",
    "check_sequence_parallel": ".apply",
    "ULYSSES_ATTENTION": ".attention",
    "active_group": ".attention",
    "kv_replication": ".attention",
    "register_ulysses_attention": ".attention",
    "set_active_group": ".attention",
    "ulysses_attention_forward": ".attention",
    "ulysses_mask": ".attention",
    "SequenceParallelGroup": ".exchange",
    "gather_positions": ".exchange",
    "head_to_seq": ".exchange",
    "register_group": ".exchange",
    "seq_to_head": ".exchange",
    "check_process_group": ".group",
    "sequence_parallel_group": ".group",
    "average_gradients": ".reduce",
    "backward_loss": ".reduce",
    "reported_loss": ".reduce",
    "sequence_parallel_size": ".reduce",
    "verify_sequence_parallel": ".verify",
    "SequenceShardCollator": ".shard",
    "drop_right_padding": ".shard",
    "shard_batch": ".shard",
    "shifted_targets": ".shard",
}

__all__ = [
    "SequenceParallelGroup",
    "SequenceParallelPlan",
    "SequenceParallelResult",
    "SequenceShardCollator",
    "ULYSSES_ATTENTION",
    "active_group",
    "apply_sequence_parallel",
    "average_gradients",
    "backward_loss",
    "check_process_group",
    "check_sequence_parallel",
    "drop_right_padding",
    "gather_positions",
    "head_to_seq",
    "kv_replication",
    "register_group",
    "register_ulysses_attention",
    "reported_loss",
    "seq_to_head",
    "sequence_parallel_group",
    "sequence_parallel_size",
    "set_active_group",
    "shard_batch",
    "shifted_targets",
    "ulysses_attention_forward",
    "ulysses_mask",
    "verify_sequence_parallel",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
