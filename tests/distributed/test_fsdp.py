"""FSDP2 on 2 CPU processes (gloo): parity with one process, sharded memory, composition with
checkpointing and compile, saving, resuming, and bad input. Every group has a timeout."""

import pytest
import torch
from dist_utils import run_ranks

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 3


def _model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, bos_token_id=1, eos_token_id=2)).train()


def _batch(step, lo=0, hi=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(100)  # the same batch each step: the loss must fall
    ids = torch.randint(3, 128, (GLOBAL_BATCH, SEQ), generator=g)[lo:hi]
    return {"input_ids": ids, "labels": ids.clone()}


def _train(model, rank, world, steps, start=0, opt=None):
    import torch.distributed as dist

    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(start, start + steps):
        loss = model(**_batch(step, rank * per, (rank + 1) * per)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(float(t) / world)
    return losses, opt


def _fsdp_losses(rank, world, policy):
    from hf_memstack import prepare_model

    model = prepare_model(_model(), policy)
    return _train(model, rank, world, STEPS)[0]


def _single(policy):
    from hf_memstack import prepare_model

    return _train(prepare_model(_model(), policy), 0, 1, STEPS)[0]


@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 3e-2)])
def test_loss_parity_with_one_process(precision, tol):
    sharded = run_ranks(_fsdp_losses, f"{precision}+fsdp")
    assert sharded[0] == sharded[1]
    alone = _single(precision)
    assert sharded[0] == pytest.approx(alone, rel=tol), (sharded[0], alone)
    assert sharded[0][-1] < sharded[0][0]


def _sharded_bytes(rank, world):
    from hf_memstack import measure_step, prepare_model
    from hf_memstack.memory import model_state_bytes

    model = prepare_model(_model(), "fp32+fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = measure_step(model, _batch(0, rank * 2, rank * 2 + 2), opt, timed=False)
    return model_state_bytes(model, opt), m.parameters, m.optimizer


def test_per_rank_state_is_sharded():
    from hf_memstack.memory import model_state_bytes

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, 0, 1, 1, opt=opt)
    model(**_batch(0)).loss.backward()
    full = model_state_bytes(model, opt)
    full_total = full["parameters"] + full["gradients"] + full["optimizer"]
    for state, meter_params, meter_opt in run_ranks(_sharded_bytes):
        total = state["parameters"] + state["gradients"] + state["optimizer"]
        assert total <= 0.55 * full_total, (state, full)
        # The meter, too, counts this rank's shards (not gathered copies) for the optimizer state.
        assert meter_opt <= 0.55 * full["optimizer"]


def _compose(rank, world):
    from hf_memstack import MemoryPolicy, prepare_model, verify

    policy = MemoryPolicy.from_string("bf16+compile:regional+ckpt+fsdp")
    policy.compile.backend = "aot_eager"
    model = prepare_model(_model(), policy)
    report = verify(model, _batch(0, rank * 2, rank * 2 + 2))
    losses = _train(model, rank, world, STEPS)[0]
    return report.ok, str(report), losses


def test_checkpointing_and_compile_inside_fsdp():
    for ok, report, losses in run_ranks(_compose):
        assert ok, report
        assert losses[-1] < losses[0]


def _save(rank, world, directory):
    from hf_memstack import prepare_model
    from hf_memstack.fsdp import save_pretrained_full

    model = prepare_model(_model(), "fp32+fsdp")
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
    from hf_memstack.fsdp import load_sharded_checkpoint, save_sharded_checkpoint

    model = prepare_model(_model(), "fp32+fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if phase == "full":
        return _train(model, rank, world, 4, opt=opt)[0]
    if phase == "first":
        losses, _ = _train(model, rank, world, 2, opt=opt)
        save_sharded_checkpoint(model, opt, directory)
        return losses
    load_sharded_checkpoint(model, opt, directory)
    return _train(model, rank, world, 2, start=2, opt=opt)[0]


def test_resume_from_sharded_checkpoint(tmp_path):
    full = run_ranks(_resume, str(tmp_path), "full")[0]
    first = run_ranks(_resume, str(tmp_path / "ckpt"), "first")[0]
    second = run_ranks(_resume, str(tmp_path / "ckpt"), "second")[0]
    assert first + second == pytest.approx(full, rel=1e-6)


def _bad(rank, world, case):
    from torch import nn

    from hf_memstack import prepare_model

    try:
        if case == "inconsistent":
            prepare_model(_model(), "bf16+fsdp" if rank == 0 else "fp32+fsdp")
        else:
            prepare_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), "fsdp")
    except (RuntimeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None, ""


def test_inconsistent_policies_fail_on_every_rank_without_hanging():
    for kind, message in run_ranks(_bad, "inconsistent", timeout=120):
        assert kind == "RuntimeError" and "different memory policies" in message


def test_blocks_not_found_under_fsdp():
    for kind, message in run_ranks(_bad, "no_blocks", timeout=120):
        assert kind == "ValueError" and "block_classes" in message
