import json
import math

import pytest
import torch
from tiny import PlainStack, make_batch

from hf_memstack import find_batch_size, measure_step, prepare_model


def llama_batches(seq=32):
    def make(n):
        return make_batch("llama", batch_size=n, seq=seq, seed=n)
    return make


def peak_at(load_model, policy, n, seq=32):
    model = prepare_model(load_model("llama"), policy)
    opt = torch.optim.AdamW(model.parameters())
    return measure_step(model, make_batch("llama", batch_size=n, seq=seq, seed=n), opt, timed=False).peak_bytes


@pytest.mark.parametrize("policy", ["fp32", "bf16+ckpt"])
def test_finds_the_true_maximum_in_few_steps(load_model, policy):
    model = prepare_model(load_model("llama"), policy)
    opt = torch.optim.AdamW(model.parameters())
    budget = peak_at(load_model, policy, 40)  # the true maximum is near 40 by construction
    result = find_batch_size(model, llama_batches(), opt, budget=budget, cache=False)
    assert result.steps_run <= 4, result.summary()
    found = result.batch_size
    # The returned size was run, and fits; never above the true maximum; at least 0.95 of it.
    assert any(p.batch_size == found and p.fits for p in result.probes)
    assert peak_at(load_model, policy, found) <= budget
    assert peak_at(load_model, policy, math.floor(found / 0.95) + 1) > budget
    assert result.peak_bytes <= budget and result.fit["bytes_per_sample"] > 0


def test_no_side_effects_bitwise(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=10)
    batch = make_batch("llama")
    model(**batch).loss.backward()
    opt.step()
    sched.step()
    model(**batch).loss.backward()  # leave gradients in place too
    before = {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [p.grad.clone() for p in model.parameters()],
        "opt": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt.state_dict()["state"].items()},
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "training": model.training,
    }
    find_batch_size(model, llama_batches(), opt, budget=peak_at(load_model, "bf16", 24), scheduler=sched, cache=False)
    assert all(torch.equal(a, p) for a, p in zip(before["params"], model.parameters()))
    assert all(torch.equal(a, p.grad) for a, p in zip(before["grads"], model.parameters()))
    after_opt = opt.state_dict()["state"]
    assert before["opt"].keys() == after_opt.keys()
    for k, s in before["opt"].items():
        for n, v in s.items():
            assert torch.equal(v, after_opt[k][n]) if torch.is_tensor(v) else v == after_opt[k][n]
    assert sched.state_dict() == before["sched"]
    assert torch.equal(torch.get_rng_state(), before["rng"]) and model.training == before["training"]


class OOMAbove(PlainStack):
    """Raises the real CUDA out-of-memory exception above a chosen batch size (search logic only)."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.calls = []

    def forward(self, x, y=None):
        self.calls.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (batch {x.shape[0]})")
        return super().forward(x, y)


@pytest.mark.parametrize("limit", [1, 3, 37, 100])
def test_search_with_injected_ooms(limit):
    torch.manual_seed(0)
    model = prepare_model(OOMAbove(limit), "fp32")
    opt = torch.optim.AdamW(model.parameters())
    result = find_batch_size(model, lambda n: make_batch("plain", batch_size=n), opt, budget="8GiB",
                             max_batch_size=4096, cache=False)
    assert limit * 0.95 <= result.batch_size <= limit, result.summary()
    assert [p for p in result.probes if p.peak_bytes is None], "an OOM must have been met and recorded"
    assert not any(p.fits for p in result.probes if p.batch_size > limit)


def test_oom_everywhere_is_a_clear_error():
    model = prepare_model(OOMAbove(0), "fp32")
    with pytest.raises(ValueError, match=r"cannot hold one train step at batch size 1.*out of memory.*ckpt"):
        find_batch_size(model, lambda n: make_batch("plain", batch_size=n), torch.optim.AdamW(model.parameters()),
                        budget="8GiB", cache=False)
    with pytest.raises(ValueError, match=r"cannot hold one eval step"):
        find_batch_size(model, lambda n: make_batch("plain", batch_size=n), budget="8GiB", mode="eval", cache=False)
    assert model.training  # eval probing switched the mode; the failure switched it back


def test_eval_size_is_separate_and_larger(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    opt = torch.optim.AdamW(model.parameters())
    budget = peak_at(load_model, "bf16", 16)
    train = find_batch_size(model, llama_batches(), opt, budget=budget, cache=False)
    evals = find_batch_size(model, llama_batches(), budget=budget, mode="eval", cache=False)
    assert evals.mode == "eval" and evals.batch_size > train.batch_size
    assert model.training  # restored after eval probing


def test_global_batch_and_tokens(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    opt = torch.optim.AdamW(model.parameters())
    result = find_batch_size(model, llama_batches(seq=48), opt, budget="2GiB", max_batch_size=24, global_batch_size=100, cache=False)
    assert result.batch_size == 24 and result.seq_len == 48 and result.tokens_per_batch == 24 * 48
    assert result.grad_accum == 5 and not result.exact_global_batch  # 24 x 5 = 120 != 100
    assert result.exact_batch_size == 20 and "matches exactly" in result.summary()
    exact = find_batch_size(model, llama_batches(seq=48), opt, budget="2GiB", max_batch_size=25, global_batch_size=100, cache=False)
    assert (exact.batch_size, exact.grad_accum, exact.exact_global_batch) == (25, 4, True)


def test_cache_hit_miss_and_invalidation(load_model, tmp_path):
    model = prepare_model(load_model("llama"), "bf16")
    opt = torch.optim.AdamW(model.parameters())
    budget = peak_at(load_model, "bf16", 20)
    first = find_batch_size(model, llama_batches(), opt, budget=budget, cache_dir=tmp_path)
    assert not first.cache_hit and first.steps_run >= 2
    second = find_batch_size(model, llama_batches(), opt, budget=budget, cache_dir=tmp_path)
    assert second.cache_hit and second.steps_run == 1 and second.batch_size == first.batch_size
    # A longer sequence is another job: a miss.
    longer = find_batch_size(model, llama_batches(seq=64), opt, budget=budget, cache_dir=tmp_path)
    assert not longer.cache_hit and longer.batch_size < first.batch_size
    # A cached size that no longer fits is re-verified, dropped and searched again.
    path = tmp_path / "batch_size" / (second.cache_file.rsplit("/", 1)[-1])
    data = json.loads(path.read_text())
    data["batch_size"] = first.batch_size * 4
    path.write_text(json.dumps(data))
    third = find_batch_size(model, llama_batches(), opt, budget=budget, cache_dir=tmp_path)
    assert not third.cache_hit and third.batch_size == first.batch_size
    assert json.loads(path.read_text())["batch_size"] == first.batch_size
    off = find_batch_size(model, llama_batches(), opt, budget=budget, cache=False)
    assert not off.cache_hit and off.cache_file is None


def test_compiled_model_probes_without_recompiling_per_size(load_model):
    from hf_memstack import MemoryPolicy

    policy = MemoryPolicy.from_string("bf16+compile:regional")
    policy.compile.backend = "aot_eager"
    model = prepare_model(load_model("llama"), policy)
    opt = torch.optim.AdamW(model.parameters())
    result = find_batch_size(model, llama_batches(), opt, budget="1GiB", max_batch_size=64, cache=False)
    assert "marked dynamic" in result.compile_note
    sizes = {p.batch_size for p in result.probes}
    assert len(sizes) >= 3
    # One static graph for the batch-1 shape check plus one dynamic graph for every probe size.
    assert model.memstack.compile.graphs_compiled <= 2


# ----------------------------------------------------------------------------- bad input


def test_budget_below_the_weights(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    with pytest.raises(ValueError, match=r"smaller than the model's parameters alone.*needs about .*FSDP"):
        find_batch_size(model, llama_batches(), torch.optim.AdamW(model.parameters()), budget="100KiB", cache=False)


def test_budget_below_one_step_suggests_next_rung(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    params = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(ValueError, match=r"cannot hold one train step at batch size 1: it needs .*'bf16\+ckpt'"):
        find_batch_size(model, llama_batches(), torch.optim.AdamW(model.parameters()), budget=int(params * 1.5), cache=False)


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"max_batch_size": 0}, ValueError, "max_batch_size=0 must be a positive integer"),
        ({"probe_size": -2}, ValueError, "probe_size=-2 must be a positive integer"),
        ({"global_batch_size": 0}, ValueError, "global_batch_size=0 must be a positive integer"),
        ({"budget": None}, ValueError, "budget is required on cpu"),
        ({"budget": "lots"}, ValueError, "budget='lots' is not a size"),
        ({"mode": "infer"}, ValueError, "mode='infer' is not one of"),
    ],
)
def test_bad_arguments(load_model, kwargs, error, fragment):
    model = prepare_model(load_model("llama"), "bf16")
    args = {"budget": "1GiB", "cache": False, **kwargs}
    with pytest.raises(error, match=fragment):
        find_batch_size(model, llama_batches(), torch.optim.AdamW(model.parameters()), **args)


def test_batch_callable_returning_the_wrong_size(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    with pytest.raises(ValueError, match=r"make_batch\(1\) returned tensors of shapes \[\(4, 16\), \(4, 16\)\].*exactly 1"):
        find_batch_size(model, lambda n: make_batch("llama", batch_size=4), torch.optim.AdamW(model.parameters()), budget="1GiB", cache=False)
    with pytest.raises(ValueError, match="needs the optimizer"):
        find_batch_size(model, llama_batches(), None, budget="1GiB", cache=False)
