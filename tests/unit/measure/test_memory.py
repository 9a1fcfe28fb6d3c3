import torch
from tiny import make_batch

from hf_memstack import measure_step, prepare_model


def _param_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def test_categories_and_determinism(load_model):
    model = prepare_model(load_model("llama"), "fp32")
    opt = torch.optim.AdamW(model.parameters())
    batch = make_batch("llama", batch_size=4, seq=32)
    first = measure_step(model, batch, opt)  # warms the optimizer state up first
    second = measure_step(model, batch, opt)
    fields = ("peak_bytes", "parameters", "gradients", "optimizer", "activations", "temporaries", "other")
    assert [getattr(first, f) for f in fields] == [getattr(second, f) for f in fields]
    assert first.parameters == _param_bytes(model)
    # AdamW keeps two fp32 moments per parameter (plus a step counter each).
    assert first.optimizer >= 2 * sum(p.numel() * 4 for p in model.parameters())
    assert first.activations > 0 and first.step_seconds > 0
    assert first.method == "memtracker"


def test_without_an_optimizer_the_step_is_forward_and_backward(load_model):
    model = prepare_model(load_model("gpt2"), "fp32")
    m = measure_step(model, make_batch("gpt2"), timed=False)
    # No optimizer phase: the step's peak is the forward+backward peak, part-way through the backward.
    assert 0 < m.gradients <= sum(p.numel() * 4 for p in model.parameters()) and m.optimizer == 0
    assert m.peak_phase == "forward+backward" and m.peak_bytes == m.forward_backward_peak and m.step_seconds is None


def test_checkpointing_cuts_activation_peak(load_model):
    batch = make_batch("llama", batch_size=8, seq=64)
    plain = measure_step(prepare_model(load_model("llama"), "bf16"), batch, timed=False)
    ckpt = measure_step(prepare_model(load_model("llama"), "bf16+ckpt"), batch, timed=False)
    assert ckpt.peak_bytes < plain.peak_bytes
    # What the forward leaves for the backward: only the blocks' inputs under full checkpointing.
    assert ckpt.saved_activations < 0.4 * plain.saved_activations
    assert plain.forward_backward_peak <= plain.peak_bytes
