"""make_optimizer: AdamW as the policy's optimizer rung says - fp32 or 8-bit moments, stepped after
the backward or inside it - so that the recipe, Trainer users and the estimator build the same thing.

Bytes per trainable parameter at the step (fp32 weights): AdamW 4 (weight) + 4 (gradient) + 8 (two
moments) = 16; 8-bit moments (torchao's ``AdamW8bit``: block-wise, 256 values per fp32 scale, tensors
under 4,096 values stay fp32) about 4 + 4 + 2 = 10; stepped in the backward the gradients are freed
one parameter at a time, so about 4 + 8 = 12, and both together about 6.

torchao was chosen for the 8-bit moments: it installs and runs on the CPU with our pinned PyTorch
(tested), is maintained by the PyTorch team and works with FSDP2's DTensors; bitsandbytes' CPU
optimizers are new and still have FSDP2 bugs (bnb#1633). torchao compiles its step per parameter
shape (tens of seconds once on a CPU; a few seconds on a GPU), and on a CPU its 8-bit step is slower
than fp32 AdamW's (it is memory that it saves, not time).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

from ..policy import MemoryPolicy, OptimizerConfig
from .bf16_adamw import BF16AdamW

__all__ = [
    "OptimizerInBackward",
    "check_optimizer_policy",
    "check_training_settings",
    "make_optimizer",
    "optimizer_in_backward_of",
]

_INSTALL = "pip install 'hf_memstack[optim]' (torchao)"


def check_optimizer_policy(cfg: OptimizerConfig) -> None:
    """Raise before anything is touched when the policy's optimizer cannot be built here.

    Raises:
        RuntimeError: ``state="8bit"`` and torchao is not installed (or does not import).
    """
    if cfg.state == "8bit":
        _torchao_adamw()


def check_training_settings(
    cfg: OptimizerConfig,
    *,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
    grad_scaler: Any | None = None,
) -> None:
    """Raise when the training loop asks for what the optimizer rung cannot do; every problem at once.

    Stepping in the backward updates each parameter as soon as its gradient is complete, so it
    cannot sum gradients over micro-batches (pytorch#124523), clip them by their global norm (the
    norm needs every gradient, torchtune#1934) or let fp16's GradScaler skip a step on overflow.

    Raises:
        ValueError: naming each setting, its value and the fix (also, for any rung, a
            ``gradient_accumulation_steps`` that is not a positive integer, or a negative or nan ``max_grad_norm``).
    """
    _check_loop_values(gradient_accumulation_steps, max_grad_norm)
    if cfg.step != "in_backward":
        return
    problems = []
    if gradient_accumulation_steps != 1:
        problems.append(
            f"gradient_accumulation_steps={gradient_accumulation_steps}: each parameter is updated inside every "
            "backward, so gradients cannot be summed over micro-batches; use gradient_accumulation_steps=1 (a larger "
            "per-device batch, e.g. from find_batch_size) or policy.optimizer.step='after_backward'"
        )
    if max_grad_norm is not None and max_grad_norm > 0:
        problems.append(
            f"max_grad_norm={max_grad_norm}: clipping by the global norm needs every gradient before any "
            "update; set max_grad_norm=None (or 0) or policy.optimizer.step='after_backward'"
        )
    if grad_scaler is not None:
        problems.append(
            "a GradScaler (fp16): it must see every gradient before the step to skip it on overflow; use bf16 "
            "or policy.optimizer.step='after_backward'"
        )
    if problems:
        raise ValueError(
            "policy.optimizer.step='in_backward' cannot honour this training setup:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def _check_loop_values(gradient_accumulation_steps: Any, max_grad_norm: Any) -> None:
    """A loop that accumulates 0 micro-batches never steps, and a negative clipping norm flips every gradient."""
    problems = []
    if (
        not isinstance(gradient_accumulation_steps, numbers.Integral)
        or isinstance(gradient_accumulation_steps, bool)
        or gradient_accumulation_steps < 1
    ):
        problems.append(
            f"gradient_accumulation_steps={gradient_accumulation_steps!r} must be a positive integer (micro-batches "
            "per optimizer step), e.g. 1"
        )
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, numbers.Real) and not isinstance(max_grad_norm, bool) and max_grad_norm >= 0
    ):  # nan fails >= 0
        problems.append(
            f"max_grad_norm={max_grad_norm!r} must be None or a number >= 0 (0 or None: no clipping), e.g. 1.0"
        )
    if problems:
        raise ValueError("make_optimizer: " + "; ".join(problems))


def _check_hyperparameters(*, lr: Any, eps: Any, weight_decay: Any, betas: Any, where: str = "") -> None:
    """Names the argument before torch.optim would fail on it with a bare comparison error (e.g.
    ``lr="1e-3"`` read from a config without a type), or would accept it and train on nonsense
    (``lr=inf`` or ``nan`` turns every weight into nan at the first step). ``lr`` may be a one-value
    float tensor, as torch.optim allows (e.g. for a learning rate changed inside a compiled step).
    ``where``: ``"param_groups[1]."`` for a group's own value."""

    def number(x: Any, *, tensor: bool = False) -> bool:
        if tensor and torch.is_tensor(x) and x.numel() == 1 and x.is_floating_point():
            x = x.item()
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0  # numpy's too

    problems = [
        f"{where}{name}={value!r} must be a finite number >= 0{' (or a one-value float tensor)' if tensor else ''}, "
        f"e.g. {example}"
        for name, value, example, tensor in (
            ("lr", lr, "lr=1e-4", True),
            ("eps", eps, "eps=1e-8", False),
            ("weight_decay", weight_decay, "weight_decay=0.01", False),
        )
        if not number(value, tensor=tensor)
    ]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and b < 1 for b in betas)):
        problems.append(f"{where}betas={betas!r} must be two numbers in [0, 1), e.g. betas=(0.9, 0.999)")
    if problems:
        raise ValueError("make_optimizer: " + "; ".join(problems) + " (a value read from a file may need float(...))")


_GROUPS_EXAMPLE = 'param_groups=[{"params": [...], "weight_decay": 0.0}, {"params": [...]}]'


def _param_groups(model: nn.Module, param_groups: Any, defaults: dict[str, Any]) -> list[dict[str, Any]]:
    """The groups as lists, each iterable read once (as torch.optim does: ``model.parameters()`` is a
    generator, and a check that iterates it first would leave the optimizer nothing), copied so the
    caller's dicts are not changed, and checked: every parameter is one of ``model``'s and at least
    one is trainable.

    Raises:
        TypeError: ``param_groups`` is not a list of dicts with ``"params"`` (or of parameters).
        ValueError: a group's hyperparameter; a parameter that ``model`` does not have; nothing trainable.
    """
    if param_groups is None:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        _check_group_parameters(model, groups, given=False)
        return groups
    if isinstance(param_groups, (str, bytes, dict, set, torch.Tensor)) or not isinstance(param_groups, Iterable):
        raise TypeError(
            f"make_optimizer: param_groups={_short(param_groups)} ({type(param_groups).__name__}) must be a list of "
            f"dicts, e.g. {_GROUPS_EXAMPLE}; or leave it out to optimize every trainable parameter"
        )
    groups = list(param_groups)
    if groups and all(
        torch.is_tensor(_tensor_of(g)) for g in groups
    ):  # parameters (or named ones) are one group, as for torch.optim
        groups = [{"params": groups}]
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"make_optimizer: param_groups[{i}]={_short(group)} ({type(group).__name__}) must be a dict with a "
                f"'params' entry, e.g. {_GROUPS_EXAMPLE}"
            )
        _check_group_keys(i, group)
        out.append({**group, "params": _group_params(i, group["params"])})
        options = {**defaults, **group}
        _check_hyperparameters(
            lr=options["lr"],
            eps=options["eps"],
            weight_decay=options["weight_decay"],
            betas=options["betas"],
            where=f"param_groups[{i}].",
        )
    _check_group_parameters(model, out, given=True)
    return out


# What AdamW reads from a group (torch.optim keeps any other key, e.g. a "name", and ignores it).
_GROUP_KEYS = (
    "params",
    "param_names",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def _check_group_keys(i: int, group: dict[str, Any]) -> None:
    """A misspelt setting (``"weight_decy"``) would be kept and ignored: the group trains with the default."""
    for key in group:
        close = difflib.get_close_matches(str(key), _GROUP_KEYS, n=1, cutoff=0.8) if key not in _GROUP_KEYS else []
        if close:
            raise ValueError(
                f"make_optimizer: param_groups[{i}] has {key!r}, which AdamW does not read (it would be ignored, and "
                f"the group would use the default); did you mean {close[0]!r}?"
            )


def _group_params(i: int, params: Any) -> list[Any]:
    if torch.is_tensor(params):
        return [params]
    if isinstance(params, (str, bytes, dict, set)) or not isinstance(params, Iterable):
        raise TypeError(
            f"make_optimizer: param_groups[{i}]['params'] has type {type(params).__name__}: it must be a parameter or "
            "an ordered iterable of them (a list, or model.parameters()); a set has no fixed order"
        )
    items = list(params)
    for item in items:
        tensor = _tensor_of(item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"make_optimizer: param_groups[{i}]['params'] holds {_short(tensor)} (type {type(tensor).__name__}): "
                "only the model's parameters (tensors) can be optimized"
            )
    return items


def _check_group_parameters(model: nn.Module, groups: list[dict[str, Any]], *, given: bool) -> None:
    """A parameter from another model (a copy, a model loaded twice) would be stepped while this one never
    changes: a run that trains nothing and says nothing."""
    own = {id(p) for p in model.parameters()}
    tensors = [(i, _tensor_of(item)) for i, g in enumerate(groups) for item in g["params"]]
    foreign = [(i, t) for i, t in tensors if id(t) not in own]
    if foreign:
        i, t = foreign[0]
        raise ValueError(
            f"make_optimizer: param_groups[{i}] holds {len(foreign)} tensor(s) that are not parameters of "
            f"{type(model).__name__} (the first has shape {tuple(t.shape)}): they would be updated while the model never "
            "changes; build the groups from this model's parameters (e.g. after prepare_model or PEFT wrapped it)"
        )
    if not any(t.requires_grad for _, t in tensors):
        where = " in param_groups" if given else ""
        raise ValueError(
            f"{type(model).__name__} has no trainable parameter (requires_grad){where}: nothing to optimize; "
            "unfreeze some, or check the PEFT config"
        )


def _tensor_of(item: Any) -> Any:
    """``(name, parameter)`` (from ``named_parameters()``, which torch.optim accepts) -> the parameter."""
    return item[1] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else item


def _short(value: Any) -> str:
    if torch.is_tensor(_tensor_of(value)):
        return f"a tensor of shape {tuple(_tensor_of(value).shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def make_optimizer(
    model: nn.Module,
    policy: MemoryPolicy | str | dict[str, Any] | None = None,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    param_groups: list[dict[str, Any]] | None = None,
    gradient_accumulation_steps: int = 1,
    max_grad_norm: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters of ``model``, as ``policy.optimizer`` says.

    Args:
        model: the (prepared) model; frozen parameters get no optimizer state.
        policy: the memory policy; default: the one ``prepare_model`` recorded on ``model`` (else fp32 AdamW).
        lr, betas, eps, weight_decay: AdamW's hyperparameters (per group when ``param_groups`` is given).
        param_groups: ``[{"params": [...], "weight_decay": 0.0}, ...]`` instead of every trainable parameter.
        gradient_accumulation_steps, max_grad_norm: what the training loop will do, checked against the
            optimizer (see :func:`check_training_settings`).

    Returns:
        ``torch.optim.AdamW`` (fp32), torchao's ``AdamW8bit`` (8-bit), or an
        :class:`OptimizerInBackward` holding one of those per parameter (``in_backward``): its
        ``step()`` and ``zero_grad()`` do nothing (the backward did the work), so the usual loop,
        the memory meter and the batch-size finder run unchanged.

    Raises:
        ValueError: settings the optimizer cannot honour; no trainable parameter.
        RuntimeError: 8-bit moments without torchao.
    """
    from ..record import record_of, unwrap_model

    if not isinstance(model, nn.Module):
        raise TypeError(
            f"make_optimizer: model must be a torch.nn.Module (the prepared model), got {type(model).__name__}"
        )
    _check_hyperparameters(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
    # Plain floats for torch.optim (numpy scalars, or betas given as ints, which AdamW refuses).
    lr = lr if torch.is_tensor(lr) else float(lr)
    eps, weight_decay, betas = float(eps), float(weight_decay), (float(betas[0]), float(betas[1]))
    record = record_of(model)
    resolved = (
        MemoryPolicy.coerce(policy) if policy is not None else (record.policy if record is not None else MemoryPolicy())
    )
    cfg = resolved.optimizer
    if record is not None and (cfg, resolved.master_weights) != (record.policy.optimizer, record.policy.master_weights):
        raise ValueError(
            f"make_optimizer(policy={resolved.to_string()!r}) asks for optimizer {_describe(cfg, resolved.master_weights)}, "
            f"but the model was prepared with {record.policy.to_string()!r} "
            f"({_describe(record.policy.optimizer, record.policy.master_weights)}); drop the policy argument (the "
            "optimizer then follows the model's policy), or prepare the model with the optim: and weights: tokens you want"
        )
    grad_scaler = record.grad_scaler if record is not None else None
    check_training_settings(
        cfg,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_grad_norm=max_grad_norm,
        grad_scaler=grad_scaler,
    )
    check_optimizer_policy(cfg)
    defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    groups = _param_groups(model, param_groups, defaults)
    params = [_tensor_of(item) for g in groups for item in g["params"]]
    _check_master_dtype(params, resolved.master_weights)
    if cfg.step == "in_backward":
        _check_in_backward_parameters(params)
    factory = _factory(cfg, resolved.master_weights)
    if cfg.step == "after_backward":
        return factory(groups, defaults)
    previous = optimizer_in_backward_of(model)
    if previous is not None:  # e.g. a notebook cell run twice: the old hooks would keep stepping with the old optimizer
        previous.remove_hooks()
        warnings.warn(
            "make_optimizer: this model already had an optimizer stepping in the backward; its hooks were removed and "
            "the new optimizer replaces it (do not use the old one)",
            stacklevel=2,
        )
    optimizer = OptimizerInBackward(groups, factory, defaults, names={p: n for n, p in model.named_parameters()})
    # verify() finds it here, to pause it: a check must not update the weights.
    unwrap_model(model).__dict__["_memstack_optimizer_in_backward"] = weakref.ref(optimizer)
    return optimizer


def _describe(cfg: OptimizerConfig, master_weights: str = "fp32") -> str:
    return f"state={cfg.state!r}, step={cfg.step!r}, master_weights={master_weights!r}"


def _check_master_dtype(params: list[torch.Tensor], master_weights: str) -> None:
    """Stochastic rounding writes bf16 values: over fp32 weights it would round them to bf16 at every
    step (refused). Plain AdamW over 16-bit weights loses the updates below their resolution (warned)."""
    if master_weights == "bf16":
        other = [p for p in params if p.is_floating_point() and p.dtype != torch.bfloat16]
        if other:
            raise ValueError(
                f"make_optimizer: policy.master_weights='bf16' (AdamW with bf16 stochastic rounding), but {len(other)} trainable "
                f"parameter(s) are {other[0].dtype} (the first of shape {tuple(other[0].shape)}): rounding them to bf16 at every "
                "step would lose their precision silently. Prepare the model with the policy first (prepare_model casts its "
                "trainable parameters to bf16; adapters added after prepare_model are PEFT's fp32: cast them with "
                "model.to(torch.bfloat16) or use 'weights:fp32')"
            )
        return
    sixteen = [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]
    if sixteen:
        warnings.warn(
            f"make_optimizer: {len(sixteen)} trainable parameter(s) are {sixteen[0].dtype} and the policy keeps fp32 master "
            "weights: plain AdamW over 16-bit weights rounds away every update smaller than their resolution. Prepare the "
            "model with a mixed-precision policy ('bf16': prepare_model casts them to fp32), or train pure bf16 with "
            "stochastic rounding ('bf16+weights:bf16')",
            stacklevel=3,
        )


def _check_in_backward_parameters(params: list[torch.Tensor]) -> None:
    """Each parameter gets a hook that fires when its gradient is complete: a frozen one never has a
    gradient (and torch refuses the hook)."""
    frozen = [p for p in params if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"make_optimizer: param_groups holds {len(frozen)} frozen parameter(s) (requires_grad=False, the first "
            f"of shape {tuple(frozen[0].shape)}); policy.optimizer.step='in_backward' steps each parameter when its "
            "gradient is complete, and these have none: leave them out of param_groups, or unfreeze them first"
        )
    _check_not_replicated(params)


def _check_not_replicated(params: list[torch.Tensor]) -> None:
    """Stepping in the backward under DDP would update each replica with its own, not yet averaged,
    gradient: DDP's all-reduce finishes after the parameter's gradient hook has run. FSDP2's sharded
    parameters get their reduced gradient before the hook, so they are fine."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and not any(isinstance(p, DTensor) for p in params)
    ):
        raise ValueError(
            f"policy.optimizer.step='in_backward' on {dist.get_world_size()} processes without FSDP: under DDP each rank would "
            "step with its own gradient before the all-reduce averages it, and the replicas would drift apart; shard the "
            "model (policy 'fsdp', whose reduced gradients arrive before the step) or use policy.optimizer.step='after_backward'"
        )


Factory = Callable[[list[dict[str, Any]], dict[str, Any]], torch.optim.Optimizer]


def _factory(cfg: OptimizerConfig, master_weights: str = "fp32") -> Factory:
    if master_weights == "bf16" and cfg.state == "fp32":
        return lambda groups, defaults: BF16AdamW(groups, **defaults)
    if cfg.state == "8bit":
        adamw = _torchao_adamw()
        rounding = {"bf16_stochastic_round": True} if master_weights == "bf16" else {}
        return lambda groups, defaults: adamw(groups, **defaults, **rounding)
    # PyTorch's own defaults (foreach on CUDA, a loop on the CPU): what a hand-written loop gets;
    # the estimator traces this same optimizer, so its temporaries are counted as they run.
    return lambda groups, defaults: torch.optim.AdamW(groups, **defaults)


@functools.cache
def _torchao_adamw() -> type[torch.optim.Optimizer]:
    """torchao's ``AdamW8bit`` (with ``bf16_stochastic_round`` under pure bf16), trackable."""
    try:
        from torchao.optim import AdamW8bit
    except Exception as e:  # noqa: BLE001 - an ImportError, or torchao failing to load against this torch
        raise RuntimeError(
            f"policy.optimizer.state='8bit' needs torchao's AdamW8bit, which does not import here ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}); {_INSTALL}, or use policy.optimizer.state='fp32'"
        ) from None
    base = AdamW8bit

    # torchao builds its quantization maps on first use, with a .tolist() that fake tensors (the
    # estimator) cannot answer: build them now, on real tensors (torchao caches them).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with contextlib.suppress(ImportError, AttributeError), unset_fake_temporarily():
        from torchao.optim import subclass_8bit

        subclass_8bit.get_qmap_signed()
        subclass_8bit.get_qmap_unsigned()

    class TrackableAdamW(base):  # type: ignore[valid-type, misc]
        """torchao's AdamW, whose compiled step runs eagerly under a tensor-tracking dispatch mode
        (the memory meter, the estimator's fake tensors): dynamo refuses to compile there, and the
        state it creates is the same."""

        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            if _tracking_mode_active() or _on_fake_tensors(self):
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            return super().step(closure)

    TrackableAdamW.__name__ = TrackableAdamW.__qualname__ = "TrackableAdamW8bit"
    return TrackableAdamW


def _on_fake_tensors(optimizer: torch.optim.Optimizer) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for group in optimizer.param_groups for p in group["params"])


def _tracking_mode_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not getattr(mode, "is_infra_mode", lambda: False)() for mode in _get_current_dispatch_mode_stack())


class OptimizerInBackward(torch.optim.Optimizer):
    """Updates each parameter inside the backward, as soon as its gradient is complete (a
    post-accumulate-grad hook, which FSDP2 also calls on its sharded parameters), then frees the
    gradient: the gradients are never all alive at once (torchtune's optimizer-in-backward).

    Each parameter has its own optimizer (``optimizers[param]``); ``param_groups`` hold the
    hyperparameters, so learning-rate schedulers work as usual. ``step()`` and ``zero_grad()`` do
    nothing; ``state_dict()`` / ``load_state_dict()`` save and restore every parameter's optimizer.

    Raises (from the backward): RuntimeError when a parameter's gradient completes twice without a
    ``step()`` call in between - gradient accumulation, which this optimizer cannot do.
    """

    def __init__(
        self,
        params: Iterable[Any],
        factory: Factory,
        defaults: dict[str, Any],
        *,
        names: dict[nn.Parameter, str] | None = None,
    ) -> None:
        super().__init__(params, defaults)
        self._names = dict(names or {})  # for messages: "model.layers.0.weight has shape ..."
        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        self._groups: dict[int, dict[str, Any]] = {}
        for group in self.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self.optimizers[p] = factory([{"params": [p]}], options)
                self._groups[id(p)] = group
        self.state = _MergedState(self.optimizers)  # type: ignore[assignment]
        self._stepped: set[int] = set()
        self._paused = False
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in self.optimizers]

    def _step_parameter(self, param: nn.Parameter) -> None:
        if self._paused or param.grad is None:
            return
        if id(param) in self._stepped:
            raise RuntimeError(
                "OptimizerInBackward: a parameter's gradient completed twice without optimizer.step() in between - "
                "gradient accumulation, which an optimizer stepping in the backward cannot do (each backward already "
                "updated the weights). Call optimizer.step() after every backward (with gradient_accumulation_steps=1), "
                "or use policy.optimizer.step='after_backward'"
            )
        self._stepped.add(id(param))
        inner = self.optimizers[param]
        _copy_hyperparameters(self._groups[id(param)], inner.param_groups[0])
        inner.step()
        param.grad = None  # the point: this gradient is not needed any more

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Nothing to update (the backward did); marks the end of an optimizer step."""
        self._stepped.clear()
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The backward already freed each gradient after its update."""
        for p in self.optimizers:
            if p.grad is not None:  # e.g. left by a paused backward
                p.grad = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: backward leaves the gradients in place and updates nothing (for checks such as ``verify``)."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        order = list(self.optimizers)
        return {
            "optimizers": [self.optimizers[p].state_dict() for p in order],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "shapes": [list(p.shape) for p in order],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore what :meth:`state_dict` saved, after checking (before anything changes) that it was
        saved for parameters of these shapes, in this order.

        Raises:
            ValueError: a state dict of another form, for another number of parameters or groups, or
                for a parameter of another shape (named, with both shapes); this optimizer is unchanged.
        """
        self._check_loadable(state_dict)
        for optimizer, inner in zip(self.optimizers.values(), state_dict["optimizers"]):
            optimizer.load_state_dict(inner)
        for group, options in zip(self.param_groups, state_dict["param_groups"]):
            group.update(options)
        self._stepped.clear()

    def _check_loadable(self, state_dict: Any) -> None:
        if (
            not isinstance(state_dict, dict)
            or not isinstance(state_dict.get("optimizers"), list)
            or not isinstance(state_dict.get("param_groups"), list)
        ):
            keys = sorted(state_dict)[:6] if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"OptimizerInBackward.load_state_dict: the state dict (keys {keys}) is not one an OptimizerInBackward "
                "saved (it needs 'optimizers' and 'param_groups'); a torch.optim optimizer's state dict cannot be "
                "loaded here: load the state saved from make_optimizer's optimizer for the same policy"
            )
        saved, groups = state_dict["optimizers"], state_dict["param_groups"]
        if len(saved) != len(self.optimizers) or len(groups) != len(self.param_groups):
            raise ValueError(
                f"this OptimizerInBackward has {len(self.optimizers)} parameters in {len(self.param_groups)} group(s), "
                f"the state dict {len(saved)} in {len(groups)}: load a state saved from the same model and trainable "
                "parameters"
            )
        shapes = state_dict.get("shapes")
        for i, (param, inner) in enumerate(zip(self.optimizers, saved)):
            shape = tuple(shapes[i]) if isinstance(shapes, list) and i < len(shapes) else _state_shape(inner)
            if shape is not None and shape != tuple(param.shape):
                name = self._names.get(param, f"parameter {i}")
                raise ValueError(
                    f"OptimizerInBackward.load_state_dict: {name} has shape {tuple(param.shape)} but the state dict's "
                    f"parameter {i} has shape {shape}: it was saved from another model (or other trainable "
                    "parameters); load a state saved from this model, with the same parameters trainable"
                )

    def remove_hooks(self) -> None:
        """Stop stepping in the backward (e.g. before building another optimizer for this model)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _MergedState(MutableMapping):
    """``optimizer.state`` of an :class:`OptimizerInBackward`: every parameter's state, as one
    mapping, so the meter, the finder and ``optimizer_state_bytes`` see it as any optimizer's."""

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers

    def __getitem__(self, param: Any) -> Any:
        return self._optimizers[param].state[param]

    def __setitem__(self, param: Any, value: Any) -> None:
        self._optimizers[param].state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._optimizers[param].state[param]

    def __iter__(self) -> Iterator[Any]:
        return (p for p, o in self._optimizers.items() if p in o.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _state_shape(inner: Any) -> tuple[int, ...] | None:
    """The parameter's shape as its saved moments show it (a state saved before ``"shapes"`` was recorded)."""
    state = inner.get("state") if isinstance(inner, dict) else None
    for value in (state or {}).values():
        for key, tensor in value.items() if isinstance(value, dict) else ():
            if key != "step" and torch.is_tensor(tensor) and tensor.dim() > 0:
                return tuple(tensor.shape)
    return None


def _copy_hyperparameters(source: dict[str, Any], target: dict[str, Any]) -> None:
    """A scheduler changed ``source`` (the outer group): pass it on. torchao keeps ``lr`` as a tensor."""
    for key, value in source.items():
        if key == "params" or key not in target:
            continue
        if torch.is_tensor(target[key]) and not torch.is_tensor(value):
            target[key].fill_(value)
        else:
            target[key] = value


def optimizer_in_backward_of(model: nn.Module) -> OptimizerInBackward | None:
    """The :class:`OptimizerInBackward` that :func:`make_optimizer` attached to ``model``'s parameters, if alive."""
    from ..record import unwrap_model

    ref = unwrap_model(model).__dict__.get("_memstack_optimizer_in_backward")
    optimizer = ref() if ref is not None else None
    return optimizer if isinstance(optimizer, OptimizerInBackward) and optimizer._handles else None
