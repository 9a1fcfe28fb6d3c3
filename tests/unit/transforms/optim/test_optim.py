"""The optimizer rungs (policy tokens optim:8bit, optim:in_backward) built by make_optimizer:
stepping in the backward gives AdamW's exact updates with one gradient alive at a time; 8-bit
moments (torchao) take about a quarter of the bytes, counted exactly; the settings a rung cannot
honour are refused, before anything is built or while the backward runs; the meter, the finder and
verify see them as they are."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from tiny import PlainStack, make_batch
from torch import nn

from hf_memstack import MemoryPolicy, PolicyError, find_batch_size, make_optimizer, measure_step, prepare_model, verify
from hf_memstack.measure import model_state_bytes, train_step
from hf_memstack.measure.accounting import optimizer_state_bytes, tensor_bytes
from hf_memstack.transforms.optim import OptimizerInBackward


def _wide_stack(width: int = 64, depth: int = 2) -> nn.Module:
    """Linear layers of width x width (64 x 64 = 4096 values: the size from which torchao quantizes a state)."""
    torch.manual_seed(0)
    model = PlainStack()
    model.inp = nn.Linear(PlainStack.DIM, width)
    model.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth))
    model.head = nn.Linear(width, 1)
    return model.train()


def _run(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3, arch: str = "llama") -> list[float]:
    return [train_step(model, make_batch(arch, seed=i), optimizer) for i in range(steps)]


def test_stepping_in_the_backward_matches_adamw_exactly(load_model):
    plain = prepare_model(load_model("llama"), "fp32")
    ours = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer = make_optimizer(ours, lr=1e-2, weight_decay=0.1)
    assert isinstance(optimizer, OptimizerInBackward)
    assert _run(plain, reference) == _run(ours, optimizer)
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in ours.parameters())  # each freed right after its update


def test_gradients_are_never_all_alive_at_once(load_model):
    after = prepare_model(load_model("llama"), "fp32")
    inside = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    batch = make_batch("llama")
    m_after = measure_step(after, batch, make_optimizer(after, lr=1e-3), timed=False)
    m_inside = measure_step(inside, batch, make_optimizer(inside, lr=1e-3), timed=False)
    trainable = model_state_bytes(inside).trainable_parameters
    assert m_after.gradients == trainable  # at the optimizer step every gradient is there
    assert m_inside.gradients < 0.25 * trainable, m_inside
    assert m_inside.optimizer == m_after.optimizer or m_inside.peak_bytes < m_after.peak_bytes
    assert m_inside.peak_bytes < m_after.peak_bytes


def test_a_learning_rate_schedule_reaches_every_parameter(load_model):
    plain = prepare_model(load_model("gpt2"), "fp32")
    ours = prepare_model(load_model("gpt2"), "fp32+optim:in_backward")
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    optimizer = make_optimizer(ours, lr=1e-2)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in (reference, optimizer)]
    for i in range(3):
        for model, opt, schedule in ((plain, reference, schedules[0]), (ours, optimizer, schedules[1])):
            train_step(model, make_batch("gpt2", seed=i), opt)
            schedule.step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters()))


def test_state_dict_round_trip_resumes_exactly(load_model):
    ours = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    optimizer = make_optimizer(ours, lr=1e-2)
    _run(ours, optimizer, 2)
    saved_model = {k: v.clone() for k, v in ours.state_dict().items()}
    saved = copy.deepcopy(optimizer.state_dict())  # as torch's: a state dict holds the live tensors
    expected = _run(ours, optimizer, 2)
    resumed = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    resumed.load_state_dict(saved_model)
    again = make_optimizer(resumed, lr=1e-2)
    again.load_state_dict(saved)
    assert _run(resumed, again, 2) == expected


def test_eight_bit_moments_train_and_are_counted_exactly():
    pytest.importorskip("torchao")
    model = prepare_model(_wide_stack(), "fp32+optim:8bit")
    optimizer = make_optimizer(model, lr=1e-2)
    assert type(optimizer).__name__ == "TrackableAdamW8bit"
    losses = _run(model, optimizer, 6, arch="plain")
    assert losses[-1] < losses[0], losses

    def expected(p: torch.Tensor) -> int:
        if p.numel() >= 4096 and p.numel() % 256 == 0:  # uint8 codes, an fp32 scale per 256, a 256-entry map
            return 2 * (p.numel() + p.numel() // 256 * 4 + 256 * 4) + 4
        return 2 * p.numel() * 4 + 4  # small tensors keep fp32 moments; + the step counter

    assert optimizer_state_bytes(optimizer) == sum(expected(p) for p in model.parameters())
    state = optimizer.state[model.layers[0][1].weight]["exp_avg"]
    assert tensor_bytes(state) < state.numel() * state.element_size()  # its inner uint8 codes, not its shown dtype


def test_both_rungs_together_cut_the_model_states(load_model):
    pytest.importorskip("torchao")
    batch = make_batch("plain")
    states = {}
    for spec in ("fp32", "fp32+optim:8bit+optim:in_backward"):
        # Layers large enough that the 8-bit states dominate (each small tensor keeps fp32 moments and
        # each quantized one a 1 KiB map), and enough of them that one layer's gradient is a small part.
        model = prepare_model(_wide_stack(256, depth=12), spec)
        optimizer = make_optimizer(model, lr=1e-3)
        m = measure_step(model, batch, optimizer, timed=False)
        states[spec] = model_state_bytes(model).parameters + m.gradients + optimizer_state_bytes(optimizer)
    assert states["fp32+optim:8bit+optim:in_backward"] <= 0.45 * states["fp32"], states


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (
            {"gradient_accumulation_steps": 4},
            ("gradient_accumulation_steps=4", "cannot be summed", "step='after_backward'"),
        ),
        ({"max_grad_norm": 1.0}, ("max_grad_norm=1.0", "global norm", "max_grad_norm=None")),
    ],
)
def test_in_backward_refuses_what_it_cannot_do_before_building_anything(load_model, kwargs, fragments):
    model = prepare_model(load_model("llama"), "bf16+optim:in_backward")
    with pytest.raises(ValueError) as e:
        make_optimizer(model, lr=1e-3, **kwargs)
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # no hook left behind
    make_optimizer(model, lr=1e-3, gradient_accumulation_steps=1, max_grad_norm=0)  # what it can do is accepted


def test_accumulating_anyway_fails_in_the_backward(load_model):
    model = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    make_optimizer(model, lr=1e-3)
    model(**make_batch("llama", seed=0)).loss.backward()  # micro-batch 1: updated the weights already
    with pytest.raises(RuntimeError, match="gradient accumulation"):
        model(**make_batch("llama", seed=1)).loss.backward()


def test_policy_refuses_fp16_with_in_backward():
    with pytest.raises(PolicyError, match="optimizer.step='in_backward' with policy.precision='fp16'"):
        MemoryPolicy.from_string("fp16+optim:in_backward")


def test_eight_bit_without_torchao_is_a_clear_error_and_the_library_imports(load_model, monkeypatch):
    from hf_memstack.transforms.optim import optimizer as optim

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    optim._torchao_adamw.cache_clear()
    try:
        model = load_model("llama")
        with pytest.raises(
            RuntimeError, match=r"optimizer.state='8bit' needs torchao.*pip install 'hf_memstack\[optim\]'"
        ):
            prepare_model(model, "bf16+optim:8bit")
        assert getattr(model, "memstack", None) is None
        with pytest.raises(RuntimeError, match="torchao"):
            make_optimizer(model, "bf16+optim:8bit", lr=1e-3)
        assert isinstance(make_optimizer(model, "bf16", lr=1e-3), torch.optim.AdamW)
    finally:
        optim._torchao_adamw.cache_clear()


def test_verify_does_not_update_the_weights(load_model):
    model = prepare_model(load_model("llama"), "bf16+ckpt+optim:in_backward")
    optimizer = make_optimizer(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    report = verify(model, make_batch("llama"))
    assert report.ok, str(report)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _run(model, optimizer, 1)  # and the optimizer steps again afterwards
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_finder_measures_and_restores_an_optimizer_stepping_in_the_backward(load_model):
    model = prepare_model(load_model("llama"), "bf16+optim:in_backward")
    optimizer = make_optimizer(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    result = find_batch_size(
        model, lambda n: make_batch("llama", batch_size=n), optimizer, budget="64MiB", cache=False, max_batch_size=16
    )
    assert result.batch_size >= 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert _run(model, optimizer, 1)


def test_policy_tokens_and_strings():
    p = MemoryPolicy.from_string("bf16+optim:in_backward+optim:8bit")
    assert (p.optimizer.state, p.optimizer.step) == ("8bit", "in_backward")
    assert MemoryPolicy.from_string(p.to_string()) == p == MemoryPolicy.from_dict(p.to_dict())
    assert MemoryPolicy(optimizer="8bit+in_backward") == MemoryPolicy.from_string("fp32+optim:8bit+optim:in_backward")
    with pytest.raises(PolicyError, match="policy.optimizer='4bit' is not an optimizer setting"):
        MemoryPolicy(optimizer="4bit")


def test_a_second_make_optimizer_replaces_the_first(load_model):
    """A notebook cell run twice: the first optimizer's hooks go (with a warning), the second steps."""
    model = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    first = make_optimizer(model, lr=1e-2)
    with pytest.warns(UserWarning, match="its hooks were removed"):
        second = make_optimizer(model, lr=1e-2)
    _run(model, second, steps=2)  # would raise "completed twice" if the first still stepped
    assert len(second.state) == sum(1 for p in model.parameters() if p.requires_grad) and not first.state


def test_an_optimizer_disagreeing_with_the_model_policy_is_refused(load_model):
    model = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    with pytest.raises(ValueError, match="prepared with 'fp32\\+optim:in_backward'.*drop the policy argument"):
        make_optimizer(model, "fp32", lr=1e-2)


def test_an_optimizer_built_before_prepare_model_is_refused(load_model):
    model = load_model("llama")
    make_optimizer(model, "fp32+optim:in_backward", lr=1e-2)
    flags = [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    with pytest.raises(ValueError, match="make_optimizer was called before prepare_model"):
        prepare_model(model, "bf16+ckpt")
    assert [getattr(m, "gradient_checkpointing", None) for m in model.modules()] == flags


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"lr": "1e-3"}, "lr='1e-3' must be a finite number >= 0"),
        ({"lr": 1e-3, "eps": -1.0}, "eps=-1.0 must be a finite number >= 0"),
        ({"lr": 1e-3, "betas": (0.9, 1.5)}, "betas=(0.9, 1.5) must be two numbers in [0, 1)"),
    ],
)
def test_bad_hyperparameters_are_named_before_torch_sees_them(load_model, kwargs, fragment):
    model = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    with pytest.raises(ValueError, match="make_optimizer: ") as e:
        make_optimizer(model, **kwargs)
    assert fragment in str(e.value), str(e.value)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # nothing was built


def _changed(before: list[torch.Tensor], model: nn.Module) -> list[bool]:
    return [not torch.equal(a, b) for a, b in zip(before, model.parameters())]


@pytest.mark.parametrize("spec", ["fp32", "fp32+optim:in_backward"])
def test_param_groups_from_generators_step_what_torch_adamw_steps(spec):
    """model.parameters() is a generator: read once, as torch.optim reads it (it used to be consumed by
    a check first, leaving an optimizer over nothing whose step changed nothing)."""
    reference = PlainStack().train()
    ours = prepare_model(copy.deepcopy(reference), spec)

    def groups(model):
        return [
            {"params": model.layers.parameters(), "weight_decay": 0.0},
            {"params": (p for n, p in model.named_parameters() if not n.startswith("layers.")), "lr": 5e-3},
        ]

    torch_adamw = torch.optim.AdamW(groups(reference), lr=1e-2, weight_decay=0.1)
    optimizer = make_optimizer(ours, lr=1e-2, weight_decay=0.1, param_groups=groups(ours))
    before = [p.detach().clone() for p in ours.parameters()]
    assert _run(reference, torch_adamw, arch="plain") == _run(ours, optimizer, arch="plain")
    assert all(_changed(before, ours))  # every parameter stepped ...
    assert all(
        torch.equal(a, b) for a, b in zip(reference.parameters(), ours.parameters())
    )  # ... exactly as torch's AdamW


def test_a_tensor_learning_rate_is_accepted_as_torch_accepts_it():
    reference = PlainStack().train()
    ours = prepare_model(copy.deepcopy(reference), "fp32")
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(1e-2))
    optimizer = make_optimizer(ours, lr=torch.tensor(1e-2))
    assert _run(reference, torch_adamw, arch="plain") == _run(ours, optimizer, arch="plain")
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), ours.parameters()))


@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        ({"lr": float("inf")}, ValueError, ("lr=inf must be a finite number >= 0", "lr=1e-4")),
        ({"lr": float("nan")}, ValueError, ("lr=nan must be a finite number",)),
        ({"lr": -1e-3}, ValueError, ("lr=-0.001 must be a finite number >= 0",)),
        ({"lr": torch.tensor([1e-3, 1e-4])}, ValueError, ("one-value float tensor",)),
        ({"lr": 1e-3, "weight_decay": float("inf")}, ValueError, ("weight_decay=inf",)),
        (
            {"lr": 1e-3, "gradient_accumulation_steps": 0},
            ValueError,
            ("gradient_accumulation_steps=0 must be a positive integer",),
        ),
        ({"lr": 1e-3, "gradient_accumulation_steps": 2.0}, ValueError, ("gradient_accumulation_steps=2.0",)),
        ({"lr": 1e-3, "max_grad_norm": -1.0}, ValueError, ("max_grad_norm=-1.0 must be None or a number >= 0",)),
        (
            {"lr": 1e-3, "param_groups": "all"},
            TypeError,
            ("param_groups='all' (str) must be a list of dicts", "leave it out"),
        ),
        ({"lr": 1e-3, "param_groups": {"params": []}}, TypeError, ("(dict) must be a list of dicts",)),
        (
            {"lr": 1e-3, "param_groups": [{"lr": 1e-3}]},
            TypeError,
            ("param_groups[0]={'lr': 0.001} (dict) must be a dict with a 'params'",),
        ),
        ({"lr": 1e-3, "param_groups": [{"params": 3}]}, TypeError, ("param_groups[0]['params'] has type int",)),
        ({"lr": 1e-3, "param_groups": [{"params": [], "lr": float("nan")}]}, ValueError, ("param_groups[0].lr=nan",)),
        ({"lr": 1e-3, "param_groups": []}, ValueError, ("no trainable parameter (requires_grad) in param_groups",)),
        (
            {"lr": 1e-3, "param_groups": [{"params": PlainStack().parameters()}]},
            ValueError,
            ("param_groups[0] holds 22 tensor(s) that are not parameters of PlainStack", "the model never changes"),
        ),
        (
            {"lr": 1e-3, "param_groups": [{"params": [], "weight_decy": 0.0}]},
            ValueError,
            ("param_groups[0] has 'weight_decy', which AdamW does not read", "did you mean 'weight_decay'?"),
        ),
    ],
)
def test_odd_optimizer_arguments_are_clear_errors(kwargs, error, fragments):
    model = prepare_model(PlainStack().train(), "fp32+optim:in_backward")
    with pytest.raises(error) as e:
        make_optimizer(model, **kwargs)
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # nothing was built


def test_in_backward_refuses_a_frozen_parameter_in_param_groups():
    model = prepare_model(PlainStack().train(), "fp32+optim:in_backward")
    model.head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"1 frozen parameter\(s\).*shape \(1, 32\).*leave them out"):
        make_optimizer(model, lr=1e-3, param_groups=[{"params": model.parameters()}])
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("with_shapes", [True, False], ids=["saved-now", "saved-before-shapes-were-recorded"])
def test_loading_another_models_state_is_refused_and_changes_nothing(with_shapes):
    """The same number of parameters, another shape: refused at load, naming the parameter and both
    shapes (it used to load, and the next backward failed inside a hook)."""
    other = PlainStack().train()
    other.head = nn.Linear(PlainStack.DIM, 2)  # one more output: the same parameter count, other shapes
    other = prepare_model(other, "fp32+optim:in_backward")
    saved = make_optimizer(other, lr=1e-2)
    _run(other, saved, 1, arch="plain")
    state = copy.deepcopy(saved.state_dict())
    if not with_shapes:
        del state["shapes"]
    model = prepare_model(PlainStack().train(), "fp32+optim:in_backward")
    optimizer = make_optimizer(model, lr=1e-2)
    _run(model, optimizer, 1, arch="plain")
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(
        ValueError, match=r"head\.weight has shape \(1, 32\) but the state dict's parameter 20 has shape \(2, 32\)"
    ):
        optimizer.load_state_dict(state)
    after = optimizer.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for a, b in zip(after["optimizers"], before["optimizers"]):
        assert a["state"].keys() == b["state"].keys()
        assert all(torch.equal(a["state"][k][n], b["state"][k][n]) for k in a["state"] for n in a["state"][k])
    assert _run(model, optimizer, 1, arch="plain")  # and it still trains


def test_loading_a_torch_optimizer_state_is_refused():
    model = prepare_model(PlainStack().train(), "fp32+optim:in_backward")
    optimizer = make_optimizer(model, lr=1e-2)
    with pytest.raises(ValueError, match="not one an OptimizerInBackward saved"):
        optimizer.load_state_dict(torch.optim.AdamW(PlainStack().parameters()).state_dict())


def test_numpy_scalars_and_integer_betas_are_taken_as_torch_adamw_takes_floats():
    import numpy as np

    reference = PlainStack().train()
    ours = prepare_model(copy.deepcopy(reference), "fp32")
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=0.25, betas=(0.0, 0.99))  # 0.25: exact in float32
    optimizer = make_optimizer(
        ours, lr=np.float32(0.25), betas=(0, np.float64(0.99)), gradient_accumulation_steps=np.int64(2)
    )
    assert _run(reference, torch_adamw, arch="plain") == _run(ours, optimizer, arch="plain")


def test_a_model_that_is_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .*got NoneType"):
        make_optimizer(None, lr=1e-3)
