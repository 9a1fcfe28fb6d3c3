"""One sequence-parallel rank's bytes (``sp:N``, Ulysses): the step traced as one rank runs it.

Under ``sp:N`` each rank holds ``ceil(S/N)`` tokens of every row (``shard_batch`` pads the tail with a
pseudo-sample), and attention runs head-sharded after an all-to-all. The estimator traces one rank:
the step at ``s = ceil(S/N)`` tokens, with the model's attention switched to the real
``hf_memstack_ulysses`` function over a shapes-only group of N (:func:`ulysses_on_fake_tensors`), whose
exchanges' fake implementations return what one rank receives. So every buffer the real step makes is
traced, and the reading equals the meter's on each rank (``tests/distributed/test_sp_estimate.py``).
What that holds, by part (the arithmetic the fields report):

- Everything that scales with the sequence outside attention (embeddings' output, projections, the
  MLP, norms, checkpoint boundaries ``b·s·D``, the logits and the loss head ``b·s·V``): ``s`` tokens.
- Attention after the all-to-all holds the whole row for ``H/N`` heads: ``b·(H/N)·S·d``, the bytes of
  ``b·H·s·d``. Keys and values are exchanged after repeating each kv head ``r = N/gcd(KV, N)`` times
  when ``N`` does not divide ``KV`` (``r = 1`` otherwise): ``r`` times the k/v bytes, kept for the
  backward in every block that is not checkpointed (``kv_repeat_bytes``).
- The all-to-all's transient buffers: while one block's attention runs, the caller still holds the
  local q/k/v (``b·s·d·(H + 2·KV)``, and the repeated k/v ``2·b·s·d·KV·r`` when ``r > 1``) beside the
  exchanged ones, and each exchange makes a send copy and a receive buffer (at most ``2·b·s·d·H``, q's
  or the output's); the gathered position ids and their row-order copy (``2·N·b·s`` int64). One
  block's at a time (forward, recompute or backward), never accumulated (``all_to_all_bytes``): in the
  peak when the peak falls in attention.
- Weights, gradients and optimizer state do not depend on the sequence: unchanged, or sharded over
  every rank under FSDP (which shards over the data x sequence ranks together).
- Packed rows (``packed=True``) and rows N does not divide (a padded tail, a pseudo-sample of its own):
  after the all-to-all each sample of the whole rows is its own SDPA call (``sum(L_i^2)``), from the
  gathered positions. The fake rows are traced as such (:meth:`SequenceShards.traced_rows`), so the
  trace holds what a rank's per-sample run holds beyond an unpacked row's: the samples' outputs and
  their concatenation (``b·(H/N)·S·d``, the bytes of ``b·H·s·d``, transient) and, in the backward,
  the full-size gradient each sample's slice of q, k and v gives back, gathered beside the next
  sample's own; no ``[S, S]`` mask (the positions-derived tensors are ``[b, S]`` integers). Outside
  attention a packed row holds what an unpacked one does. That backward depends on the samples'
  lengths (traced with the real layout, the trace equals the meter to the byte; a long sample after
  short ones holds the most), so the rows are traced at a layout near the worst measured. Under
  ``compile`` the rows run whole with one ``[b, 1, S, S]`` boolean mask, traced so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..._unwrap import unwrap_model
from ...policy import MemoryPolicy
from ...sizes import format_bytes
from ...transforms.sequence_parallel.attention import (
    ULYSSES_ATTENTION,
    active_group,
    register_ulysses_attention,
    rows_as_traced,
    set_active_group,
)
from ...transforms.sequence_parallel.exchange import register_group
from .depth import text_config
from .result import MemoryEstimate

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "SequenceShards",
    "heads_of",
    "sequence_shards",
    "sharded_batch",
    "sp_world",
    "ulysses_on_fake_tensors",
    "with_sequence_shards",
]


@dataclass(frozen=True, slots=True)
class SequenceShards:
    """What one rank of an ``sp:N`` group holds of each row, and the attention's shape."""

    size: int
    """N: ranks each row's tokens are sharded over."""
    seq_len: int
    """S: the row's tokens."""
    tokens: int
    """ceil(S/N): the rank's own tokens (the last rank's shard padded to them)."""
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    itemsize: int
    """Bytes per value of the attention's inputs (the compute dtype)."""
    packed: bool = False
    """Rows of several samples (``position_ids`` restarting)."""
    per_sample: bool = True
    """The attention runs each sample alone (eager); False under compile, whose graphs mask rows whole."""

    def traced_rows(self) -> tuple[tuple[int, ...], ...]:
        """The whole rows' samples as the trace runs them (:func:`rows_as_traced`), tail included: an
        unpacked row one sample (and its padded tail's); a packed row a long sample across every shard
        boundary, then two one-token samples, alike in every row - the layout that held the most of
        those measured (a long sample's gradients arrive beside the full-size ones its row's short
        samples have already given back), as a rank's peak over a run is its worst batch's; ``()``
        (masked whole) where a compiled run reads no samples."""
        total, pad = self.seq_len, self.size * self.tokens - self.seq_len
        tail = (pad,) if pad else ()
        if not self.per_sample and (pad or (self.packed and total > 1)):
            return ()
        if not self.packed or total < 3:
            return ((total, *tail),)
        return ((total - 2, 1, 1, *tail),)

    def per_sample_bytes(self) -> int:
        """The samples' outputs concatenated after their SDPA calls: one more copy of the attention's
        output (``b·(H/N)·S·d``), transient (0 where the rows run whole)."""
        rows = self.traced_rows()
        several = any(len(row) > 1 for row in rows)
        return self.batch * self.tokens * self.heads * self.head_dim * self.itemsize if several else 0

    @property
    def kv_repeat(self) -> int:
        """r: how many times each kv head is repeated before the exchange (1 when N divides KV)."""
        return self.size // math.gcd(self.kv_heads, self.size)

    def all_to_all_bytes(self) -> int:
        """One block's transient exchange: the caller's local q/k/v (and the repeated k/v) held while the
        exchanged ones exist, the send copy and receive buffer of the largest (q), and the gathered
        position ids with their row-order copy."""
        b, s, d, r = self.batch, self.tokens, self.head_dim, self.kv_repeat
        held = self.heads + 2 * self.kv_heads * (1 + (r if r > 1 else 0))
        return b * s * d * (held + 2 * self.heads) * self.itemsize + 2 * self.size * b * s * 8

    def kv_repeat_bytes(self, saved_blocks: int) -> int:
        """The repeated keys' and values' bytes beyond the trace's, in ``saved_blocks`` blocks that keep them."""
        extra = 2 * self.batch * self.tokens * self.head_dim * self.kv_heads * (self.kv_repeat - 1) * self.itemsize
        return extra * saved_blocks


def heads_of(config: PretrainedConfig) -> tuple[int, int, int] | None:
    """(attention heads, kv heads, head dim) of the text model, or None when the config names no heads."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0 or not isinstance(hidden, int):
        return None
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return heads, int(kv), int(head_dim)


def sp_world(policy: MemoryPolicy, world_size: int) -> int:
    """The ranks the estimate is of: ``world_size``, or N when sp:N is asked with ``world_size=1``
    (the default: not given); refused when the ranks cannot form groups of N."""
    n = policy.sequence_parallel.size
    if n == 1 or world_size == 1:
        return max(n, world_size)
    if world_size % n:
        raise ValueError(
            f"policy {policy.to_string()!r} with world_size={world_size}: sp:{n} groups {n} contiguous ranks, "
            f"and {world_size} ranks do not split into groups of {n}; use sp:N with N dividing {world_size} "
            f"({', '.join(f'sp:{k}' for k in range(2, world_size + 1) if world_size % k == 0)}), "
            f"or world_size a multiple of {n}"
        )
    return world_size


def sequence_shards(
    config: PretrainedConfig,
    policy: MemoryPolicy,
    batch: int,
    seq_len: int,
    task: str,
    mode: str,
    packed: bool,
    weights: torch.dtype,
) -> SequenceShards | None:
    """The rank's shard of each row under ``policy``'s sp:N (None without it); refused, with the fix,
    where Ulysses cannot shard this model or job (or where this estimate does not model it)."""
    n = policy.sequence_parallel.size
    if n == 1:
        return None
    where = f"policy {policy.to_string()!r}"
    _check_job(where, n, mode)
    if task != "causal-lm":
        raise ValueError(
            f"{where} with task={task!r}: sequence parallelism shards a causal LM's rows (each rank's "
            "tokens, attention across them by an all-to-all); drop sp:N for a seq2seq or classification model"
        )
    shape = heads_of(config)
    if shape is None:
        raise ValueError(
            f"{where}: the config names no num_attention_heads, which sp:{n} shards over; drop sp:{n} for this model"
        )
    heads, kv, head_dim = shape
    if heads % n:
        allowed = [k for k in range(2, heads + 1) if heads % k == 0]
        raise ValueError(
            f"{where}: sp:{n} splits the attention heads over {n} ranks, and the model has {heads} "
            f"(num_attention_heads), which {n} does not divide; use sp:N with N dividing {heads} "
            f"({', '.join(f'sp:{k}' for k in allowed[:6])}{', ...' if len(allowed) > 6 else ''})"
        )
    layers = getattr(text_config(config), "num_hidden_layers", 0) or 0
    return SequenceShards(
        packed=packed,
        # A compiled run's attention reads no samples: its rows run whole, masked.
        per_sample=policy.compile.mode == "none",
        size=n,
        seq_len=seq_len,
        tokens=-(-seq_len // n),
        batch=batch,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        layers=int(layers),
        # The attention's inputs: in the autocast dtype under a mixed precision, else the weights'.
        itemsize=2 if policy.precision in ("bf16", "fp16") else weights.itemsize,
    )


def _check_job(where: str, n: int, mode: str) -> None:
    if mode != "train":
        raise ValueError(
            f"{where} with mode={mode!r}: evaluation runs unsharded (each rank its own whole rows); "
            f"estimate it without sp:{n}"
        )


def _saved_blocks(policy: MemoryPolicy, layers: int) -> int:
    """The blocks whose attention inputs stay saved for the backward (a checkpointed one recomputes them)."""
    ck = policy.checkpointing
    if ck.mode in ("full", "offload"):
        return 0
    if ck.mode == "every_n":
        return layers - -(-layers // ck.every_n)
    return layers


def with_sequence_shards(est: MemoryEstimate, shards: SequenceShards | None, policy: MemoryPolicy) -> MemoryEstimate:
    """The estimate of one rank (traced at ``shards.tokens`` tokens through the real Ulysses attention, its
    exchanges and repeated k/v included) with the row's length and the sp fields (``est`` itself without sp:N)."""
    if shards is None:
        return est
    saved = _saved_blocks(policy, shards.layers)
    a2a, kv = shards.all_to_all_bytes(), shards.kv_repeat_bytes(saved)
    repeat = f", k/v x{shards.kv_repeat} (kv heads repeated)" if shards.kv_repeat > 1 else ""
    kept = f"; the repeated k/v kept in {saved} blocks, {format_bytes(kv)}, in activations" if kv else ""
    note = (
        f"sp:{shards.size}: one rank of {shards.size}, traced at its {shards.tokens} of the {shards.seq_len} tokens of "
        f"every row through Ulysses attention on fake exchanges: whole rows for {shards.heads // shards.size} of "
        f"{shards.heads} heads (the same bytes{repeat}); one block's all-to-all buffers, about "
        f"{format_bytes(a2a)}, in the peak where it falls in attention{kept}{_packed_note(shards)}; weights, "
        "gradients and optimizer state do not depend on the sequence (FSDP shards them over every rank)"
    )
    return dataclasses.replace(
        est,
        seq_len=shards.seq_len,
        sequence_parallel=shards.size,
        sp_tokens_per_rank=shards.tokens,
        sp_all_to_all_bytes=a2a,
        sp_kv_repeat_bytes=kv,
        notes=(*est.notes, note),
    )


def _packed_note(shards: SequenceShards) -> str:
    """What the note says of packed rows (and of a padded tail): how their samples were traced."""
    rows = shards.traced_rows()
    if not rows:
        which = "packed rows" if shards.packed else "rows with a padded tail"
        return f"; {which} run whole under compile, with one [b, 1, S, S] boolean mask (traced so)"
    if not any(len(row) > 1 for row in rows):
        return ""
    layout = "+".join(map(str, rows[0]))
    if not shards.packed:
        return f"; the padded tail a sample of its own ({layout} tokens), each its own SDPA call after the all-to-all"
    return (
        f"; packed rows traced as {layout} token samples (a long one across the shard boundaries, then short ones: "
        "near the most their per-sample attention's backward held of the layouts measured), each its own SDPA call "
        f"after the all-to-all: their outputs concatenated, about {format_bytes(shards.per_sample_bytes())} more "
        "while one block's attention runs"
    )


@contextlib.contextmanager
def ulysses_on_fake_tensors(net: nn.Module, shards: SequenceShards | None) -> Iterator[None]:
    """The traced model's attention switched to the real Ulysses function (``hf_memstack_ulysses``) over a
    shapes-only group of ``shards.size`` ranks, whose exchanges' fake implementations give the shapes one
    rank holds, its rows' samples as :meth:`SequenceShards.traced_rows` lays them out; the process's own
    group (a real run's) set back after. Nothing without sp:N (None)."""
    if shards is None:
        yield
        return
    try:
        previous = active_group()
    except RuntimeError:  # none set in this process
        previous = None
    register_ulysses_attention()
    set_active_group(register_group(None, size=shards.size))
    unwrap_model(net).set_attn_implementation(ULYSSES_ATTENTION)  # type: ignore[operator]
    try:
        with rows_as_traced(shards.traced_rows()):
            yield
    finally:
        if previous is not None:
            set_active_group(previous)


def sharded_batch(batch: dict[str, torch.Tensor], shards: SequenceShards | None) -> dict[str, torch.Tensor]:
    """A rank's batch as ``shard_batch`` makes it: the rows' global positions (a packed batch's own, which
    on fake tensors are shapes only: the attention reads :meth:`SequenceShards.traced_rows`), the shifted
    targets, the count."""
    if shards is None:
        return batch
    ids = batch["input_ids"]
    positions = batch.get("position_ids", torch.arange(ids.shape[1]).expand_as(ids)).contiguous()
    count = torch.tensor(ids.numel())
    return {**batch, "position_ids": positions, "shift_labels": batch["labels"], "num_items_in_batch": count}
