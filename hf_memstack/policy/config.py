"""The policy's dataclass tree: the sub-configs (checkpointing, compile, FSDP, loss head, 4-bit
base weights, MLP, optimizer) with their fields' documentation, and the allowed values of each
choice (and sequence parallelism's degree). :class:`~hf_memstack.policy.MemoryPolicy` (memory_policy.py)
holds one of each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "MAX_EVERY_N",
    "MAX_SEQUENCE_PARALLEL",
    "SUBCONFIGS",
    "CheckpointingConfig",
    "CompileConfig",
    "FSDPConfig",
    "LossConfig",
    "MLPConfig",
    "OptimizerConfig",
    "QuantConfig",
    "SequenceParallelConfig",
]

# The largest ckpt:N / every_n: one block in N is checkpointed, and no model has more blocks.
MAX_EVERY_N = 10_000
# The largest sp:N: ranks in one sequence-parallel group (each holds 1/N of every row, and N must
# divide the attention heads; no model has more heads than this).
MAX_SEQUENCE_PARALLEL = 1024

Precision = Literal["fp32", "bf16", "fp16", "auto"]
CheckpointingMode = Literal["none", "full", "every_n", "offload", "selective"]
SelectiveMatmuls = Literal["save_all", "save_alternate"]
CompileMode = Literal["none", "full", "regional"]
CompileInductorMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
FSDPMode = Literal["none", "full_shard", "shard_grad_op", "hybrid_shard"]
LossMode = Literal["default", "chunked"]
MLPMode = Literal["default", "tiled"]
OptimizerState = Literal["fp32", "8bit"]
OptimizerStep = Literal["after_backward", "in_backward"]
QuantMode = Literal["none", "nf4"]
MasterWeights = Literal["fp32", "bf16"]


@dataclass(kw_only=True, slots=True)
class CheckpointingConfig:
    """Activation (gradient) checkpointing: keep only block inputs in the forward, recompute the
    rest in the backward. About 50-70% less activation memory for ~20-30% more step time on GPUs."""

    mode: CheckpointingMode = "none"
    """``none``; ``full`` (every block); ``every_n`` (every ``every_n``-th block, trading memory back
    for speed); ``offload`` (every block, and the saved block inputs go to pinned host memory);
    ``selective`` (every block, op by op: the outputs of matmuls and attention are kept, the cheap
    ops between them - norms, activations, rotary, casts - are recomputed in the backward)."""

    selective_matmuls: SelectiveMatmuls = "save_all"
    """With ``mode="selective"``: ``save_all`` keeps every matmul output (least recompute);
    ``save_alternate`` recomputes every second matmul too, as torchtitan's op-level policy does
    (less memory, more recompute)."""

    every_n: int = 2
    """With ``mode="every_n"``: checkpoint one block in ``every_n`` (2 to 10,000; 1 is ``full``).
    Another value with another mode is refused (it would be ignored); 2, the default, is accepted
    with any mode, as ``to_dict`` writes it."""

    use_reentrant: bool = False
    """PyTorch's old reentrant implementation. Off: it breaks with frozen inputs and left the last
    layer untrained under fp16 autocast (transformers#24247)."""

    block_classes: tuple[str, ...] | None = None
    """Class names of the repeated blocks, overriding detection (``_no_split_modules``, then the
    largest list of identical modules). Used by the PyTorch-wrapper fallback, regional compile and FSDP."""


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """torch.compile: about 1.15-2x faster steps after a one-off compile."""

    mode: CompileMode = "none"
    """``none``; ``full`` (the whole model, one graph where it can); ``regional`` (each repeated
    block, compiled once and reused: a much shorter compile for deep models)."""

    backend: str = "inductor"
    """A ``torch.compile`` backend (``inductor``; ``aot_eager`` and ``eager`` for debugging)."""

    inductor_mode: CompileInductorMode | None = None
    """Inductor's ``mode`` (``default``, ``reduce-overhead``, ``max-autotune``,
    ``max-autotune-no-cudagraphs``); only with ``backend="inductor"``."""

    dynamic: bool | None = None
    """``torch.compile(dynamic=...)``: ``None`` lets PyTorch decide (recompile once, then mark the
    changing dimension dynamic)."""

    fullgraph: bool = False
    """Fail instead of splitting the graph at unsupported code."""


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """FSDP2 sharding (``torch.distributed.fsdp.fully_shard``) for models whose parameters,
    gradients and optimizer state do not fit one device. Needs a process group."""

    mode: FSDPMode = "none"
    """``none``; ``full_shard`` (shard params, grads, optimizer state; re-gather per block);
    ``shard_grad_op`` (keep gathered params after forward: faster, more memory);
    ``hybrid_shard`` (shard within a node, replicate across nodes)."""

    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (slowest, smallest)."""

    reshard_after_forward: bool | None = None
    """Free gathered parameters after each block's forward. ``None`` derives it from ``mode``
    (True for ``full_shard`` and ``hybrid_shard``, False for ``shard_grad_op``)."""


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The training loss of a causal language model's output head. Its logits (``batch x seq x
    vocab``) and the fp32 copy Transformers' loss makes of them are often the largest tensors of a
    fine-tuning step, and block checkpointing does not touch them."""

    mode: LossMode = "default"
    """``default``: the model's own forward and loss; ``chunked``: while training with labels, the
    output head and the cross-entropy run a chunk of tokens at a time, so the full logits never
    exist (``outputs.logits`` is then None; without labels or gradients the model's own forward runs)."""

    chunk_tokens: int | None = None
    """Tokens per chunk with ``mode="chunked"``. ``None`` sizes chunks to the vocabulary (about
    16M logits per chunk: 524 tokens for a 32k vocabulary, 130 for 128k)."""

    compiled: bool = False
    """With ``mode="chunked"``: each chunk's softmax, loss and logit gradient run as one
    ``torch.compile``d function (the matmuls stay eager), as cut-cross-entropy's ``torch_compile``
    implementation and torchtune's compiled chunk loss do: fewer passes over each chunk's logits.
    The first step pays the compile; under a memory-tracking mode (the meter, the estimator) the
    chunk runs eagerly, at the same peak."""


@dataclass(kw_only=True, slots=True)
class MLPConfig:
    """Each block's MLP over tiles of tokens. For long sequences its intermediate activations
    (``tokens x intermediate``, 2.7-5x the hidden size) are the largest tensors left while
    checkpointing recomputes a block; tiled, one tile's exist at a time, for one more MLP forward."""

    mode: MLPMode = "default"
    """``default``: the MLP as the model runs it; ``tiled``: in tiles of ``tile_tokens`` tokens,
    each checkpointed (forward and backward hold one tile's intermediates)."""

    tile_tokens: int | None = None
    """Tokens per tile with ``mode="tiled"``; None: the hidden size (at least 256)."""

    module_name: str | None = None
    """The MLP's name inside each block (``mlp`` or ``feed_forward`` are found by themselves)."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """How much memory AdamW's state and the gradients take. The policy records it and
    :func:`hf_memstack.make_optimizer` builds the optimizer from it (``prepare_model`` never sees
    the optimizer); the estimator, the planner and the CLI read it from the policy."""

    state: OptimizerState = "fp32"
    """``fp32``: two fp32 moments per trainable parameter (8 bytes); ``8bit``: block-wise 8-bit
    moments (torchao's ``AdamW8bit``: about 2 bytes; needs ``pip install hf_memstack[optim]``)."""

    step: OptimizerStep = "after_backward"
    """``after_backward``: the usual ``optimizer.step()``; ``in_backward``: each parameter is updated
    and its gradient freed as soon as the gradient is complete, so the gradients are never all alive
    at once. It cannot accumulate gradients over micro-batches, clip by a global norm, or use fp16's
    GradScaler, and refuses them."""


@dataclass(kw_only=True, slots=True)
class QuantConfig:
    """4-bit base weights (QLoRA): the frozen linear layers stored as NF4 - 4-bit NormalFloat codes
    with one int8 scale per block, the scales quantized again (about 4.13 bits per weight) - with
    torchao's ``NF4Tensor``, each layer dequantized in the compute dtype as it runs. For adapters
    (LoRA) on a frozen base: 4-bit weights cannot train. Models loaded 4-bit with bitsandbytes are
    accepted with or without it (see :mod:`hf_memstack.transforms.quant.apply`)."""

    mode: QuantMode = "none"
    """``none``; ``nf4``: quantize the targets (needs torchao: ``pip install 'hf_memstack[quant]'``)."""

    targets: tuple[str, ...] | None = None
    """Which layers: ``None``, every ``nn.Linear`` inside the repeated blocks (the attention and MLP
    projections; never the head or the embeddings); else module names or name suffixes, each an
    ``nn.Linear`` (``["q_proj", "v_proj", "lm_head"]``)."""

    block_size: int = 64
    """Weights per 4-bit block, each block with its own scale (QLoRA's 64): smaller blocks round
    less and cost more scale bytes."""

    upcast: bool = False
    """Also cast every other 16-bit parameter (norms, embeddings, head) to fp32, as PEFT's
    ``prepare_model_for_kbit_training`` does: 2 more bytes for each of them. Off: nothing that is
    not quantized is cast."""


@dataclass(kw_only=True, slots=True)
class SequenceParallelConfig:
    """Sequence parallelism (Ulysses): each of ``size`` ranks holds ``1/size`` of every row's tokens,
    and attention runs head-sharded after an all-to-all, so the activations that scale with the
    sequence divide by ``size``. Needs a process group whose world size ``size`` divides."""

    size: int = 1
    """Ranks in one sequence-parallel group: 1 (off), or 2 to ``MAX_SEQUENCE_PARALLEL`` (token
    ``sp:N``); contiguous ranks form a group, and ``size`` must divide the attention heads."""


# The MemoryPolicy fields that are sub-configs, and their dataclasses.
SUBCONFIGS: dict[str, type] = {
    "checkpointing": CheckpointingConfig,
    "compile": CompileConfig,
    "fsdp": FSDPConfig,
    "loss": LossConfig,
    "quant": QuantConfig,
    "mlp": MLPConfig,
    "optimizer": OptimizerConfig,
    "sequence_parallel": SequenceParallelConfig,
}
