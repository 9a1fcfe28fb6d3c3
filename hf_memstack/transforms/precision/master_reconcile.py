"""Master weights that follow what trains, whichever comes first: ``prepare_model``, or what decides
the trainable set after it (PEFT's ``get_peft_model``, TRL's ``peft_config=``, a ``requires_grad_``).

Design. ``prepare_model`` still casts where it runs (the trainable 16-bit parameters to fp32 master
weights, or to bf16 under ``weights:bf16``), because what it applies next sees the parameters in
that dtype: FSDP2 shards them and compile traces them. It records each cast parameter's loaded dtype
in a :class:`MasterWeightsLedger`, and the ledger is *reconciled* where the trainable set is known:
the first forward that records gradients in training mode (a forward pre-hook on the backbone,
``model.base_model``, which PEFT's wrappers reach through ``__call__``: they call the prepared
model's ``forward`` directly, past its own hooks), :func:`hf_memstack.make_optimizer`, and the Trainer
callback's ``on_train_begin``. A reconcile

* casts each recorded parameter that is frozen now back to the dtype it was loaded in (a stale
  gradient of it is dropped): a frozen parameter is never held upcast, so PEFT after
  ``prepare_model`` keeps a bf16 base in bf16, as PEFT before it does;
* casts a recorded parameter that trains again back to the master dtype;
* under fp32 master weights with autocast, casts a 16-bit parameter made trainable after
  ``prepare_model`` to fp32 (it is recorded from then on).

Every cast assigns ``p.data``: the ``nn.Parameter`` objects stay, so tied weights stay tied and an
optimizer built before the reconcile still holds the same parameters (its state is created at its
first step, in their new dtype). Deferring the cast itself until then was not chosen: FSDP2 and
compile would see the parameters before it. The price is a transient one: between
``prepare_model`` and the first reconcile, a base frozen after it is held in fp32.

Under FSDP (``fsdp`` in the policy) the cast stays as ``prepare_model`` made it: ``fully_shard``
replaces each parameter with a sharded one in the cast dtype, whose dtype cannot be changed after.
There a reconcile only warns, once, when parameters cast to fp32 are frozen: add the adapters
before ``prepare_model``. Under ``weights:bf16``, a parameter cast down to bf16 and frozen later goes
back to its loaded dtype too (the orders then hold the same bytes), with the values bf16 rounded them to.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..._unwrap import record_of
from ..optim.bf16_adamw import warn_on_plain_steps_over_pure_bf16
from ..quant.apply import is_4bit

SIXTEEN_BIT = (torch.bfloat16, torch.float16)

__all__ = ["MasterWeightsLedger", "ReconcileOnTrainingForward", "planned_dtypes", "reconcile_master_weights"]


class MasterWeightsLedger:
    """The parameters ``prepare_model`` cast, with the dtype each was loaded in; see the module."""

    def __init__(self, root: nn.Module, *, dtype: torch.dtype, cast_new: bool, sharded: bool) -> None:
        self.root = root
        self.dtype = dtype
        """The master dtype (fp32, or bf16 under ``weights:bf16``)."""
        self.cast_new = cast_new
        """Parameters made trainable later are cast to the master dtype: 16-bit ones to fp32 (fp32 master
        weights under autocast), any other to bf16 under pure bf16."""
        self.sharded = sharded
        self.entries: list[tuple[nn.Parameter, torch.dtype]] = []
        self.sharded_names: set[str] = set()
        """Under FSDP, the cast parameters' names: ``fully_shard`` replaces the objects (holding those
        would keep every unsharded weight alive)."""
        self.names_at_prepare: set[str] = set()
        """Under FSDP, every parameter's name when ``prepare_model`` ran (see ``_refuse_added_after_sharding``)."""
        self.made_trainable = 0
        self.warned = False

    def record(self, params: tuple[nn.Parameter, ...]) -> None:
        """Before ``params`` are cast: their loaded dtypes (a parameter cast to what it was is not recorded)."""
        cast = [(p, p.dtype) for p in params if p.dtype != self.dtype]
        if self.sharded:
            ids = {id(p) for p, _ in cast}
            named = list(self.root.named_parameters(remove_duplicate=False))
            self.sharded_names = {n for n, p in named if id(p) in ids}
            self.names_at_prepare = {n for n, _ in named}
        else:
            self.entries += cast

    def planned(self) -> dict[int, torch.dtype]:
        """``id(parameter)`` -> the dtype a reconcile now would give it, for each one it would change."""
        loaded = {id(p): d for p, d in self.entries}
        out: dict[int, torch.dtype] = {}
        for p in _floating(self.root):
            want = self._wanted(p, loaded.get(id(p)))
            if want is not None and want != p.dtype:
                out[id(p)] = want
        return out

    def _wanted(self, p: nn.Parameter, loaded: torch.dtype | None) -> torch.dtype | None:
        if loaded is not None:
            return self.dtype if p.requires_grad else loaded
        if p.requires_grad and self.cast_new and self._castable(p):
            return self.dtype
        return None

    def _castable(self, p: nn.Parameter) -> bool:
        """A parameter made trainable later that the master dtype calls for: a 16-bit one under fp32
        master weights; any other dtype under pure bf16 (PEFT's fp32 adapters, as prepare_model casts
        them when PEFT comes first)."""
        return p.dtype in SIXTEEN_BIT if self.dtype == torch.float32 else p.dtype != self.dtype

    def reconcile(self) -> int:
        """Cast what the trainable set calls for, in place; how many parameters changed dtype."""
        if self.sharded:
            _refuse_added_after_sharding(self.root, self.names_at_prepare)
            self._warn_sharded()
            return 0
        live = {id(p) for p in _floating(self.root)}
        if any(id(p) not in live for p, _ in self.entries):  # replaced since (a merge): not held alive here
            self.entries = [(p, d) for p, d in self.entries if id(p) in live]
        plan = self.planned()
        if not plan:
            return 0
        recorded = {id(p) for p, _ in self.entries}
        with torch.no_grad():
            for p in _floating(self.root):
                want = plan.get(id(p))
                if want is None:
                    continue
                if id(p) not in recorded:
                    self.entries.append((p, p.dtype))
                    self.made_trainable += 1
                if not p.requires_grad:
                    p.grad = None  # a frozen parameter's gradient from before is stale, and in the old dtype
                p.data = p.data.to(want)
                if want == torch.bfloat16 and self.dtype == torch.bfloat16 and p.requires_grad:
                    p._memstack_pure_bf16 = True  # type: ignore[attr-defined]  # the optimizer step check's tag
        if self.dtype == torch.bfloat16:
            warn_on_plain_steps_over_pure_bf16()
        return len(plan)

    def _warn_sharded(self) -> None:
        if self.warned or not self.sharded_names:
            return
        frozen = [n for n, p in self.root.named_parameters() if not p.requires_grad and n in self.sharded_names]
        if not frozen:
            return
        self.warned = True
        warnings.warn(
            f"hf_memstack: {len(frozen)} parameter(s) of {type(self.root).__name__} cast to {short_dtype(self.dtype)} are frozen under FSDP (the first: "
            f"{frozen[0]}): prepare_model cast the trainable ones to master weights before sharding, and a sharded "
            "parameter's dtype cannot change after. Add the PEFT adapters (get_peft_model) before prepare_model, so that "
            "the frozen base stays in the dtype it was loaded in",
            stacklevel=4,
        )

    def describe(self) -> str:
        """What the reconciles did, or ``""``."""
        kept: dict[torch.dtype, int] = {}
        for p, loaded in self.entries:
            if not p.requires_grad and p.dtype == loaded:
                kept[loaded] = kept.get(loaded, 0) + 1
        parts = [
            f"{n} parameter(s) frozen after prepare_model kept in {short_dtype(d)}, the dtype they were loaded in"
            for d, n in kept.items()
        ]
        if self.made_trainable:
            parts.append(
                f"{self.made_trainable} parameter(s) made trainable after prepare_model cast to {short_dtype(self.dtype)}"
            )
        return "; ".join(parts)


def _refuse_added_after_sharding(root: nn.Module, names_at_prepare: set[str]) -> None:
    """Once ``fully_shard`` ran, every parameter ``prepare_model`` saw is a shard (a DTensor, or while
    its module runs, the unsharded tensor under its own name). A trainable parameter under a new name
    that is no DTensor was added after sharding, e.g. by ``get_peft_model``, which sized its adapters
    from each rank's local weight shard: the forward would fail on a shape mismatch (or, on one rank,
    train adapters FSDP neither shards nor reduces). Before sharding (Accelerate's FSDP plugin shards
    at ``accelerator.prepare``) adding adapters is fine: nothing is checked then."""
    from torch.distributed.tensor import DTensor

    params = list(root.named_parameters())
    if not any(isinstance(p, DTensor) for _, p in params):
        return
    added = [n for n, p in params if p.requires_grad and not isinstance(p, DTensor) and n not in names_at_prepare]
    if not added:
        return
    raise RuntimeError(
        f"hf_memstack: {len(added)} trainable parameter(s) of {type(root).__name__} were added after prepare_model "
        f"sharded it with FSDP (the first: {added[0]}); they are whole tensors, not shards. PEFT's get_peft_model "
        "(or TRL's peft_config=) after prepare_model builds its adapters from each rank's local weight shard, so they "
        "do not fit the layers. Apply get_peft_model before prepare_model (model = get_peft_model(model, config); "
        "prepare_model(model, policy)); under TRL, pass that PEFT model to the trainer instead of peft_config="
    )


def _floating(root: nn.Module) -> list[nn.Parameter]:
    """The floating parameters a reconcile may cast (a tied one once; 4-bit weights are integer storage).
    Not a plain tensor standing in for one while its module runs (``torch.func.functional_call``, the
    estimator's trace of an FSDP rank): casting it in place would change the caller's tensor, not a weight."""
    return [p for p in root.parameters() if isinstance(p, nn.Parameter) and p.is_floating_point() and not is_4bit(p)]


def ledger_of(model: nn.Module) -> MasterWeightsLedger | None:
    record: object = record_of(model)
    ledger = getattr(getattr(record, "master_weights", None), "ledger", None)
    return ledger if isinstance(ledger, MasterWeightsLedger) else None


def reconcile_master_weights(model: nn.Module) -> int:
    """Reconcile the master weights of a prepared ``model`` (seen through PEFT, DDP, compile) with
    what trains now (see the module); how many parameters changed dtype (0 for an unprepared model)."""
    ledger = ledger_of(model)
    return ledger.reconcile() if ledger is not None else 0


def planned_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """``id(parameter)`` -> the dtype training will give it, for each parameter a reconcile would cast
    (nothing is changed): what the estimator counts for a prepared model object."""
    ledger = ledger_of(model)
    return ledger.planned() if ledger is not None and not ledger.sharded else {}


def short_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


class ReconcileOnTrainingForward:
    """A forward pre-hook: reconciles before each forward that records gradients in training mode
    (cheap when nothing changed). Skipped inside a compiled graph (make_optimizer and the Trainer
    callback reconcile there). A module-level class, so prepared models still deep-copy and pickle."""

    def __init__(self, ledger: MasterWeightsLedger) -> None:
        self.ledger = ledger

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not module.training:
            return
        self.ledger.reconcile()
