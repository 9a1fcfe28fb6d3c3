"""Selective (op-level) checkpointing (policy token ckpt:selective[:alternate]): proven by counting
FLOPs with PyTorch's FlopCounterMode on CPU and by the bytes saved for backward, through
Transformers' own checkpointing and the PyTorch checkpoint wrapper; gradients equal, composed with
compile and LoRA; Trainer-style re-enabling refused; a warning and a verify FAIL when nothing matched."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from tiny import PlainStack, make_batch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hf_memstack import MemoryPolicy, PolicyError, measure_step, prepare_model, verify
from hf_memstack.transforms.checkpointing.apply import SelectiveCheckpointingWarning

RUNGS = ["fp32", "fp32+ckpt:selective", "fp32+ckpt:selective:alternate", "fp32+ckpt"]


def _flops_and_saved(model: nn.Module, batch: dict) -> tuple[int, int, int]:
    """Forward FLOPs, backward FLOPs (recompute included), and the activation bytes alive after the
    forward (the memory meter's count: what checkpointing keeps, selective's saved op outputs included)."""
    with FlopCounterMode(display=False) as counter:
        loss = model(**batch)["loss"]
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, counter.get_total_flops(), measure_step(model, batch, None, timed=False).saved_activations


@pytest.mark.parametrize("arch, method", [("llama", "transformers"), ("gpt2", "transformers"), ("plain", "torch")])
def test_backward_flops_between_none_and_full_checkpointing(load_model, arch, method):
    batch = make_batch(arch)
    seen = {}
    for spec in RUNGS:
        model = prepare_model(load_model(arch), spec)
        assert model.memstack.checkpointing.method == ("none" if spec == "fp32" else method)
        seen[spec] = _flops_and_saved(model, batch)
    forward = {f for f, _, _ in seen.values()}
    assert len(forward) == 1  # the forward computes the same
    none, keep_all, alternate, full = (seen[s][1] for s in RUNGS)
    # Every matmul kept: no matmul recomputed; every second recomputed: between none and full.
    assert none == keep_all < full
    assert none <= alternate < full
    if arch != "plain":  # the plain block's second matmul output is needed by nothing in backward
        assert none < alternate
    # Fewer bytes saved for backward, the more is recomputed.
    saved = [seen[s][2] for s in RUNGS]
    assert saved[0] > saved[1] >= saved[2] > saved[3], saved


def test_verify_reports_recompute_flops_between_none_and_full(load_model):
    batch = make_batch("llama")
    reports = {spec: verify(prepare_model(load_model("llama"), spec), batch) for spec in RUNGS}
    assert all(r.ok for r in reports.values()), {s: str(r) for s, r in reports.items()}
    recompute = [reports[s].recompute_flops for s in RUNGS]
    assert recompute[0] == recompute[1] == 0 < recompute[2] < recompute[3], recompute
    # The backward is the gradients' FLOPs plus the recompute: the gradients' part is the same for all.
    grads = {reports[s].backward_flops - reports[s].recompute_flops for s in RUNGS}
    assert len(grads) == 1, grads
    detail = reports["fp32+ckpt:selective:alternate"].check("checkpointing").detail
    assert "backward recomputed" in detail and "over the gradients" in detail


@pytest.mark.parametrize("arch, spec", [("llama", "bf16+ckpt:selective"), ("plain", "bf16+ckpt:selective:alternate")])
def test_gradients_equal_and_activations_shrink(load_model, arch, spec):
    reference = prepare_model(load_model(arch), spec.split("+")[0])
    model = prepare_model(load_model(arch), spec)
    batch = make_batch(arch)
    for m in (reference, model):
        m(**batch)["loss"].backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name  # recomputing the same ops gives the same bits
    plain = measure_step(reference, batch, None, timed=False)
    selective = measure_step(model, batch, None, timed=False)
    assert selective.saved_activations < plain.saved_activations


def test_composes_with_compile_and_lora(load_model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    reference = get_peft_model(load_model("llama"), lora)
    policy = MemoryPolicy.from_string("fp32+ckpt:selective:alternate+compile:regional")
    policy.compile.backend = "aot_eager"
    model = prepare_model(copy.deepcopy(reference), policy)
    batch = make_batch("llama")
    report = verify(model, batch)
    assert report.ok and 0 < report.recompute_flops, str(report)
    for m in (reference, model):
        m(**batch).loss.backward()
    adapters = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    ours = dict(model.named_parameters())
    assert adapters and all(torch.allclose(p.grad, ours[n].grad, rtol=1e-5, atol=1e-7) for n, p in adapters)
    assert model.memstack.compile.graph_calls > 0


def test_trainer_style_re_enabling_keeps_the_policy_and_another_request_is_refused(load_model):
    from hf_memstack.transforms.checkpointing.apply import selective_context_fn

    model = prepare_model(load_model("llama"), "bf16+ckpt:selective")
    want = verify(model, make_batch("llama")).recompute_flops
    with pytest.warns(
        UserWarning, match="already checkpoints .*selective\\(save_all\\).*the policy's checkpointing is kept"
    ):
        model.gradient_checkpointing_enable()  # what TrainingArguments(gradient_checkpointing=True) calls (TRL's default)
    model.activation_checkpointing_enable(
        {"use_reentrant": False, "context_fn": selective_context_fn("save_all")}
    )  # the same
    with pytest.raises(RuntimeError, match="selective\\(save_alternate\\).*would replace"):
        model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": selective_context_fn("save_alternate")}
        )
    with pytest.raises(RuntimeError, match="every_n_layers=2.*would replace"):
        model.activation_checkpointing_enable(every_n_layers=2)
    assert verify(model, make_batch("llama")).recompute_flops == want  # nothing changed


@pytest.mark.parametrize(
    "arch, copies",
    [
        ("gpt2", (copy.deepcopy,)),  # (Transformers' checkpointing leaves an unpicklable hook on its models)
        (
            "plain",
            (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))),
        ),  # the checkpoint wrapper's context_fn pickles
    ],
)
def test_copies_keep_selective_checkpointing(load_model, arch, copies):
    model = prepare_model(load_model(arch), "fp32+ckpt:selective:alternate")
    batch = make_batch(arch)
    want = verify(model, batch).recompute_flops
    for make_copy in copies:
        copied = make_copy(model)
        assert verify(copied, batch).recompute_flops == want


class _Elementwise(nn.Module):
    """A block without a single matmul or attention kernel: nothing selective checkpointing keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(PlainStack.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(x)).square()


def test_warns_and_verify_fails_when_no_op_in_the_save_list_ran():
    torch.manual_seed(0)
    model = PlainStack()
    model.layers = nn.ModuleList(_Elementwise() for _ in range(3))
    model = prepare_model(model.train(), "fp32+ckpt:selective")
    batch = make_batch("plain")
    with pytest.warns(SelectiveCheckpointingWarning, match="no op in the save list"):
        model(**batch)["loss"].backward()
    report = verify(model, batch)
    check = report.check("checkpointing")
    assert not check.ok and "use checkpointing mode 'full'" in check.detail, str(report)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mode": "selective", "use_reentrant": True}, "use_reentrant=True with mode='selective'"),
        ({"mode": "full", "selective_matmuls": "save_alternate"}, "only applies to mode='selective'"),
        (
            {"mode": "selective", "selective_matmuls": "half"},
            "selective_matmuls='half' is not one of 'save_all', 'save_alternate'",
        ),
    ],
)
def test_bad_selective_settings(kwargs, fragment):
    with pytest.raises(PolicyError, match=fragment):
        MemoryPolicy(checkpointing=kwargs)


def test_policy_tokens():
    p = MemoryPolicy.from_string("bf16+ckpt:selective:alternate")
    assert (p.checkpointing.mode, p.checkpointing.selective_matmuls) == ("selective", "save_alternate")
    assert MemoryPolicy.from_string(p.to_string()) == p == MemoryPolicy.from_dict(p.to_dict())
    assert MemoryPolicy.from_string("ckpt:selective").checkpointing.selective_matmuls == "save_all"
