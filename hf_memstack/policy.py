"""The memory policy: which of mixed precision, activation checkpointing (block or op level),
torch.compile, FSDP, a chunked loss head, 4-bit base weights and a low-memory optimizer to use, as
a tree of typed dataclasses.

A policy can be built four ways, all validated the same way:

* keyword arguments: ``MemoryPolicy(precision="bf16", checkpointing="full")``
  (a sub-config accepts its dataclass, its mode as a string, or a dict of its fields);
* a string joining a precision and features with ``+``: ``"bf16+compile+ckpt"``
  (see :func:`MemoryPolicy.from_string` for the grammar; the ladder presets are such strings);
* a dict (``from_dict`` / ``to_dict``) or a YAML file (``from_yaml`` / ``to_yaml``).

Validation collects every problem and raises one :class:`PolicyError` naming each field,
the bad value, the allowed values and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .errors import PolicyError
from .presets import LADDER

__all__ = [
    "CheckpointingConfig",
    "CompileConfig",
    "FSDPConfig",
    "LADDER",
    "LossConfig",
    "MLPConfig",
    "MemoryPolicy",
    "OptimizerConfig",
    "PolicyError",
    "QuantConfig",
]

# The largest ckpt:N / every_n: one block in N is checkpointed, and no model has more blocks.
MAX_EVERY_N = 10_000

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
    accepted with or without it (see :mod:`hf_memstack.transforms.quant`)."""

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


_SUBCONFIGS: dict[str, type] = {
    "checkpointing": CheckpointingConfig,
    "compile": CompileConfig,
    "fsdp": FSDPConfig,
    "loss": LossConfig,
    "quant": QuantConfig,
    "mlp": MLPConfig,
    "optimizer": OptimizerConfig,
}


@dataclass(kw_only=True, slots=True)
class MemoryPolicy:
    """What :func:`hf_memstack.prepare_model` applies to a model.

    Example: ``MemoryPolicy(precision="bf16", checkpointing="full", compile="regional")``.
    """

    precision: Precision = "fp32"
    """``fp32``; ``bf16`` (autocast, no GradScaler); ``fp16`` (autocast + GradScaler, for GPUs
    without bf16); ``auto`` (bf16 where the device supports it, else fp16 on CUDA, else fp32)."""

    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    """Activation checkpointing; a mode string or a dict is accepted too."""

    compile: CompileConfig = field(default_factory=CompileConfig)
    """torch.compile; a mode string or a dict is accepted too."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2 sharding; a mode string or a dict is accepted too."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The causal-LM loss head; a mode string (``"chunked"``) or a dict is accepted too."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    """4-bit base weights; a mode string (``"nf4"``) or a dict is accepted too."""
    mlp: MLPConfig = field(default_factory=MLPConfig)
    """The blocks' MLPs (``"tiled"``: over tiles of tokens); a mode string or a dict is accepted too."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer's state and step (built by :func:`hf_memstack.make_optimizer`); a dict, or a
    string such as ``"8bit"``, ``"in_backward"`` or ``"8bit+in_backward"``, is accepted too."""

    master_weights: MasterWeights = "fp32"
    """The dtype the trainable parameters are kept and updated in. ``fp32`` (mixed precision's
    master weights): under a mixed precision, ``prepare_model`` casts 16-bit trainable parameters
    (a bf16 checkpoint loaded the default way) to fp32, and autocast computes in 16 bits from them:
    4 (weight) + 4 (gradient) + 8 (AdamW's moments) = 16 bytes per trainable parameter. ``bf16``
    (pure bf16, token ``weights:bf16``; needs ``precision="bf16"``): the trainable parameters are
    kept (or cast) in bf16 and :func:`hf_memstack.make_optimizer` builds
    :class:`hf_memstack.bf16_adamw.BF16AdamW` (AdamW with stochastic rounding; torchao's 8-bit
    AdamW with its ``bf16_stochastic_round`` under ``optim:8bit``), whose updates below bf16's resolution are kept in expectation
    instead of rounding away: 2 + 2 + 4 = 8 bytes (6 with ``optim:8bit``). Frozen parameters are
    never cast."""

    def __setattr__(self, name: str, value: Any) -> None:
        """Setting a field of a built policy validates it (a policy is never left invalid: a refused
        value is not set); the fields of a sub-config are validated when the policy is next used
        (``validate``, ``to_string``, ``to_dict``, ``prepare_model``)."""
        try:
            old = getattr(self, name)
        except AttributeError:  # the first assignment, by __init__ (or copy, or unpickling): validated in __post_init__
            object.__setattr__(self, name, value)
            return
        problems: list[str] = []
        value = _dtype_name(value) if name in _DTYPE_FIELDS else value
        cls = _SUBCONFIGS.get(name)
        coerced = _coerce_subconfig(name, cls, value, problems) if cls is not None else None
        if problems:
            raise PolicyError(problems)
        object.__setattr__(self, name, value if coerced is None else coerced)
        try:
            self.validate()
        except PolicyError:
            object.__setattr__(self, name, old)
            raise

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in _DTYPE_FIELDS:  # precision=torch.bfloat16, as Transformers' dtype= is written
            object.__setattr__(self, name, _dtype_name(getattr(self, name)))
        for name, cls in _SUBCONFIGS.items():
            value = getattr(self, name)
            coerced = _coerce_subconfig(name, cls, value, problems)
            if coerced is not None:
                object.__setattr__(self, name, coerced)
        if problems:
            raise PolicyError(problems)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> MemoryPolicy:
        """Check every field; raise one :class:`PolicyError` listing all problems. Returns self."""
        problems: list[str] = []
        _check_choice(problems, "policy.precision", self.precision, Precision)
        _validate_checkpointing(self.checkpointing, problems)
        _validate_compile(self.compile, problems)
        _validate_fsdp(self.fsdp, problems)
        _validate_loss(self.loss, problems)
        _validate_quant(self.quant, problems)
        _validate_mlp(self.mlp, problems)
        _validate_optimizer(self.optimizer, problems)
        _check_choice(problems, "policy.master_weights", self.master_weights, MasterWeights)
        if self.master_weights == "bf16" and self.precision != "bf16":
            problems.append(
                f"policy.master_weights='bf16' (pure bf16 training) with policy.precision={self.precision!r}: pure bf16 computes "
                "and updates in bf16, so the precision must be 'bf16' ('auto' may resolve to fp16 or fp32); use "
                "'bf16+weights:bf16', or master_weights='fp32'"
            )
        if self.fsdp.mode != "none" and self.checkpointing.mode == "offload":
            problems.append(
                "policy.checkpointing.mode='offload' with policy.fsdp.mode="
                f"{self.fsdp.mode!r}: use fsdp.cpu_offload=True to move state to host memory under FSDP, "
                "and checkpointing.mode='full'"
            )
        if self.optimizer.step == "in_backward" and self.precision == "fp16":
            problems.append(
                "policy.optimizer.step='in_backward' with policy.precision='fp16': fp16's GradScaler must see every "
                "gradient (to unscale and skip steps on overflow) before any parameter is updated; use precision='bf16' "
                "(or 'fp32'), or step='after_backward'"
            )
        if problems:
            raise PolicyError(problems)
        return self

    # ------------------------------------------------------------------ constructors
    @classmethod
    def coerce(cls, policy: MemoryPolicy | str | dict[str, Any] | None) -> MemoryPolicy:
        """Accept a policy, a preset/feature string, a dict, a path to a YAML file, or None (fp32)."""
        if policy is None:
            return cls()
        if isinstance(policy, MemoryPolicy):
            return policy.validate()
        if isinstance(policy, dict):
            return cls.from_dict(policy)
        if isinstance(policy, Path) or (isinstance(policy, str) and policy.endswith((".yaml", ".yml"))):
            return cls.from_yaml(policy)
        if isinstance(policy, str):
            return cls.from_string(policy)
        raise TypeError(
            f"policy={policy!r} has type {type(policy).__name__}; pass a MemoryPolicy, a string such as "
            f"'bf16+ckpt' (presets: {', '.join(LADDER)}), a dict, or a path to a YAML file"
        )

    @classmethod
    def from_string(cls, spec: str) -> MemoryPolicy:
        """Parse ``"precision+feature+feature"``; order does not matter and the precision may be omitted (fp32).

        Tokens:

        * precision: ``fp32``, ``bf16``, ``fp16``, ``auto``;
        * ``ckpt`` (full), ``ckpt:N`` (every N-th block), ``ckpt:offload`` (full + saved inputs to host),
          ``ckpt:selective`` (op level: matmul and attention outputs kept, the rest recomputed),
          ``ckpt:selective:alternate`` (every second matmul recomputed too);
        * ``compile`` (whole model), ``compile:regional`` (per block), ``compile:full``;
        * ``fsdp`` (full_shard), ``fsdp:shard_grad_op``, ``fsdp:hybrid_shard``, ``fsdp:offload``
          (full_shard with CPU offload);
        * ``loss:chunked`` (the causal-LM head and loss a chunk of tokens at a time),
          ``loss:chunked:compiled`` (the per-chunk work between the matmuls compiled);
        * ``quant:nf4`` (the blocks' linear layers in 4 bits, for LoRA), ``quant:nf4:upcast`` (and
          the other 16-bit parameters in fp32, as PEFT's ``prepare_model_for_kbit_training``);
        * ``mlp:tiled`` (each block's MLP over tiles of tokens);
        * ``optim:8bit`` (8-bit AdamW moments), ``optim:in_backward`` (step each parameter as its
          gradient is ready); both may be given;
        * ``weights:bf16`` (pure bf16: trainable weights kept in bf16, AdamW with stochastic
          rounding), ``weights:fp32`` (fp32 master weights, the default).

        A ladder preset name (``fp32``, ``bf16``, ``bf16+compile``, ``bf16+compile+ckpt``, ``fsdp``)
        is such a string.
        """
        if not isinstance(spec, str):
            raise TypeError(f"policy string must be a str, got {type(spec).__name__}")
        original = spec
        spec = LADDER.get(spec.strip().lower(), spec).strip().lower()
        problems: list[str] = []
        kwargs: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for raw in spec.split("+"):
            token = raw.strip()
            name, _, arg = token.partition(":")
            group = "precision" if name in get_args(Precision) else name
            # optim:8bit and optim:in_backward set different fields of one group: both may be given.
            key = f"{group}:{arg}" if group == "optim" else group
            if key in seen:
                problems.append(
                    f"policy string {original!r}: {token!r} conflicts with {seen[key]!r}; give each of "
                    "precision, ckpt, compile, fsdp, loss, quant, mlp and weights at most once (optim:8bit and optim:in_backward may go together)"
                )
                continue
            seen[key] = token
            if group == "precision":
                if arg:
                    problems.append(f"policy string {original!r}: precision {name!r} takes no ':' argument")
                kwargs["precision"] = name
            elif name in _TOKENS:
                field_name, parse, allowed = _TOKENS[name]
                value = parse(arg, kwargs.get(field_name))
                if value is None:
                    problems.append(f"policy string {original!r}: {token!r} is not one of {allowed}")
                else:
                    kwargs[field_name] = value
            else:
                problems.append(
                    f"policy string {original!r}: unknown token {token!r}; allowed: a precision "
                    f"({', '.join(get_args(Precision))}), 'ckpt[:N|offload]', 'ckpt:selective[:alternate]', "
                    f"'compile[:regional]', 'fsdp[:mode|offload]', 'loss:chunked[:compiled]', 'quant:nf4[:upcast]', 'mlp:tiled', 'optim:8bit', 'optim:in_backward', "
                    f"'weights:fp32|bf16', or a preset ({', '.join(LADDER)})"
                )
        if problems:
            raise PolicyError(problems)
        return cls(**kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryPolicy:
        """Build from a nested dict such as ``to_dict()`` returns; unknown keys are errors."""
        if not isinstance(data, dict):
            raise TypeError(f"policy dict must be a dict, got {type(data).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in allowed]
        if unknown:
            raise PolicyError(
                [f"policy.{k} is not a policy field; allowed fields: {', '.join(allowed)}" for k in unknown]
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (YAML/JSON friendly) that ``from_dict`` turns back into an equal policy.

        Raises:
            PolicyError: a field was changed to an invalid value since the policy was built.
        """
        self.validate()
        out = dataclasses.asdict(self)
        ck = out["checkpointing"]
        if ck["block_classes"] is not None:
            ck["block_classes"] = list(ck["block_classes"])
        if out["quant"]["targets"] is not None:
            out["quant"]["targets"] = list(out["quant"]["targets"])
        return out

    @classmethod
    def from_yaml(cls, path: str | Path) -> MemoryPolicy:
        """Read a policy from a YAML file (the ``to_dict`` layout, optionally under a ``policy:`` key)."""
        import yaml

        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"policy file {str(path)!r} does not exist; pass an existing YAML file or a policy string")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader
        except UnicodeDecodeError as e:
            raise PolicyError([f"policy file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"]) from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            hint = " (indent with spaces, not tabs)" if "\\t" in str(problem) or "'\\t'" in str(e) else ""
            raise PolicyError([f"policy file {str(path)!r} is not valid YAML{line}: {problem}{hint}"]) from None
        if data is None:
            raise PolicyError([f"policy file {str(path)!r} is empty; write policy fields (precision: bf16, checkpointing: full, ...) "
                               "or a policy string"])
        if isinstance(data, dict) and set(data) == {"policy"}:
            data = data["policy"]
        if isinstance(data, str):
            return cls.from_string(data)
        if not isinstance(data, dict):
            raise PolicyError([f"policy file {str(path)!r} holds {type(data).__name__} {data!r}, not a mapping; write a mapping of policy "
                               "fields (precision: bf16, checkpointing: full, ...) or a policy string"])
        return cls.from_dict(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The policy as YAML text; also written to ``path`` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def to_string(self) -> str:
        """The shortest ``+`` string for this policy, when one exists (options without a token are dropped).

        Raises:
            PolicyError: a field was changed to an invalid value since the policy was built (an
                invalid policy is never printed as if it were one).
        """
        self.validate()
        parts = [self.precision]
        ck = self.checkpointing
        if ck.mode == "full":
            parts.append("ckpt")
        elif ck.mode == "every_n":
            parts.append(f"ckpt:{ck.every_n}")
        elif ck.mode == "offload":
            parts.append("ckpt:offload")
        elif ck.mode == "selective":
            parts.append("ckpt:selective" + (":alternate" if ck.selective_matmuls == "save_alternate" else ""))
        if self.compile.mode == "full":
            parts.append("compile")
        elif self.compile.mode == "regional":
            parts.append("compile:regional")
        if self.fsdp.mode != "none":
            parts.append("fsdp:offload" if self.fsdp.cpu_offload else f"fsdp:{self.fsdp.mode}")
        if self.loss.mode == "chunked":
            parts.append("loss:chunked" + (":compiled" if self.loss.compiled else ""))
        if self.quant.mode == "nf4":
            parts.append("quant:nf4" + (":upcast" if self.quant.upcast else ""))
        if self.mlp.mode == "tiled":
            parts.append("mlp:tiled")
        if self.optimizer.state == "8bit":
            parts.append("optim:8bit")
        if self.optimizer.step == "in_backward":
            parts.append("optim:in_backward")
        if self.master_weights != "fp32":
            parts.append(f"weights:{self.master_weights}")
        return "+".join(parts)



def _parse_ckpt(arg: str, _: Any) -> CheckpointingConfig | None:
    if arg in ("", "full", "1"):
        return CheckpointingConfig(mode="full")
    if arg == "offload":
        return CheckpointingConfig(mode="offload")
    if arg in ("selective", "selective:alternate"):
        return CheckpointingConfig(mode="selective", selective_matmuls="save_alternate" if arg.endswith("alternate") else "save_all")
    # ASCII digits only: '²'.isdigit() is True, and int('²') fails.
    if re.fullmatch("[0-9]{1,6}", arg) and 2 <= int(arg) <= MAX_EVERY_N:
        return CheckpointingConfig(mode="every_n", every_n=int(arg))
    return None


def _parse_weights(arg: str, _: Any) -> str | None:
    return arg if arg in get_args(MasterWeights) else None


def _parse_compile(arg: str, _: Any) -> CompileConfig | None:
    return CompileConfig(mode=arg or "full") if arg in ("", "full", "regional") else None


def _parse_fsdp(arg: str, _: Any) -> FSDPConfig | None:
    if arg in ("", "full_shard", "shard_grad_op", "hybrid_shard"):
        return FSDPConfig(mode=arg or "full_shard")
    return FSDPConfig(mode="full_shard", cpu_offload=True) if arg == "offload" else None


def _parse_loss(arg: str, _: Any) -> LossConfig | None:
    return LossConfig(mode="chunked", compiled=arg.endswith(":compiled")) if arg in ("chunked", "chunked:compiled") else None


def _parse_quant(arg: str, _: Any) -> QuantConfig | None:
    if arg in ("nf4", "nf4:upcast"):
        return QuantConfig(mode="nf4", upcast=arg.endswith("upcast"))
    return None
def _parse_mlp(arg: str, _: Any) -> MLPConfig | None:
    return MLPConfig(mode="tiled") if arg == "tiled" else None


def _parse_optim(arg: str, current: OptimizerConfig | None) -> OptimizerConfig | None:
    current = current or OptimizerConfig()
    if arg == "8bit":
        return OptimizerConfig(state="8bit", step=current.step)
    if arg == "in_backward":
        return OptimizerConfig(state=current.state, step="in_backward")
    return None


# token name -> (policy field, parser(arg, value so far) -> config or None when arg is bad, allowed spellings)
_TOKENS: dict[str, tuple[str, Any, str]] = {
    "ckpt": ("checkpointing", _parse_ckpt, "'ckpt', 'ckpt:N' (2 <= N <= 10000), 'ckpt:offload', 'ckpt:selective', 'ckpt:selective:alternate'"),
    "compile": ("compile", _parse_compile, "'compile', 'compile:full', 'compile:regional'"),
    "fsdp": ("fsdp", _parse_fsdp, "'fsdp', 'fsdp:shard_grad_op', 'fsdp:hybrid_shard', 'fsdp:offload'"),
    "loss": ("loss", _parse_loss, "'loss:chunked', 'loss:chunked:compiled'"),
    "quant": ("quant", _parse_quant, "'quant:nf4', 'quant:nf4:upcast'"),
    "mlp": ("mlp", _parse_mlp, "'mlp:tiled'"),
    "optim": ("optimizer", _parse_optim, "'optim:8bit', 'optim:in_backward'"),
    "weights": ("master_weights", _parse_weights, "'weights:fp32', 'weights:bf16'"),
}


def _optimizer_from_string(value: str) -> OptimizerConfig | None:
    """``"8bit"``, ``"in_backward"``, ``"8bit+in_backward"``, ``"fp32"``, ``"after_backward"`` (None: not one of those)."""
    config: OptimizerConfig | None = OptimizerConfig()
    for part in value.split("+"):
        part = part.strip()
        if part in get_args(OptimizerState):
            config = OptimizerConfig(state=part, step=config.step) if config else None
        elif part in get_args(OptimizerStep):
            config = OptimizerConfig(state=config.state, step=part) if config else None
        else:
            return None
    return config


def _validate_checkpointing(ck: CheckpointingConfig, problems: list[str]) -> None:
    if ck.mode == "selective:alternate":  # the string token's spelling, given as a mode
        problems.append("policy.checkpointing.mode='selective:alternate' is not a mode; use mode='selective' with "
                        "selective_matmuls='save_alternate' (the policy string's token is 'ckpt:selective:alternate')")
    else:
        _check_choice(problems, "policy.checkpointing.mode", ck.mode, CheckpointingMode)
    if not isinstance(ck.every_n, int) or isinstance(ck.every_n, bool) or ck.every_n < 2:
        problems.append(
            f"policy.checkpointing.every_n={ck.every_n!r} must be an integer >= 2 "
            "(use mode='full' to checkpoint every block)"
        )
    elif ck.every_n > MAX_EVERY_N:
        problems.append(f"policy.checkpointing.every_n={ck.every_n} must be at most {MAX_EVERY_N} (one block in N is "
                        "checkpointed; no model has that many blocks); use a number of blocks, or mode='full'")
    elif ck.every_n != 2 and ck.mode != "every_n":
        # 2 is the default, written by to_dict for every mode: it cannot be told from an explicit 2.
        problems.append(f"policy.checkpointing.every_n={ck.every_n} only applies to mode='every_n' (mode is {ck.mode!r}, "
                        "which would ignore it); set mode='every_n' or drop every_n")
    _check_bool(problems, "policy.checkpointing.use_reentrant", ck.use_reentrant)
    _check_choice(problems, "policy.checkpointing.selective_matmuls", ck.selective_matmuls, SelectiveMatmuls)
    if ck.selective_matmuls != "save_all" and ck.mode != "selective":
        problems.append(
            f"policy.checkpointing.selective_matmuls={ck.selective_matmuls!r} only applies to mode='selective' "
            f"(mode is {ck.mode!r}); set mode='selective' or drop selective_matmuls"
        )
    if ck.mode == "selective" and ck.use_reentrant is True:
        problems.append(
            "policy.checkpointing.use_reentrant=True with mode='selective': op-level checkpointing runs through the "
            "non-reentrant implementation only (its context_fn); set use_reentrant=False"
        )
    if ck.block_classes is not None:
        if isinstance(ck.block_classes, str):
            object.__setattr__(ck, "block_classes", (ck.block_classes,))
        elif isinstance(ck.block_classes, list):
            object.__setattr__(ck, "block_classes", tuple(ck.block_classes))
        if not isinstance(ck.block_classes, tuple) or not ck.block_classes or not all(isinstance(c, str) and c for c in ck.block_classes):
            problems.append(
                f"policy.checkpointing.block_classes={ck.block_classes!r} must be a non-empty list of "
                "class names, e.g. ['LlamaDecoderLayer'], or None to detect the blocks"
            )


def _validate_compile(co: CompileConfig, problems: list[str]) -> None:
    _check_choice(problems, "policy.compile.mode", co.mode, CompileMode)
    if not isinstance(co.backend, str) or not co.backend:
        problems.append(f"policy.compile.backend={co.backend!r} must be a backend name such as 'inductor'")
    if co.inductor_mode is not None:
        _check_choice(problems, "policy.compile.inductor_mode", co.inductor_mode, CompileInductorMode)
        if co.backend != "inductor":
            problems.append(
                f"policy.compile.inductor_mode={co.inductor_mode!r} only applies to backend='inductor' "
                f"(backend is {co.backend!r}); set inductor_mode=None or backend='inductor'"
            )
    if co.dynamic not in (None, True, False):
        problems.append(f"policy.compile.dynamic={co.dynamic!r} must be None, True or False")
    _check_bool(problems, "policy.compile.fullgraph", co.fullgraph)


def _validate_fsdp(fs: FSDPConfig, problems: list[str]) -> None:
    _check_choice(problems, "policy.fsdp.mode", fs.mode, FSDPMode)
    _check_bool(problems, "policy.fsdp.cpu_offload", fs.cpu_offload)
    if fs.reshard_after_forward not in (None, True, False):
        problems.append(f"policy.fsdp.reshard_after_forward={fs.reshard_after_forward!r} must be None, True or False")
    if fs.mode == "none" and (fs.cpu_offload or fs.reshard_after_forward is not None):
        problems.append(
            "policy.fsdp.cpu_offload / reshard_after_forward are set but policy.fsdp.mode='none'; "
            "set fsdp.mode='full_shard' (or another mode) or drop those options"
        )


def _validate_loss(lo: LossConfig, problems: list[str]) -> None:
    _check_choice(problems, "policy.loss.mode", lo.mode, LossMode)
    n = lo.chunk_tokens
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        problems.append(f"policy.loss.chunk_tokens={n!r} must be a positive integer (tokens per chunk) or None (sized to the vocabulary)")
    elif n is not None and lo.mode != "chunked":
        problems.append(f"policy.loss.chunk_tokens={n!r} only applies to mode='chunked' (mode is {lo.mode!r}); set "
                        "mode='chunked' or drop chunk_tokens")
    _check_bool(problems, "policy.loss.compiled", lo.compiled)
    if lo.compiled is True and lo.mode != "chunked":
        problems.append(f"policy.loss.compiled=True only applies to mode='chunked' (mode is {lo.mode!r}); set "
                        "mode='chunked' (token 'loss:chunked:compiled') or drop compiled")


def _validate_quant(qu: QuantConfig, problems: list[str]) -> None:
    _check_choice(problems, "policy.quant.mode", qu.mode, QuantMode)
    _check_bool(problems, "policy.quant.upcast", qu.upcast)
    n = qu.block_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 16 or n > 4096 or n & (n - 1):
        problems.append(f"policy.quant.block_size={n!r} must be a power of two from 16 to 4096 (QLoRA's is 64)")
    if isinstance(qu.targets, (list, str)):
        object.__setattr__(qu, "targets", (qu.targets,) if isinstance(qu.targets, str) else tuple(qu.targets))
    if qu.targets is not None and (not isinstance(qu.targets, tuple) or not qu.targets
                                   or not all(isinstance(t, str) and t.strip() for t in qu.targets)):
        problems.append(f"policy.quant.targets={qu.targets!r} must be a non-empty list of module names (e.g. ['q_proj', "
                        "'v_proj']), or None for every linear layer of the blocks")
    if qu.mode == "none" and (qu.upcast or qu.targets is not None):
        problems.append("policy.quant.upcast / targets are set but policy.quant.mode='none'; set quant.mode='nf4' or drop them")
def _validate_mlp(ml: MLPConfig, problems: list[str]) -> None:
    _check_choice(problems, "policy.mlp.mode", ml.mode, MLPMode)
    n = ml.tile_tokens
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        problems.append(f"policy.mlp.tile_tokens={n!r} must be a positive integer (tokens per tile) or None (the hidden size)")
    if ml.module_name is not None and (not isinstance(ml.module_name, str) or not ml.module_name):
        problems.append(f"policy.mlp.module_name={ml.module_name!r} must be the MLP's name inside a block (e.g. 'mlp') or None")
    if ml.mode != "tiled" and (n is not None or ml.module_name is not None):
        problems.append(f"policy.mlp.tile_tokens / module_name only apply to mode='tiled' (mode is {ml.mode!r}); set "
                        "mode='tiled' or drop them")


def _validate_optimizer(op: OptimizerConfig, problems: list[str]) -> None:
    _check_choice(problems, "policy.optimizer.state", op.state, OptimizerState)
    _check_choice(problems, "policy.optimizer.step", op.step, OptimizerStep)


def _unique_key_loader() -> type:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """YAML's safe loader, refusing a key given twice in one mapping (the last would win silently)."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _coerce_subconfig(name: str, cls: type, value: Any, problems: list[str]) -> Any:
    if isinstance(value, cls):
        return None
    if isinstance(value, str) and cls is OptimizerConfig:
        parsed = _optimizer_from_string(value)
        if parsed is None:
            problems.append(f"policy.{name}={value!r} is not an optimizer setting; allowed: 'fp32' or '8bit' (state), "
                            "'after_backward' or 'in_backward' (step), joined with '+', e.g. '8bit+in_backward'")
        return parsed
    if isinstance(value, str):
        return cls(mode=value)
    if isinstance(value, dict):
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in allowed]
        if unknown:
            problems.extend(
                f"policy.{name}.{k} is not a field of {cls.__name__}; allowed: {', '.join(allowed)}" for k in unknown
            )
            return None
        return cls(**value)
    if value is None:
        return cls()
    as_string = "a string such as '8bit+in_backward'" if cls is OptimizerConfig else "a mode string"
    problems.append(
        f"policy.{name}={value!r} has type {type(value).__name__}; pass {cls.__name__}(...), {as_string} or a dict"
    )
    return None


# The fields that name a dtype, and the torch dtypes they take for their names.
_DTYPE_FIELDS = ("precision", "master_weights")
_TORCH_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _dtype_name(value: Any) -> Any:
    """``torch.bfloat16`` -> ``"bf16"`` (and fp16, fp32); anything else as given, for validation to judge."""
    return _TORCH_DTYPE_NAMES.get(str(value), value) if type(value).__name__ == "dtype" else value


def _check_choice(problems: list[str], where: str, value: Any, literal: Any) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        problems.append(
            f"{where}={value!r} is not one of {', '.join(repr(a) for a in allowed)}; pick one of those"
        )


def _check_bool(problems: list[str], where: str, value: Any) -> None:
    if not isinstance(value, bool):
        problems.append(f"{where}={value!r} must be True or False")
