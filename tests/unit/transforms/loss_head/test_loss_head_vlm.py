"""loss:chunked on vision-language models (issue 40): wherever the logits are over the vocabulary
(Qwen2-VL, Qwen2.5-VL, LLaVA, Idefics3, SmolVLM, Gemma-3, Mllama), the chunked loss and every
gradient equal the model's own on a batch with pixels; Qwen2-VL was refused ("its loss has no
vocabulary-sized logits to chunk") though its logits are [batch, seq, vocabulary]."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import assert_untouched, snapshot
from tiny_vlm import VLMS, tiny_vlm, vlm_batch

from hf_memstack import MemoryPolicy, prepare_model, verify


def _step(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_loss_and_gradients(model: torch.nn.Module, reference: torch.nn.Module, batch: dict) -> None:
    want, want_grads = _step(reference, batch)
    got, got_grads = _step(model, batch)
    assert float(got.loss.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-5)
    assert got.logits is None  # the [batch, seq, vocabulary] logits never existed
    assert got_grads.keys() == want_grads.keys()
    assert any("vision" in n or "visual" in n for n in want_grads)  # the pixels went through the vision tower
    # Gradients that are zero in exact arithmetic (a key bias: softmax ignores it) differ by rounding
    # alone, so each is compared against the largest gradient of the model as well as its own.
    overall = max(g.abs().max().item() for g in want_grads.values())
    for name, g in want_grads.items():
        assert (got_grads[name] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-6 * overall, name


@pytest.mark.parametrize("arch", VLMS)
def test_chunked_loss_and_every_gradient_equal_the_vlms_own(arch):
    reference = tiny_vlm(arch)
    model = prepare_model(
        copy.deepcopy(reference), MemoryPolicy(precision="fp32", loss={"mode": "chunked", "chunk_tokens": 7})
    )
    assert model.memstack.loss.mode == "chunked" and model.memstack.loss.path == "fused"
    batch = vlm_batch(arch, 3)
    _assert_same_loss_and_gradients(model, reference, batch)


def test_patch_major_pixels_go_through_the_backbone_with_checkpointing():
    """Qwen2-VL's pixels are patch-major ([16 * n, 1176]); with ckpt on every block, the loss is the
    model's own and verify compares the heads on the whole batch (a row cut would leave one patch)."""
    reference = tiny_vlm("qwen2_vl")
    model = prepare_model(copy.deepcopy(reference), "fp32+ckpt+loss:chunked")
    batch = vlm_batch("qwen2_vl", 3)
    assert batch["pixel_values"].shape[0] == 16 * 3
    _assert_same_loss_and_gradients(model, reference, batch)
    check = verify(model, batch).check("loss")
    assert check.ok and "whole batch" in check.detail, check.detail


@pytest.mark.slow
def test_compiled_chunks_equal_the_vlms_own():
    reference = tiny_vlm("qwen2_vl")
    policy = MemoryPolicy(precision="fp32", loss={"mode": "chunked", "chunk_tokens": 7, "compiled": True})
    model = prepare_model(copy.deepcopy(reference), policy)
    assert model.memstack.loss.compiled
    _assert_same_loss_and_gradients(model, reference, vlm_batch("qwen2_vl", 3))


def _blip2() -> torch.nn.Module:
    import transformers

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    qformer = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64}
    text = {"model_type": "opt", "vocab_size": 128, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 1}
    config = transformers.Blip2Config(
        vision_config={**vision, "image_size": 28, "patch_size": 14},
        qformer_config={**qformer, "encoder_hidden_size": 32},
        text_config={**text, "num_attention_heads": 4, "word_embed_proj_dim": 64},
        num_query_tokens=4,
    )
    torch.manual_seed(0)
    return transformers.Blip2ForConditionalGeneration(config)


def test_a_vlm_whose_backbone_is_the_whole_model_is_refused_untouched():
    """BLIP-2's language model sits inside its forward (base_model is the model itself): its logits
    are over the vocabulary, but no backbone can be run without the head, so it is refused, saying why."""
    model = _blip2()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        prepare_model(model, "fp32+loss:chunked")
    for fragment in ("Blip2ForConditionalGeneration", "base_model is the model itself", "drop loss:chunked"):
        assert fragment in str(info.value), str(info.value)
    assert_untouched(model, before)
