"""Mixed precision (policy precision bf16/fp16/fp32): the forward runs under autocast with fp32
outputs, as Accelerate's recipe does - the loss, the logits and every gradient equal the unprepared
model's under PyTorch's own ``torch.autocast``, the weights stay fp32 - and fp32 adds no autocast;
the fp16 GradScaler loop, an Accelerator's autocast, and devices or weights autocast cannot serve."""

import contextlib

import pytest
import torch
from tiny import ARCHS, assert_untouched, make_batch, snapshot
from torch import nn

from hf_memstack import prepare_model, verify
from hf_memstack.measure import train_step


def _linear_outputs(model: nn.Module) -> list[tuple[torch.dtype, bool]]:
    """Filled by the forward: each Linear's output dtype, and whether CPU autocast was on around it."""
    seen: list[tuple[torch.dtype, bool]] = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append((out.dtype, torch.is_autocast_enabled("cpu"))))
    return seen


@pytest.mark.parametrize("arch", ["llama", "plain"])
@pytest.mark.parametrize("spec, autocast", [("bf16", torch.bfloat16), ("fp32", None)])
def test_the_step_is_the_unprepared_models_under_torchs_own_autocast(load_model, arch, spec, autocast):
    """bf16: bitwise what ``torch.autocast('cpu', torch.bfloat16)`` around the unprepared model
    gives (logits cast to fp32), with the Linear layers computing in bf16 and the weights left fp32;
    fp32: bitwise the unprepared model, with no autocast anywhere in the forward."""
    batch = make_batch(arch)
    reference = load_model(arch)
    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
        expected = reference(**batch)
    expected["loss"].backward()
    model = prepare_model(load_model(arch), spec)
    seen = _linear_outputs(model)
    out = model(**batch)
    out["loss"].backward()
    assert set(seen) == ({(autocast, True)} if autocast else {(torch.float32, False)})
    assert out["loss"].dtype == out["logits"].dtype == torch.float32
    assert torch.equal(out["loss"], expected["loss"].float()) and torch.equal(out["logits"], expected["logits"].float())
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert b.dtype == torch.float32 and torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("arch", [*ARCHS, "plain"])
def test_bf16_loss_close_to_fp32(load_model, arch):
    batch = make_batch(arch)
    fp32 = train_step(prepare_model(load_model(arch), "fp32"), batch)
    bf16 = train_step(prepare_model(load_model(arch), "bf16"), batch)
    assert bf16 != fp32  # autocast really changed the arithmetic
    assert abs(bf16 - fp32) <= 0.02 * abs(fp32) + 1e-3


def test_bf16_outputs_are_fp32_with_and_without_labels(load_model):
    """fp32 outputs as Accelerate returns them, the logits included when the model computed its
    loss: a user's own loss term from the logits then runs in fp32 (a model's KL to itself is 0)."""
    model = prepare_model(load_model("llama"), "bf16").eval()
    batch = make_batch("llama")
    with torch.no_grad():
        with_labels = model(**batch)
        without = model(input_ids=batch["input_ids"])
        as_tuple = model(input_ids=batch["input_ids"], labels=batch["labels"], return_dict=False)
    assert with_labels.loss.dtype == torch.float32 and with_labels.logits.dtype == torch.float32
    assert without.loss is None and without.logits.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in as_tuple if torch.is_tensor(t))
    a, b = with_labels.logits.log_softmax(-1), without.logits.log_softmax(-1)
    assert torch.nn.functional.kl_div(a, b, log_target=True, reduction="batchmean") == 0


def test_fp16_loop_with_grad_scaler_on_cpu(load_model):
    with pytest.warns(UserWarning, match="fp16' on CPU"):
        model = prepare_model(load_model("llama"), "fp16+ckpt")
    scaler = model.memstack.grad_scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    # The loop docs/precision.md documents for fp16 without an Accelerator.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch("llama")
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert verify(model, batch).check("precision").detail.startswith("Linear outputs in ['torch.float16']")


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_with_accelerator_autocast_comes_from_prepare(load_model, fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = prepare_model(load_model("llama"), "bf16+ckpt", accelerator=acc)
    assert model.memstack.autocast_by == "accelerator.prepare"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    report = verify(model, make_batch("llama"))
    assert report.ok, str(report)
    batch = make_batch("llama")
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_accelerator_precision_mismatch(load_model, fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="no")
    model = load_model("llama")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"Accelerator\(mixed_precision='bf16'\)"):
        prepare_model(model, "bf16", accelerator=acc)
    assert_untouched(model, before)


def test_mixed_precision_on_a_device_without_autocast():
    from hf_memstack.transforms.precision.apply import resolve_precision

    with pytest.raises(RuntimeError, match="device type 'meta' has no autocast; use precision='fp32'"):
        resolve_precision("fp16", "meta")


def test_low_precision_weights_without_autocast_warn(load_model):
    model = load_model("llama").to(torch.bfloat16)
    with pytest.warns(
        UserWarning, match=r"trainable parameter\(s\) of LlamaForCausalLM are torch.bfloat16: they train in 16 bits"
    ):
        prepare_model(model, "fp32")
    assert {p.dtype for p in model.parameters()} == {
        torch.bfloat16
    }  # left as loaded: no autocast to mix them with fp32
