"""The chunked loss head over labelled positions only (issue 41): the rows whose shifted label is
-100 never go through the output head, and the loss and every gradient still equal the model's own
(0%, 50% and all-but-one masked; packed rows; num_items_in_batch; tied, untied, soft-capped and
PEFT heads; an all-masked batch)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_loss_head import _assert_grads_close, _causal_lm, _chunked, _step
from tiny import VOCAB, make_batch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memstack import MemoryPolicy, prepare_model, verify

_HEAD_VOCAB = VOCAB + 3
"""The models' vocabulary here: an output width no other matmul of the tiny models has."""


def _model(arch: str) -> torch.nn.Module:
    return _causal_lm(arch, vocab=_HEAD_VOCAB)


class _HeadRows(TorchDispatchMode):
    """Counts the rows of every matmul whose output is vocabulary-wide: the rows that went through the head."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Any overload: the eager chunks write their logits into a reused buffer (mm.out).
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == _HEAD_VOCAB:
            self.rows += out.shape[0]
        return out


def _masked(fraction: str, batch_size: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    batch = make_batch("llama", batch_size=batch_size, seed=seed)
    labels = batch["labels"]
    if fraction == "half":
        labels[:, : labels.shape[1] // 2] = -100  # the prompt: the first half of every row
    elif fraction == "all-but-one":
        kept = labels[1, 7].clone()
        labels[:] = -100
        labels[1, 7] = kept  # one counted position (predicted at row 1, position 6)
    return batch


def _labelled(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("fraction", ["none", "half", "all-but-one"])
def test_only_labelled_rows_go_through_the_head_and_every_gradient_matches(arch, fraction):
    reference = _model(arch)
    model = prepare_model(copy.deepcopy(reference), _chunked())
    batch = _masked(fraction)
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(_labelled(batch) + 4)}):
        want_loss, want = _step(reference, batch, **kwargs)
        with _HeadRows() as seen:
            got_loss, got = _step(model, batch, **kwargs)
        assert seen.rows == _labelled(batch)
        assert got_loss == pytest.approx(want_loss, rel=1e-5)
        _assert_grads_close(got, want, rel=1e-5)


def test_bf16_within_its_noise_at_half_masked():
    reference = prepare_model(_model("llama"), "bf16")
    model = prepare_model(_model("llama"), _chunked(precision="bf16"))
    batch = _masked("half")
    want_loss, want = _step(reference, batch)
    with _HeadRows() as seen:
        got_loss, got = _step(model, batch)
    assert seen.rows == _labelled(batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-2)
    _assert_grads_close(got, want, rel=5e-2)


def test_an_all_masked_batch_gives_the_models_own_answer():
    """As ForCausalLMLoss: a nan loss with gradients of 0 over zero items; 0 with num_items_in_batch."""
    reference = _model("llama")
    model = prepare_model(copy.deepcopy(reference), _chunked())
    batch = _masked("none")
    batch["labels"][:] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(5)}):
        want_loss, want = _step(reference, batch, **kwargs)
        got_loss, got = _step(model, batch, **kwargs)
        assert got_loss == pytest.approx(want_loss, nan_ok=True)
        assert all(torch.equal(got[n], want[n]) for n in want), "gradients of an all-masked batch"


def test_packed_rows_with_prompt_masking():
    """Two samples per row (positions restarting), each with its prompt and its first label masked."""
    # Both prepared: the same per-sample attention of packed rows, only the loss differs.
    reference = prepare_model(_model("qwen2"), "fp32")
    model = prepare_model(_model("qwen2"), _chunked(chunk_tokens=4))
    batch = make_batch("llama", batch_size=2, seed=5)
    seq = batch["input_ids"].shape[1]
    half = seq // 2
    batch["position_ids"] = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand(2, seq).clone()
    for start, prompt in ((0, 3), (half, 5)):
        batch["labels"][:, start : start + prompt] = -100
    want_loss, want = _step(reference, batch)
    _step(model, batch)  # the packing guard's one-time probe of the model's packed attention runs first
    with _HeadRows() as seen:
        got_loss, got = _step(model, batch)
    assert seen.rows == _labelled(batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(got, want, rel=1e-5)


@pytest.mark.parametrize("how", ["lora-head", "saved-head"])
def test_peft_heads_over_labelled_rows(how):
    from peft import LoraConfig, get_peft_model

    targets, saved = (["q_proj", "lm_head"], None) if how == "lora-head" else (["q_proj"], ["lm_head"])
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=saved, init_lora_weights=False)
    torch.manual_seed(3)
    reference = get_peft_model(_model("llama"), config)
    model = prepare_model(copy.deepcopy(reference), _chunked())
    batch = _masked("half")
    head_rows: list[int] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, _out: head_rows.append(args[0].shape[0]))
    try:
        for kwargs in ({}, {"num_items_in_batch": torch.tensor(_labelled(batch) + 2)}):
            want_loss, want = _step(reference, batch, **kwargs)
            head_rows.clear()
            with _HeadRows() as seen:
                got_loss, got = _step(model, batch, **kwargs)
            assert got_loss == pytest.approx(want_loss, rel=1e-5)
            _assert_grads_close(got, want, rel=1e-5)
            # The LoRA head is called per chunk (forward, then its recompute): each labelled row twice.
            rows = sum(head_rows) if how == "lora-head" else seen.rows
            assert rows == (2 if how == "lora-head" else 1) * _labelled(batch)
    finally:
        hook.remove()


def test_verify_says_how_many_positions_went_through_the_head():
    model = prepare_model(_model("llama"), _chunked())
    batch = _masked("half")
    batch["labels"][0] = -100  # verify compares on the first sample with a label: the second
    report = verify(model, batch)
    check = report.check("loss")
    labelled = int((batch["labels"][1, 1:] != -100).sum())
    assert check.ok and f"the head ran over {labelled} of its 16 positions" in check.detail, check.detail


@pytest.mark.slow
def test_compiled_chunks_take_a_varying_number_of_rows_without_recompiling():
    """loss:chunked:compiled over labelled rows: the row count changes every step (random prompt
    fractions), and the compiled chunk function is dynamic in it - a bounded number of graphs (the
    general one, and at most one for a last chunk of a single row), not one per step."""
    from torch._dynamo.utils import counters

    reference = _model("llama")
    policy = MemoryPolicy(precision="fp32", loss={"mode": "chunked", "chunk_tokens": 16, "compiled": True})
    model = prepare_model(copy.deepcopy(reference), policy)
    g = torch.Generator().manual_seed(0)
    counters.clear()
    seen: set[int] = set()
    for step in range(12):
        batch = make_batch("llama", batch_size=2, seq=64, seed=step)
        prompts = (torch.rand(2, generator=g) * 60).long()
        if step == 3:
            prompts[:] = torch.tensor([47, 62])  # 16 + 1 labelled rows: a last chunk of one row
        for row, prompt in enumerate(prompts.tolist()):
            batch["labels"][row, : prompt + 1] = -100
        seen.add(_labelled(batch))
        want_loss, _ = _step(reference, batch)
        got_loss, _ = _step(model, batch)
        assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert len(seen) >= 10  # the row count did vary
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
