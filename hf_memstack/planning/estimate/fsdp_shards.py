"""One FSDP rank's bytes, part by part of the step, from the single-device trace.

The estimator traces the step on one device (FSDP needs a process group) and accounts for
``fully_shard`` over ``world`` ranks here. How, and why per part of each phase:

- Every parameter's shard is ``1/world`` of it; the root's parameters (embeddings, final norm,
  head: ``apply_fsdp`` does not reshard the root after its forward) are gathered in full, in the
  compute dtype, from the root's forward to the end of its backward: both are parameters.
- Each block's parameters are gathered while it runs (in the backward also the next block's, which
  FSDP2 prefetches) and freed after: counted with the temporaries, where PyTorch's MemTracker puts
  the gather's buffers on 2 gloo ranks. Where the blocks are not resharded after the forward
  (``shard_grad_op``) every block stays gathered.
- Gradients and optimizer state are sharded; so are the optimizer step's temporaries (it steps the
  local shards).
- Activations and the forward's and backward's temporaries are each rank's own: not divided.

Which moment holds a phase's peak changes with sharding: on one device a 70B full fine-tune's backward
peaks at its end (every gradient alive); sharded 8 ways, at its start (every activation alive). So each
part of each phase (:mod:`hf_memstack.measure.segments`) is accounted before the phase's highest is taken,
never the single-device peak divided afterwards (which read a 70B's forward+backward peak below its
resident parameters, and ``loss:chunked``'s activations as the optimizer phase's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...measure.accounting import tensor_bytes
from ...measure.memory import PhasePeaks
from ...policy import MemoryPolicy
from ...record import record_of
from ...transforms.fsdp import reshard_after_forward
from ..model.fake import blocks_or_empty
from .fsdp_dtypes import copies_of

__all__ = ["FsdpShards", "fsdp_shards"]

_FORWARD, _BACKWARD = 0, 1


@dataclass(frozen=True, slots=True)
class FsdpShards:
    """What one rank holds of a model sharded over ``world`` ranks."""

    world: int
    root_gathered: int
    """The root's parameters gathered, in the compute dtype (held through the forward and backward)."""
    block_gathered: int
    """One block's parameters gathered, in the compute dtype."""
    root_reduce: int
    """The root's gradients being reduce-scattered at the end of the backward: unsharded in fp32 (a 16-bit
    compute dtype's cast to it: ``apply_fsdp`` reduces in fp32), the reduce-scatter's input and output."""
    grads: int
    """Every trainable parameter's gradient, unsharded, at the model's full depth."""
    layers: int
    """The model's blocks (at its full depth)."""
    reshard: bool
    """Whether blocks are resharded after their forward (full_shard) or stay gathered (shard_grad_op)."""
    cpu_offload: bool
    block_cast: int = 0
    """One block's parameters as the trace copies them to the compute dtype and its backward keeps them
    (:mod:`.fsdp_dtypes`; 0 when they are in it already): a rank uses its gathered ones, makes no copy."""
    root_cast: int = 0
    """The same of the parameters outside the blocks (the head's, the final norm's)."""
    root_made: int = 0
    """All the root's parameters as the trace copies them (alive through its forward)."""
    block_made: int = 0
    """All one block's parameters as the trace copies them (alive through the block's forward)."""
    root_grads: int = 0
    """Those of the parameters outside the blocks."""
    head_grad: int = 0
    """The head's gradient as a chunked loss computes it in the forward (0: none computes it there)."""
    checkpointed: bool = False
    """Every block checkpointed: the backward recomputes one block's copies at a time, none are saved."""

    def per_rank(self, phase: int, segment: tuple[str, int] | None, peak: dict[str, int]) -> dict[str, int]:
        """One part of one phase (``segment``: ``pre``, ``post``, or a block) as one rank holds it."""
        w = self.world
        states = 0 if self.cpu_offload else 1  # offloaded shards live in host memory
        out = dict(peak)
        out["param"] = states * (peak["param"] // w)
        out["grad"] = states * (peak["grad"] // w)
        out["opt"] = states * (peak["opt"] // w)
        if phase > _BACKWARD:  # the optimizer step: per parameter, on the local shards only
            out["temp"] = peak["temp"] // w
            return _totalled(out)
        # The backward's end: the blocks' gradients sharded; the root's being reduce-scattered (its shard is
        # that's output); the head's gradient a chunked loss made in the forward still held, as an activation.
        blocks_grads = states * ((self.grads - self.root_grads) // w)
        at_end = _totalled({**out, "grad": blocks_grads, "act": self.head_grad, "temp": self.root_reduce})
        copies = self._cast_copies(phase, segment)
        out["act"] = max(0, peak["act"] - copies)
        out["temp"] = max(0, peak["temp"] - max(0, copies - peak["act"]))
        out["param"] += self.root_gathered
        out["temp"] += self.block_gathered * self._blocks_gathered(phase, segment)
        if phase == _BACKWARD and (segment is None or segment[0] == "post"):
            # The backward's end: the root resharded, its gradients reduce-scattered, every other one sharded.
            return max(_totalled(out), at_end, key=lambda c: c["total"])
        return _totalled(out)

    def _blocks_gathered(self, phase: int, segment: tuple[str, int] | None) -> int:
        if not self.reshard:
            return self.layers  # shard_grad_op: gathered in the forward, freed by each block's backward
        kind, k = segment if segment is not None else ("block", 1)
        if kind in ("pre", "post"):
            # The embeddings' part (forward "pre", backward "post") holds no block; the head's (forward
            # "post", backward "pre") the last block's, still gathered, then prefetched (2 gloo ranks).
            return int((phase == _BACKWARD) == (kind == "pre"))
        # A block's own; in the backward also the one before it (prefetched), but block 0 has none.
        first_block = kind in ("first", "block") and k == 0
        return 1 + int(phase == _BACKWARD and not first_block)

    def _cast_copies(self, phase: int, segment: tuple[str, int] | None) -> int:
        """The trace's compute-dtype copies of the parameters alive in this part, which no rank holds
        (:mod:`.fsdp_dtypes`): the root's all through the forward, then those its backward keeps; each
        block's that its backward keeps, of every block so far (a checkpointed block's: in its recompute)."""
        kind, k = segment if segment is not None else ("block", self.layers - 1)
        kept = 0 if self.checkpointed else self.layers * self.block_cast
        if kind == "pre":  # the forward's embeddings; the backward's head
            return self.root_made if phase != _BACKWARD else self.root_cast + kept
        if kind == "post":  # the forward's head; the backward's embeddings (the root's kept copies: used)
            return self.root_made + kept if phase != _BACKWARD else 0
        done = k + 1 if kind in ("first", "block") else self.layers - k  # blocks to here, counted from the input
        if phase != _BACKWARD:  # the root's and this block's, and what the blocks before it keep
            return self.root_made + self.block_made + (0 if self.checkpointed else (done - 1) * self.block_cast)
        # A checkpointed block's: all its recompute swapped in, held to the end of its backward.
        return self.block_made if self.checkpointed else done * self.block_cast

    def saved_copies_per_block(self) -> int:
        """The compute-dtype copies each block adds to what the traced forward leaves (none checkpointed)."""
        return 0 if self.checkpointed else self.block_cast

    def saved(self, traced: PhasePeaks) -> PhasePeaks:
        """The activations the forward leaves, less the autocast copies a rank does not make."""
        copies = self.root_cast + (0 if self.checkpointed else self.layers * self.block_cast)
        return PhasePeaks(peaks=traced.peaks, forward_activations=max(0, traced.forward_activations - copies))

    def phases(self, traced: PhasePeaks) -> PhasePeaks:
        """A traced step's phases as one rank holds them: each part accounted, then the highest."""
        peaks = []
        for i, peak in enumerate(traced.peaks):
            parts = traced.segments[i] if i < len(traced.segments) and traced.segments[i] else {None: peak}
            peaks.append(max((self.per_rank(i, s, p) for s, p in parts.items()), key=lambda c: c["total"]))
        return self.saved(PhasePeaks(peaks=tuple(peaks), forward_activations=traced.forward_activations))


def _head_grad(net: nn.Module, compute: torch.dtype | None) -> int:
    """The trainable head's gradient as the chunked loss makes it: the weight's in the compute dtype, the
    bias's in fp32 (``_FusedLinearCrossEntropy``)."""
    get = getattr(net, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return 0
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    out = 0
    if isinstance(weight, torch.Tensor) and weight.requires_grad:
        out += weight.numel() * (compute.itemsize if compute is not None else weight.element_size())
    if isinstance(bias, torch.Tensor) and bias.requires_grad:
        out += bias.numel() * 4
    return out


def _totalled(peak: dict[str, int]) -> dict[str, int]:
    return {**peak, "total": sum(v for k, v in peak.items() if k != "total")}


def fsdp_shards(
    net: nn.Module, policy: MemoryPolicy, world: int, layers: int | None, *, chunked_loss: bool = False
) -> FsdpShards | None:
    """How ``policy`` shards the traced ``net`` over ``world`` ranks (None: it does not). ``layers``:
    the model's blocks at its full depth (``net`` may be a shallow copy). ``chunked_loss``: the loss is
    ``loss:chunked``'s, which computes the head's gradient in the forward."""
    if policy.fsdp.mode == "none" or world < 2:
        return None
    blocks = blocks_or_empty(net)
    record = record_of(net)  # the precision prepare_model resolved ("auto": the target device's)
    resolved = getattr(record, "precision", None)
    compute = resolved.dtype if resolved is not None and resolved.mixed else None

    def gathered(params: list[nn.Parameter]) -> int:
        # FSDP2 gathers floating parameters in its param_dtype (the policy's), others as they are.
        return sum(
            p.numel() * compute.itemsize if compute is not None and p.is_floating_point() else tensor_bytes(p)
            for p in params
        )

    inside = {id(p) for b in blocks for p in b.parameters()}
    root_params = [p for p in net.parameters() if id(p) not in inside]
    root = gathered(root_params)
    trained = [p for p in root_params if p.requires_grad]
    # Unsharded, cast to fp32 (measured under bf16 on 2 gloo ranks: 2.5x the root's fp32 bytes, as under
    # fp32), then copied into the fp32 reduce-scatter input, whose output is the shard.
    reduced = sum(p.numel() * 4 for p in trained)
    root_reduce = reduced + reduced * (world + 1) // world
    block = max((gathered(list(b.parameters())) for b in blocks), default=0)

    copies = copies_of(net)  # the compute-dtype copies the trace made in a rank's stead (None: fp32)
    per_block = max((sum(tensor_bytes(p) for p in b.parameters() if p.requires_grad) for b in blocks), default=0)
    depth = layers or len(blocks)
    return FsdpShards(
        grads=sum(tensor_bytes(p) for p in trained) + per_block * depth,
        root_grads=sum(tensor_bytes(p) for p in trained),
        head_grad=_head_grad(net, compute) if chunked_loss else 0,
        world=world,
        root_gathered=root,
        block_gathered=block,
        root_reduce=root_reduce,
        layers=depth,
        reshard=reshard_after_forward(policy.fsdp),
        cpu_offload=policy.fsdp.cpu_offload,
        block_cast=copies.block if copies is not None else 0,
        root_cast=copies.root if copies is not None else 0,
        root_made=copies.root_made if copies is not None else 0,
        block_made=copies.block_made if copies is not None else 0,
        checkpointed=policy.checkpointing.mode == "full",
    )
