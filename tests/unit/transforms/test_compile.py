import pytest
import torch
from tiny import make_batch

from hf_memstack import MemoryPolicy, prepare_model, verify
from hf_memstack.measure import train_step


def _policy(spec, backend="aot_eager"):
    p = MemoryPolicy.from_string(spec)
    p.compile.backend = backend
    return p


def test_regional_compile_shares_one_graph_across_blocks(load_model):
    model = prepare_model(load_model("llama"), _policy("bf16+compile:regional+ckpt"))
    assert model.memstack.compile.regions == ["model.layers.0", "model.layers.1"]
    report = verify(model, make_batch("llama"))
    assert report.ok, str(report)
    # Two identical blocks, one compiled graph reused by both.
    assert model.memstack.compile.graphs_compiled == 1
    assert report.compiled_calls >= 2


def test_compiled_loss_matches_eager(load_model):
    batch = make_batch("gpt2")
    eager = train_step(prepare_model(load_model("gpt2"), "fp32"), batch)
    compiled = prepare_model(load_model("gpt2"), _policy("fp32+compile"))
    assert train_step(compiled, batch) == pytest.approx(eager, rel=1e-5)
    assert compiled.memstack.compile.graph_calls > 0


def test_compile_counter_counts_only_compiled_calls(load_model):
    model = prepare_model(load_model("llama"), _policy("compile:regional"))
    # Run the model under a stance that skips compiled code: the record shows no compiled calls.
    with torch.compiler.set_stance("force_eager"):
        train_step(model, make_batch("llama"))
    assert model.memstack.compile.graph_calls == 0
    assert verify(model, make_batch("llama")).check("compile").ok  # verify runs the compiled path itself


def test_inductor_mode_and_backend_are_validated(load_model):
    with pytest.raises(ValueError, match="inductor_mode='max-autotune' only applies to backend='inductor'"):
        MemoryPolicy(compile={"mode": "full", "backend": "aot_eager", "inductor_mode": "max-autotune"})


@pytest.mark.slow
def test_real_inductor_regional_compile_with_checkpointing(load_model):
    batch = make_batch("llama")
    eager = train_step(prepare_model(load_model("llama"), "bf16+ckpt"), batch)
    model = prepare_model(load_model("llama"), "bf16+compile:regional+ckpt")
    report = verify(model, batch)
    assert report.ok, str(report)
    assert train_step(model, batch) == pytest.approx(eager, rel=2e-2)
    assert model.memstack.compile.compile_seconds > 0
