"""FSDP2 on 2 CPU processes (gloo): parity with one process, sharded memory, composition with
checkpointing and compile, saving, resuming, and bad input. Every group has a timeout."""

from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks, train_losses
from tiny import tiny_llama

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3


def _batch(step, lo=0, hi=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(100)  # the same batch each step: the loss must fall
    ids = torch.randint(3, 128, (GLOBAL_BATCH, SEQ), generator=g)[lo:hi]
    return {"input_ids": ids, "labels": ids.clone()}


def _train(model, rank, world, steps, start=0, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = GLOBAL_BATCH // world
    losses = train_losses(
        model, opt, lambda step: _batch(step, rank * per, (rank + 1) * per), range(start, start + steps)
    )
    return losses, opt  # this rank's own losses, on its half of the batch


def _mean_over_ranks(per_rank):
    """The global loss per step from each rank's local losses (equal halves of the batch)."""
    return [sum(step) / len(step) for step in zip(*per_rank)]


def _fsdp_losses(rank, world, policy):
    from hf_memstack import prepare_model

    model = prepare_model(tiny_llama(), policy)
    return _train(model, rank, world, STEPS)[0]


def _single(policy):
    from hf_memstack import prepare_model

    return _train(prepare_model(tiny_llama(), policy), 0, 1, STEPS)[0]


@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_loss_parity_with_one_process(precision, tol):
    per_rank = run_ranks(_fsdp_losses, f"{precision}+fsdp")
    assert per_rank[0] != per_rank[1]  # each rank trained on its own half of the batch
    sharded = _mean_over_ranks(per_rank)
    alone = _single(precision)  # the independent reference: one process on the whole batch
    assert sharded == pytest.approx(alone, rel=tol), (sharded, alone)
    assert sharded[-1] < sharded[0]


def _sharded_bytes(rank, world):
    from hf_memstack import measure_step, prepare_model
    from hf_memstack.measure.accounting import model_state_bytes

    model = prepare_model(tiny_llama(), "fp32+fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = measure_step(model, _batch(0, rank * 2, rank * 2 + 2), opt, timed=False)
    return model_state_bytes(model, opt), m.parameters, m.optimizer


def test_per_rank_state_is_sharded():
    from hf_memstack.measure.accounting import model_state_bytes

    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, 0, 1, 1, opt=opt)
    model(**_batch(0)).loss.backward()
    full = model_state_bytes(model, opt)
    for state, _meter_params, meter_opt in run_ranks(_sharded_bytes):
        assert state.total <= 0.55 * full.total, (state, full)
        # The meter, too, counts this rank's shards (not gathered copies) for the optimizer state.
        assert meter_opt <= 0.55 * full.optimizer


def _compose(rank, world):
    from hf_memstack import MemoryPolicy, prepare_model, verify

    policy = MemoryPolicy.from_string("bf16+compile:regional+ckpt+fsdp")
    policy.compile.backend = "aot_eager"
    model = prepare_model(tiny_llama(), policy)
    report = verify(model, _batch(0, rank * 2, rank * 2 + 2))
    losses = _train(model, rank, world, STEPS)[0]
    return report.ok, str(report), losses


def test_checkpointing_and_compile_inside_fsdp():
    for ok, report, losses in run_ranks(_compose):
        assert ok, report
        assert losses[-1] < losses[0]


def _save(rank, world, directory):
    from hf_memstack import prepare_model
    from hf_memstack.distributed.weights import save_pretrained_full

    model = prepare_model(tiny_llama(), "fp32+fsdp")
    _train(model, rank, world, 2)
    save_pretrained_full(model, directory)
    with torch.no_grad():
        return model(**_batch(9)).logits


def test_save_on_two_ranks_loads_in_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    logits = run_ranks(_save, str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert torch.allclose(loaded(**_batch(9)).logits, logits[0], atol=1e-5)


def _resume(rank, world, directory, phase):
    from hf_memstack import prepare_model
    from hf_memstack.distributed.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

    if phase == "first":
        # The uninterrupted 4 steps and the first 2, saved, in one launch (was two): two models of one seed.
        full = _train(prepare_model(tiny_llama(), "fp32+fsdp"), rank, world, 4)[0]
        model = prepare_model(tiny_llama(), "fp32+fsdp")
        losses, opt = _train(model, rank, world, 2, opt=torch.optim.AdamW(model.parameters(), lr=1e-2))
        save_sharded_checkpoint(model, opt, directory)
        return full, losses
    model = prepare_model(tiny_llama(), "fp32+fsdp")  # a fresh process: only the checkpoint carries state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded_checkpoint(model, opt, directory)
    return _train(model, rank, world, 2, start=2, opt=opt)[0]


def test_resume_from_sharded_checkpoint(tmp_path):
    full, first = run_ranks(_resume, str(tmp_path / "ckpt"), "first")[0]
    second = run_ranks(_resume, str(tmp_path / "ckpt"), "second")[0]
    assert len(first) == len(second) == 2
    assert first + second == pytest.approx(full, rel=1e-6)


def _bad(rank, world, case):
    from torch import nn

    from hf_memstack import prepare_model

    try:
        if case == "inconsistent":
            prepare_model(tiny_llama(), "bf16+fsdp" if rank == 0 else "fp32+fsdp")
        else:
            prepare_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), "fsdp")
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None, ""


def test_inconsistent_policies_fail_on_every_rank_without_hanging():
    from hf_memstack.distributed import DistributedMismatchError

    assert issubclass(DistributedMismatchError, RuntimeError) and issubclass(DistributedMismatchError, ValueError)
    for kind, message in run_ranks(_bad, "inconsistent", timeout=120):
        assert kind == "DistributedMismatchError" and "different memory policies" in message


def test_blocks_not_found_under_fsdp():
    for kind, message in run_ranks(_bad, "no_blocks", timeout=120):
        assert kind == "ValueError" and "block_classes" in message


def _from_rank0(rank, world, directory, policy):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_memstack import prepare_model
    from hf_memstack.distributed import from_pretrained_for_fsdp

    model = from_pretrained_for_fsdp(AutoModelForCausalLM, directory)
    on_meta = all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    model = prepare_model(model, policy)
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        # With labels the loss is fp32 and the logits stay in the compute dtype (bf16 here).
        logits = model.eval()(**_batch(0)).logits.float()
    # Training continues from the broadcast weights in step on both ranks.
    model.train()
    losses = _train(model, rank, world, 2)[0]
    dist.barrier()
    return on_meta, local / total, logits, losses, model.memstack.fsdp.weights_from


@pytest.mark.parametrize("arch, policy", [("llama", "fp32+fsdp"), ("gpt2", "bf16+ckpt+fsdp")])
def test_rank0_loads_and_broadcasts_the_others_start_on_meta(tmp_path, arch, policy):
    """Only rank 0 reads the weights; rank 1 builds on the meta device and gets its shards (and the
    rotary buffers no state dict carries) by broadcast: both then compute what one process does."""
    from tiny import configs, model_class
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model_class(arch)(configs()[arch]).save_pretrained(tmp_path / "m")
    results = run_ranks(_from_rank0, str(tmp_path / "m"), policy)
    alone = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        reference = alone(**_batch(0)).logits
    (meta0, frac0, logits0, losses0, how0), (meta1, frac1, logits1, losses1, how1) = results
    assert (meta0, meta1) == (False, True)
    assert how0 == how1 == "rank 0 broadcast"
    assert frac0 <= 0.55 and frac1 <= 0.55
    tol = 1e-5 if policy.startswith("fp32") else 5e-2
    assert torch.allclose(logits0, reference, atol=tol) and torch.allclose(logits1, reference, atol=tol)
    steps = _mean_over_ranks([losses0, losses1])
    assert steps[1] < steps[0]


def _meta_on_rank0(rank, world, directory):
    from transformers import AutoModelForCausalLM

    from hf_memstack import prepare_model

    if rank == 0:
        with torch.device("meta"):
            model = tiny_llama()
    else:
        model = AutoModelForCausalLM.from_pretrained(directory)
    try:
        prepare_model(model, "fsdp")
    except RuntimeError as e:
        return str(e), any(not p.is_meta and type(p).__name__ == "DTensor" for p in model.parameters())
    return "", None


def test_rank0_on_meta_is_a_clear_error_on_every_rank(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "m")
    for message, sharded in run_ranks(_meta_on_rank0, str(tmp_path / "m"), timeout=120):
        assert "rank 0's model is on the meta device" in message and "from_pretrained_for_fsdp" in message
        assert sharded is False


def _different_models(rank, world):
    from hf_memstack import prepare_model

    model = tiny_llama()
    if rank == 1:
        model = model.to(torch.bfloat16)
    try:
        prepare_model(model, "fp32+fsdp")
    except RuntimeError as e:
        return str(e)
    return ""


def test_different_models_across_ranks_fail_before_sharding():
    for message in run_ranks(_different_models, timeout=120):
        assert "rank 1 holds a different model from rank 0" in message and "bfloat16" in message


def _fp16_steps(rank, world):
    import warnings

    from hf_memstack import prepare_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU: slow, fine for testing the loop
        model = prepare_model(tiny_llama(), "fp16+fsdp")
    scaler = model.memstack.grad_scaler
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = GLOBAL_BATCH // world
    record = []
    for step in range(3):
        loss = model(**_batch(step, rank * per, (rank + 1) * per)).loss
        scaler.scale(loss).backward()
        if step == 1 and rank == 1:  # an overflow in one rank's gradient shard only
            next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("inf")
        before = [p.detach().to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        changed = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
        record.append((changed, float(scaler.get_scale()), float(loss)))
    return type(scaler).__name__, record


def test_fp16_scaler_skips_the_same_steps_on_every_rank():
    """An inf in rank 1's gradient shard makes both ranks skip that step and halve the scale: a
    rank-local check would let rank 0 step alone and the shards drift apart."""
    (kind0, rec0), (kind1, rec1) = run_ranks(_fp16_steps)
    assert kind0 == kind1 == "GradScaler"
    assert [r[:2] for r in rec0] == [r[:2] for r in rec1]
    (step0, scale0, _), (step1, scale1, _), (step2, scale2, _) = rec0
    assert (step0, step1, step2) == (True, False, True)
    assert scale1 == scale0 / 2 == scale2


def _clipped(rank, world, max_norm):
    from hf_memstack import prepare_model

    model = prepare_model(tiny_llama(), "fp32+fsdp" if world > 1 else "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = GLOBAL_BATCH // world
    norms = []
    for step in range(3):
        model(**_batch(step, rank * per, (rank + 1) * per)).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def test_gradient_clipping_uses_the_norm_over_all_shards():
    (norms0, params0), (norms1, _) = run_ranks(_clipped, 0.5)
    alone_norms, alone_params = _clipped(0, 1, 0.5)  # the independent reference: one process
    assert norms0 == pytest.approx(alone_norms, rel=1e-5) and norms1 == pytest.approx(alone_norms, rel=1e-5)
    assert min(norms0) > 0.5  # the clip was active on every step
    for a, b in zip(params0, alone_params):
        assert torch.allclose(a, b, atol=1e-5)


def _preflight_failures(rank, world, directory):
    """One rank fails a pre-flight check; every rank must raise (never wait in a collective)."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    from hf_memstack import MemoryPolicy, prepare_model
    from hf_memstack.distributed import from_pretrained_for_fsdp
    from hf_memstack.distributed.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

    def outcome(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the type and message are what the test checks
            return type(e).__name__, str(e)
        return None, ""

    tvm = MemoryPolicy(precision="fp32", compile={"mode": "regional", "backend": "tvm"}, fsdp="full_shard")
    results = {
        "policy": outcome(lambda: prepare_model(tiny_llama(), "fp32+fsdp" if rank == 0 else "fp32+fsdp+warp")),
        "prepared": outcome(
            lambda: prepare_model(tiny_llama() if rank == 0 else prepare_model(tiny_llama(), "fp32"), "fp32+fsdp")
        ),
        "backend": outcome(lambda: prepare_model(tiny_llama(), "fp32+fsdp" if rank == 0 else tvm)),
        "blocks": outcome(
            lambda: prepare_model(
                tiny_llama() if rank == 0 else nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), "fp32+fsdp"
            )
        ),
        "load": outcome(lambda: from_pretrained_for_fsdp(AutoModelForCausalLM, f"{directory}/no-such-model")),
    }
    model = prepare_model(tiny_llama(), "fp32+fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, rank, world, 1, opt=opt)
    save_sharded_checkpoint(model, opt, f"{directory}/ckpt")
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        Path(directory, "ckpt", "hf_memstack_checkpoint.json").rename(Path(directory, "manifest.json"))
    dist.barrier()
    results["manifest"] = outcome(lambda: load_sharded_checkpoint(model, opt, f"{directory}/ckpt"))
    results["trusted"] = outcome(lambda: load_sharded_checkpoint(model, opt, f"{directory}/ckpt", trusted=True))
    return results


def test_one_rank_failing_its_checks_fails_every_rank_without_hanging(tmp_path):
    r0, r1 = run_ranks(_preflight_failures, str(tmp_path), timeout=150)
    assert r1["policy"][0] == "PolicyError" and "unknown token 'warp'" in r1["policy"][1]
    for case, (kind, message) in ((c, r0[c]) for c in ("policy", "prepared", "backend", "blocks")):
        assert kind == "DistributedMismatchError" and "rank(s) [1]" in message, (case, message)
    assert r1["prepared"][0] == "RuntimeError" and "already prepared" in r1["prepared"][1]
    assert (
        r1["backend"][0] == "RuntimeError" and "'tvm' needs" in r1["backend"][1] and "'tvm' needs" in r0["backend"][1]
    )
    assert r1["blocks"][0] == "ValueError" and "cannot find repeated blocks" in r1["blocks"][1]
    assert r0["load"][0] in ("OSError", "ValueError") and r1["load"][0] == "DistributedMismatchError"
    assert "rank 0 could not load" in r1["load"][1]
    for r in (r0, r1):
        assert (
            r["manifest"][0] == "ValueError"
            and "no hf_memstack_checkpoint.json" in r["manifest"][1]
            and "trusted=True" in r["manifest"][1]
        )
        assert r["trusted"] == (None, "")
