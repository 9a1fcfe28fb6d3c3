"""Activation checkpointing (policy tokens ckpt, ckpt:N, ckpt:offload): through Transformers' own
checkpointing or ``torch.utils.checkpoint`` around each block; the loss and every gradient equal the
unprepared model's, and what the forward saves for backward is what PyTorch's own checkpoint API
saves around the same blocks. Selective checkpointing has its own file, test_checkpointing_selective.py."""

import functools

import pytest
import torch
from tiny import make_batch
from torch import nn

from hf_memstack import MemoryPolicy, prepare_model, verify


def _saved_bytes_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    """The loss, the bytes the forward saved for backward outside checkpointed regions (inside one,
    the checkpoint's own saved-tensor hooks take the tensors instead), and the gradients."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch)["loss"]
    loss.backward()
    return loss.detach(), saved, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "plain"])
@pytest.mark.parametrize("spec", ["ckpt", "ckpt:2", "ckpt:offload", "ckpt:selective"])
def test_loss_and_gradients_equal_the_unprepared_models(load_model, arch, spec):
    """Recomputing the blocks' forward gives the same loss and gradients (fp32, so to rounding), and
    the forward saves less for backward than the unprepared model's: checkpointing is really on."""
    batch = make_batch(arch)
    reference = load_model(arch)
    expected, unchecked, expected_grads = _saved_bytes_and_grads(reference, batch)
    loss, saved, grads = _saved_bytes_and_grads(prepare_model(load_model(arch), spec), batch)
    assert saved < unchecked
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    for (name, _), g, e in zip(reference.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("spec, wrapped", [("ckpt", [0, 1, 2]), ("ckpt:2", [0, 2])])
def test_a_plain_stack_saves_what_torch_utils_checkpoint_around_its_blocks_saves(load_model, spec, wrapped):
    """Not a Transformers model: the reference wraps the same blocks' forward in PyTorch's own
    ``torch.utils.checkpoint.checkpoint`` by hand; the bytes saved for backward and the gradients
    are the same, and both save far less than the model without checkpointing."""
    batch = make_batch("plain")
    reference = load_model("plain")
    for i in wrapped:
        block = reference.layers[i]
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)
    ref_loss, ref_saved, ref_grads = _saved_bytes_and_grads(reference, batch)
    loss, saved, grads = _saved_bytes_and_grads(prepare_model(load_model("plain"), spec), batch)
    _, unchecked, _ = _saved_bytes_and_grads(load_model("plain"), batch)
    assert saved == ref_saved < unchecked
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


@pytest.mark.parametrize("arch, method", [("llama", "transformers"), ("t5", "transformers"), ("plain", "torch")])
def test_checkpointing_method_and_recompute(load_model, arch, method):
    plain = verify(prepare_model(load_model(arch), "fp32"), make_batch(arch))
    model = prepare_model(load_model(arch), "fp32+ckpt")
    report = verify(model, make_batch(arch))
    assert model.memstack.checkpointing.method == method
    assert report.recomputed_blocks == list(range(len(model.memstack.blocks)))
    # The proof that memory is saved: far fewer bytes saved for backward.
    assert report.saved_activation_bytes < 0.6 * plain.saved_activation_bytes


def test_wrapper_keeps_state_dict_keys(load_model):
    before = set(load_model("plain").state_dict())
    model = prepare_model(load_model("plain"), "ckpt")
    assert set(model.state_dict()) == before


@pytest.mark.parametrize("arch, expected", [("llama", [0]), ("t5", [0, 2]), ("plain", [0, 2])])
def test_every_n_checkpoints_every_other_block(load_model, arch, expected):
    model = prepare_model(load_model(arch), "ckpt:2")
    report = verify(model, make_batch(arch))
    assert report.ok, str(report)
    assert report.recomputed_blocks == expected


@pytest.mark.parametrize("reentrant", [False, True])
def test_frozen_embeddings_still_train_under_checkpointing(load_model, reentrant):
    model = load_model("llama")
    model.get_input_embeddings().weight.requires_grad_(False)
    policy = MemoryPolicy(precision="bf16", checkpointing={"mode": "full", "use_reentrant": reentrant})
    report = verify(prepare_model(model, policy), make_batch("llama"))
    assert report.check("gradients").ok, str(report)
    assert report.check("checkpointing").ok, str(report)


def test_old_transformers_api_only_gradient_checkpointing_enable(load_model, monkeypatch):
    from transformers import PreTrainedModel

    model = load_model("llama")
    cls = type(model)
    calls = []

    # transformers < 5: no activation_checkpointing_enable, and gradient_checkpointing_enable takes
    # only gradient_checkpointing_kwargs. The stand-in runs Transformers' real implementation.
    def old_gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        calls.append(gradient_checkpointing_kwargs)
        PreTrainedModel._activation_checkpointing_enable(self, gradient_checkpointing_kwargs)

    monkeypatch.setattr(
        cls,
        "activation_checkpointing_enable",
        property(lambda self: (_ for _ in ()).throw(AttributeError)),
        raising=False,
    )
    monkeypatch.setattr(cls, "gradient_checkpointing_enable", old_gradient_checkpointing_enable, raising=False)
    prepare_model(model, "ckpt")
    assert calls == [{"use_reentrant": False}]
    assert model.memstack.checkpointing.method == "transformers"
    assert verify(model, make_batch("llama")).recomputed_blocks == [0, 1]
    # every_n is not in the old API: the PyTorch wrapper does it instead.
    model2 = load_model("llama")
    prepare_model(model2, "ckpt:2")
    assert model2.memstack.checkpointing.method == "torch"
    assert verify(model2, make_batch("llama")).recomputed_blocks == [0]
