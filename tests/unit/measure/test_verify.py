"""verify: one observed forward + backward that says whether the policy really took effect - each
check reported with what was seen, the model's gradients and RNG left as they were, and the FLOPs
it counts equal to PyTorch's own FlopCounterMode on the unprepared model."""

import pytest
import torch
from tiny import make_batch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hf_memstack import MemoryPolicy, prepare_model, verify
from hf_memstack.measure import train_step


def _policy(spec: str) -> MemoryPolicy:
    p = MemoryPolicy.from_string(spec)
    p.compile.backend = "aot_eager"
    return p


def _flops(model: nn.Module, batch: dict) -> tuple[int, int]:
    """The forward's and the backward's FLOPs, as PyTorch's FlopCounterMode counts them."""
    with FlopCounterMode(display=False) as counter:
        loss = model(**batch)["loss"]
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return forward, counter.get_total_flops()


def test_verify_flags_t5_eager_region(load_model):
    # T5's first decoder block sets requires_grad on its position bias, which dynamo cannot trace
    # inside a checkpoint: that region silently runs eager (pytorch#97436). verify must say so.
    model = prepare_model(load_model("t5"), _policy("bf16+compile:regional+ckpt"))
    report = verify(model, make_batch("t5"))
    compile_check = report.check("compile")
    assert not compile_check.ok
    assert "ran eager" in compile_check.detail and "graph breaks:" in compile_check.detail
    assert report.check("checkpointing").ok and report.check("gradients").ok


def test_verify_catches_eval_mode_and_unused_parameters(load_model):
    model = prepare_model(load_model("llama"), "ckpt")
    model.eval()
    report = verify(model, make_batch("llama"))
    assert not report.check("checkpointing").ok
    assert "eval mode" in report.check("checkpointing").detail
    model.train()
    model.unused = nn.Linear(4, 4)  # a trainable parameter the forward never touches
    report = verify(model, make_batch("llama"))
    assert not report.check("gradients").ok and "unused.weight" in report.check("gradients").detail
    with pytest.raises(RuntimeError, match="unused.weight"):
        verify(model, make_batch("llama"), raise_on_failure=True)


def test_verify_leaves_gradients_and_rng_as_they_were(load_model):
    model = prepare_model(load_model("plain"), "bf16+ckpt")
    train_step(model, make_batch("plain"))  # leaves .grad populated (no optimizer)
    grads = [p.grad.clone() for p in model.parameters()]
    state = torch.get_rng_state()
    verify(model, make_batch("plain"))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_the_flops_it_counts_are_flop_counter_modes_on_the_unprepared_model(load_model):
    """Without checkpointing the step's FLOPs are the unprepared model's; with it, the backward
    spends exactly the recompute on top of the same gradients' FLOPs."""
    batch = make_batch("llama")
    forward, backward = _flops(load_model("llama"), batch)
    plain = verify(prepare_model(load_model("llama"), "fp32"), batch)
    assert (plain.forward_flops, plain.backward_flops, plain.recompute_flops) == (forward, backward, 0)
    ckpt = verify(prepare_model(load_model("llama"), "fp32+ckpt"), batch)
    assert ckpt.forward_flops == forward and ckpt.backward_flops - ckpt.recompute_flops == backward
    assert 0 < ckpt.recompute_flops < forward  # the blocks re-ran; the head did not


def test_checkpointing_switched_off_after_prepare_fails_the_policy_and_checkpointing_checks(load_model):
    """Transformers' per-block flags flipped off after prepare_model (what a late
    gradient_checkpointing_disable does): nothing recomputes, so the step saves what a model
    prepared without checkpointing saves, and verify says both."""
    batch = make_batch("llama")
    model = prepare_model(load_model("llama"), "fp32+ckpt")
    assert verify(model, batch).ok
    for block in model.memstack.blocks.modules:
        block.gradient_checkpointing = False
    report = verify(model, batch)
    assert not report.ok and report.recomputed_blocks == []
    assert "Transformers checkpointing is on for blocks []" in report.check("policy").detail
    checkpointing = report.check("checkpointing")
    assert not checkpointing.ok and "expected [0, 1]" in checkpointing.detail
    assert report.check("gradients").ok and report.check("precision").ok
    without = verify(prepare_model(load_model("llama"), "fp32"), batch)
    assert report.saved_activation_bytes == without.saved_activation_bytes


def test_non_finite_gradients_are_named_as_a_plain_backward_gives_them(load_model):
    """One NaN weight: the gradients check fails and names the first parameters whose gradients
    are not finite - the same ones PyTorch's own backward on the unprepared model gives."""
    batch = make_batch("llama")
    models = [load_model("llama"), load_model("llama")]
    for m in models:
        with torch.no_grad():
            m.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    reference = models[0]
    reference(**batch).loss.backward()
    bad = [n for n, p in reference.named_parameters() if not torch.isfinite(p.grad).all()]
    assert bad  # the NaN spreads through the backward
    report = verify(prepare_model(models[1], "fp32"), batch)
    gradients = report.check("gradients")
    assert not gradients.ok and f"non-finite: {bad[:5]}" in gradients.detail, gradients.detail
    assert gradients.detail.startswith(f"{sum(1 for p in reference.parameters()) - len(bad)}/")


def test_a_loss_that_is_not_finite_is_never_ok(load_model):
    """Every label -100, with a loss_fn (the loss is then the caller's, so the batch is not refused):
    the model's loss is 0/0 = nan while every gradient is a finite 0. The gradients check fails on
    the loss (was: every check [ok])."""
    batch = make_batch("llama")
    batch["labels"] = torch.full_like(batch["labels"], -100)
    reference = load_model("llama")
    loss = reference(**batch).loss
    loss.backward()
    assert loss.isnan() and all(torch.isfinite(p.grad).all() for p in reference.parameters())
    report = verify(prepare_model(load_model("llama"), "fp32"), batch, loss_fn=lambda outputs, b: outputs.loss)
    gradients = report.check("gradients")
    assert not report.ok and not gradients.ok
    assert "the loss is not finite (nan or inf)" in gradients.detail and "all -100" in gradients.detail, (
        gradients.detail
    )


def test_a_batch_without_labelled_tokens_fails_the_gradients_check(load_model):
    """Every label -100 (past each row's first, which a causal LM never predicts): the loss is nan,
    every gradient a finite 0, and nothing trains. verify runs it - in a Trainer's first batch that is
    a warning, not a crash - and fails the gradients check naming why (was: every check [ok])."""
    batch = make_batch("llama")
    batch["labels"][:, 1:] = -100
    report = verify(prepare_model(load_model("llama"), "fp32"), batch)
    gradients = report.check("gradients")
    assert not report.ok and not gradients.ok
    assert "every label in labels (shape (2, 16)) is -100 past each row's first token" in gradients.detail
    assert "no labelled token" in gradients.detail and "0/0 = nan" in gradients.detail, gradients.detail
    assert all(c.ok for c in report.checks if c.name != "gradients")  # the rest of the step is as it should be
