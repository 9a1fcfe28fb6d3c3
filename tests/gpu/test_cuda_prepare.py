"""prepare_model on a CUDA GPU: ``bf16+ckpt`` gives the loss and gradients of the unprepared model
under PyTorch's own CUDA autocast, keeps the weights fp32, and holds less memory at the step's peak
(``torch.cuda.max_memory_allocated``) than ``bf16`` alone on a sequence long enough for the
activations to dominate."""

from __future__ import annotations

import torch
from tiny import make_batch
from torch import nn

from hf_memstack import prepare_model, verify

CUDA = torch.device("cuda")


def _loss_and_grads(model: nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().float(), [p.grad.float() for p in model.parameters()]


def test_bf16_ckpt_step_is_the_unprepared_models_under_torchs_own_autocast(load_model):
    batch = {k: v.to(CUDA) for k, v in make_batch("llama").items()}
    reference = load_model("llama").to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected, expected_grads = _loss_and_grads(reference, batch)
    model = prepare_model(load_model("llama").to(CUDA), "bf16+ckpt")
    report = verify(model, batch)
    assert report.ok and report.recomputed_blocks == [0, 1], str(report)
    loss, grads = _loss_and_grads(model, batch)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    # The recompute re-runs the same bf16 kernels; the tolerance is bf16's, for kernels that reorder sums.
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=1e-3)
    for (name, _), g, e in zip(reference.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-3, msg=name)


def _peak_step_bytes(spec: str) -> int:
    """The peak of one forward + backward over what the model and its batch hold before it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = prepare_model(LlamaForCausalLM(config).to(CUDA).train(), spec)
    ids = torch.randint(3, config.vocab_size, (4, 2048), device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del model, ids
    torch.cuda.empty_cache()
    return peak


def test_checkpointing_lowers_the_steps_peak_memory_on_a_long_sequence():
    """Every block checkpointed holds less than every other block, which holds less than none."""
    plain, every_other, full = (_peak_step_bytes(spec) for spec in ("bf16", "bf16+ckpt:2", "bf16+ckpt"))
    assert full < every_other < plain, (full, every_other, plain)
    assert full < 0.7 * plain, (full, plain)
