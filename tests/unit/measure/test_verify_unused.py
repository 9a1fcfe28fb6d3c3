"""verify's gradients check tells "the loss cannot give this parameter a gradient" (a note: LLaVA's
vision post_layernorm, which the unprepared model never trains either) apart from "it should have got
one and did not" (a FAIL: a block cut from the graph by a hook, a weight used outside autograd,
reentrant checkpointing with frozen inputs), reading autograd's graph, without an unprepared copy."""

import pytest
import torch
import torch.nn.functional as F
from tiny import make_batch
from tiny_vlm import tiny_vlm, vlm_batch

from hf_memstack import MemoryPolicy, prepare_model, verify


def _without_gradient(model: torch.nn.Module, batch: dict) -> list[str]:
    """The trainable parameters a plain backward of the model's own loss leaves without a gradient."""
    model(**batch).loss.backward()
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


def test_llava_vision_post_layernorm_is_a_note_not_a_failure():
    """LLaVA with vision_feature_layer=-1 reads the vision tower's last hidden layer, from before its
    post_layernorm: the norm runs, nothing it computes reaches the loss (was: a FAIL, so
    raise_on_failure and MemstackCallback could not be used on LLaVA)."""
    batch = vlm_batch("llava", 2)
    unused = _without_gradient(tiny_vlm("llava"), batch)
    assert unused and all("post_layernorm" in n for n in unused)  # the unprepared model's own answer
    model = prepare_model(tiny_vlm("llava"), "bf16+ckpt")
    report = verify(model, batch, raise_on_failure=True)
    gradients = report.check("gradients")
    assert report.ok and gradients.ok, str(report)
    assert f"note: {len(unused)} trainable parameter(s) the loss does not use: {unused}" in gradients.detail
    assert "no gradient:" not in gradients.detail and "freeze them" in gradients.detail


def _detach_output(module: torch.nn.Module, args: object, output: object) -> object:
    if isinstance(output, torch.Tensor):
        return output.detach()
    return (output[0].detach(), *output[1:])  # type: ignore[index]


def test_a_block_detached_from_the_loss_by_a_hook_still_fails(load_model):
    """A hook detaching the last block's output under checkpointing: every block and the embeddings
    lose their gradients (a bug, not the model's design). Their modules' outputs do lead to the
    parameters, so only the cut tells this apart from an unused branch: it stays a FAIL naming the block."""
    batch = make_batch("llama")
    reference = load_model("llama")
    reference.model.layers[-1].register_forward_hook(_detach_output)
    lost = _without_gradient(reference, batch)
    assert "model.layers.0.mlp.down_proj.weight" in lost
    model = prepare_model(load_model("llama"), "ckpt")
    last = len(model.model.layers) - 1
    model.model.layers[-1].register_forward_hook(_detach_output)
    gradients = verify(model, batch).check("gradients")
    assert not gradients.ok, gradients.detail
    assert f"no gradient: {lost[:5]}" in gradients.detail and "note:" not in gradients.detail
    assert f"The output of ['model.layers.{last}'] needs no gradient" in gradients.detail
    with pytest.raises(RuntimeError, match="no gradient"):
        verify(model, batch, raise_on_failure=True)


def _weight_outside_autograd(model: torch.nn.Module, outside: str) -> None:
    """down_proj of the first block reads its weight through .detach() or under torch.no_grad."""
    down = model.model.layers[0].mlp.down_proj

    def forward(x: torch.Tensor) -> torch.Tensor:
        if outside == "detach":
            return F.linear(x, down.weight.detach())
        with torch.no_grad():
            return F.linear(x, down.weight)

    down.forward = forward


@pytest.mark.parametrize("outside", ["detach", "no_grad"])
def test_a_weight_used_outside_autograd_still_fails(load_model, outside):
    """The forward uses down_proj's weight, the graph never reaches it (under no_grad, neither the
    gate and up projections before it): a FAIL naming what a plain backward leaves without a gradient,
    never a note."""
    batch = make_batch("llama")
    reference = load_model("llama")
    _weight_outside_autograd(reference, outside)
    lost = _without_gradient(reference, batch)
    assert "model.layers.0.mlp.down_proj.weight" in lost
    model = prepare_model(load_model("llama"), "bf16+ckpt")
    _weight_outside_autograd(model, outside)
    gradients = verify(model, batch).check("gradients")
    assert not gradients.ok and f"no gradient: {lost[:5]}" in gradients.detail, gradients.detail
    assert "note:" not in gradients.detail


def test_reentrant_checkpointing_with_frozen_inputs_keeps_its_failure_and_hint(load_model):
    """Reentrant checkpointing runs each block under no_grad, so the loss's graph holds none of their
    parameters: with frozen embeddings and no input that requires grad they get no gradient. That is
    the classic silent bug, not an unused parameter: a FAIL with its hint, no note."""
    model = load_model("llama")
    model.get_input_embeddings().weight.requires_grad_(False)
    policy = MemoryPolicy(precision="bf16", checkpointing={"mode": "full", "use_reentrant": True})
    model = prepare_model(model, policy)
    embeddings = model.get_input_embeddings()
    for hook_id in list(embeddings._forward_hooks):  # undo enable_input_require_grads
        embeddings._forward_hooks.pop(hook_id)
    gradients = verify(model, make_batch("llama")).check("gradients")
    assert not gradients.ok and "no gradient: ['model.layers.0." in gradients.detail, gradients.detail
    assert "reentrant checkpointing with block inputs that do not require grad" in gradients.detail
    assert "note:" not in gradients.detail


class _LinearDroppingWeightGrad(torch.autograd.Function):
    """x @ w.T whose backward gives x its gradient and w none (a custom kernel's bug)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        return grad @ weight, None


def test_a_weight_the_losss_graph_reaches_without_getting_a_gradient_still_fails(load_model):
    """The loss's graph reaches down_proj's weight (it is an input of the custom function) and the
    backward gives it nothing: "should have got one and did not", a FAIL, never a note."""
    model = prepare_model(load_model("llama"), "fp32")
    down = model.model.layers[0].mlp.down_proj
    down.forward = lambda x: _LinearDroppingWeightGrad.apply(x, down.weight)
    gradients = verify(model, make_batch("llama")).check("gradients")
    assert not gradients.ok and "no gradient: ['model.layers.0.mlp.down_proj.weight']" in gradients.detail
    assert "note:" not in gradients.detail, gradients.detail


def test_llava_under_regional_compile_keeps_the_note():
    """Regional compile: verify observes the step eager (force_eager), so the graph it walks is the
    eager one and the unused norm is a note there too; a graph dynamo traced records nothing."""
    policy = MemoryPolicy.from_string("bf16+compile:regional+ckpt")
    policy.compile.backend = "aot_eager"
    report = verify(prepare_model(tiny_vlm("llava"), policy), vlm_batch("llava", 2))
    gradients = report.check("gradients")
    assert gradients.ok and "post_layernorm.weight" in gradients.detail.split("note:")[1], gradients.detail
