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
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

from .policy import MemoryPolicy, OptimizerConfig

__all__ = ["OptimizerInBackward", "check_optimizer_policy", "check_training_settings", "make_optimizer",
           "optimizer_in_backward_of"]

_INSTALL = "pip install 'hf_memstack[optim]' (torchao)"


def check_optimizer_policy(cfg: OptimizerConfig) -> None:
    """Raise before anything is touched when the policy's optimizer cannot be built here.

    Raises:
        RuntimeError: ``state="8bit"`` and torchao is not installed (or does not import).
    """
    if cfg.state == "8bit":
        _adamw8bit()


def check_training_settings(cfg: OptimizerConfig, *, gradient_accumulation_steps: int = 1, max_grad_norm: float | None = None,
                            grad_scaler: Any | None = None) -> None:
    """Raise when the training loop asks for what the optimizer rung cannot do; every problem at once.

    Stepping in the backward updates each parameter as soon as its gradient is complete, so it
    cannot sum gradients over micro-batches (pytorch#124523), clip them by their global norm (the
    norm needs every gradient, torchtune#1934) or let fp16's GradScaler skip a step on overflow.

    Raises:
        ValueError: naming each setting, its value and the fix.
    """
    if cfg.step != "in_backward":
        return
    problems = []
    if gradient_accumulation_steps != 1:
        problems.append(f"gradient_accumulation_steps={gradient_accumulation_steps}: each parameter is updated inside every "
                        "backward, so gradients cannot be summed over micro-batches; use gradient_accumulation_steps=1 (a larger "
                        "per-device batch, e.g. from find_batch_size) or policy.optimizer.step='after_backward'")
    if max_grad_norm is not None and max_grad_norm > 0:
        problems.append(f"max_grad_norm={max_grad_norm}: clipping by the global norm needs every gradient before any "
                        "update; set max_grad_norm=None (or 0) or policy.optimizer.step='after_backward'")
    if grad_scaler is not None:
        problems.append("a GradScaler (fp16): it must see every gradient before the step to skip it on overflow; use bf16 "
                        "or policy.optimizer.step='after_backward'")
    if problems:
        raise ValueError("policy.optimizer.step='in_backward' cannot honour this training setup:\n"
                         + "\n".join(f"  - {p}" for p in problems))


def _check_hyperparameters(*, lr: Any, eps: Any, weight_decay: Any, betas: Any) -> None:
    """Names the argument before torch.optim would fail on it with a bare comparison error (e.g.
    ``lr="1e-3"`` read from a config without a type)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0

    problems = [f"{name}={value!r} must be a number >= 0, e.g. {example}" for name, value, example in
                (("lr", lr, "lr=1e-4"), ("eps", eps, "eps=1e-8"), ("weight_decay", weight_decay, "weight_decay=0.01"))
                if not number(value)]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and b < 1 for b in betas)):
        problems.append(f"betas={betas!r} must be two numbers in [0, 1), e.g. betas=(0.9, 0.999)")
    if problems:
        raise ValueError("make_optimizer: " + "; ".join(problems) + " (a value read from a file may need float(...))")


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
    from .record import record_of, unwrap_model

    _check_hyperparameters(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
    record = record_of(model)
    resolved = MemoryPolicy.coerce(policy) if policy is not None else (record.policy if record is not None else MemoryPolicy())
    cfg = resolved.optimizer
    if record is not None and cfg != record.policy.optimizer:
        raise ValueError(f"make_optimizer(policy={resolved.to_string()!r}) asks for optimizer {_describe(cfg)}, but the model was "
                         f"prepared with {record.policy.to_string()!r} ({_describe(record.policy.optimizer)}); drop the policy "
                         "argument (the optimizer then follows the model's policy), or prepare the model with the optim: tokens you want")
    grad_scaler = record.grad_scaler if record is not None else None
    check_training_settings(cfg, gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm,
                            grad_scaler=grad_scaler)
    check_optimizer_policy(cfg)
    groups = param_groups if param_groups is not None else [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if not any(list(g["params"]) for g in groups):
        raise ValueError(f"{type(model).__name__} has no trainable parameter (requires_grad): nothing to optimize; unfreeze "
                         "some, or check the PEFT config")
    if cfg.step == "in_backward":
        _check_not_replicated([p for g in groups for p in g["params"]])
    defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    factory = _factory(cfg)
    if cfg.step == "after_backward":
        return factory(groups, defaults)
    previous = optimizer_in_backward_of(model)
    if previous is not None:  # e.g. a notebook cell run twice: the old hooks would keep stepping with the old optimizer
        previous.remove_hooks()
        warnings.warn("make_optimizer: this model already had an optimizer stepping in the backward; its hooks were removed and "
                      "the new optimizer replaces it (do not use the old one)", stacklevel=2)
    optimizer = OptimizerInBackward(groups, factory, defaults)
    # verify() finds it here, to pause it: a check must not update the weights.
    unwrap_model(model).__dict__["_memstack_optimizer_in_backward"] = weakref.ref(optimizer)
    return optimizer


def _describe(cfg: OptimizerConfig) -> str:
    return f"state={cfg.state!r}, step={cfg.step!r}"


def _check_not_replicated(params: list[torch.Tensor]) -> None:
    """Stepping in the backward under DDP would update each replica with its own, not yet averaged,
    gradient: DDP's all-reduce finishes after the parameter's gradient hook has run. FSDP2's sharded
    parameters get their reduced gradient before the hook, so they are fine."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
            and not any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            f"policy.optimizer.step='in_backward' on {dist.get_world_size()} processes without FSDP: under DDP each rank would "
            "step with its own gradient before the all-reduce averages it, and the replicas would drift apart; shard the "
            "model (policy 'fsdp', whose reduced gradients arrive before the step) or use policy.optimizer.step='after_backward'")


Factory = Callable[[list[dict[str, Any]], dict[str, Any]], torch.optim.Optimizer]


def _factory(cfg: OptimizerConfig) -> Factory:
    if cfg.state == "8bit":
        adamw8bit = _adamw8bit()
        return lambda groups, defaults: adamw8bit(groups, **defaults)
    # PyTorch's own defaults (foreach on CUDA, a loop on the CPU): what a hand-written loop gets;
    # the estimator traces this same optimizer, so its temporaries are counted as they run.
    return lambda groups, defaults: torch.optim.AdamW(groups, **defaults)


@functools.cache
def _adamw8bit() -> type[torch.optim.Optimizer]:
    try:
        from torchao.optim import AdamW8bit
    except Exception as e:  # noqa: BLE001 - an ImportError, or torchao failing to load against this torch
        raise RuntimeError(
            f"policy.optimizer.state='8bit' needs torchao's AdamW8bit, which does not import here ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160] if str(e) else ''}); {_INSTALL}, or use policy.optimizer.state='fp32'"
        ) from None

    # torchao builds its quantization maps on first use, with a .tolist() that fake tensors (the
    # estimator) cannot answer: build them now, on real tensors (torchao caches them).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with contextlib.suppress(ImportError, AttributeError), unset_fake_temporarily():
        from torchao.optim import subclass_8bit

        subclass_8bit.get_qmap_signed()
        subclass_8bit.get_qmap_unsigned()

    class TrackableAdamW8bit(AdamW8bit):
        """torchao's ``AdamW8bit``, whose compiled step runs eagerly under a tensor-tracking dispatch mode
        (the memory meter, the estimator's fake tensors): dynamo refuses to compile there, and the
        state it creates is the same."""

        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            if _tracking_mode_active() or _on_fake_tensors(self):
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            return super().step(closure)

    return TrackableAdamW8bit


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

    def __init__(self, params: Iterable[Any], factory: Factory, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
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
        return {"optimizers": [self.optimizers[p].state_dict() for p in order],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"this OptimizerInBackward has {len(self.optimizers)} parameters, the state dict {len(saved)}: "
                             "load a state saved from the same model and trainable parameters")
        for optimizer, inner in zip(self.optimizers.values(), saved):
            optimizer.load_state_dict(inner)
        for group, options in zip(self.param_groups, state_dict["param_groups"]):
            group.update(options)
        self._stepped.clear()

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
    from .record import unwrap_model

    ref = unwrap_model(model).__dict__.get("_memstack_optimizer_in_backward")
    optimizer = ref() if ref is not None else None
    return optimizer if isinstance(optimizer, OptimizerInBackward) and optimizer._handles else None
