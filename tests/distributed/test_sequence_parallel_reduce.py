"""sp:N's loss and gradient reduction on 2 gloo ranks: the sharded step (shard_batch, backward_loss, average_gradients,
reported_loss) equals the unsharded step on rank 0 - without FSDP, and with FSDP2 on the ranks of the
("dp", "sp") mesh: (1, 2) (sp:2) and (2, 1) (sp:1, two data-parallel ranks); verify's "sequence parallel"
line passes on such a step and fails when a group's ranks got different rows; one rank's bad batch ends
both ranks with its message; Trainer arguments sp:N cannot honour are refused. One launch runs every
scenario; each test checks one."""

import datetime

import pytest
import torch
from dist_utils import run_ranks, timed
from tiny import make_batch, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROMPT = 20.0  # the group's timeout in dist_utils is 60 s: an error shared at once ends far below it
ROWS, SEQ = 2, 16


def _batch(seed=1):
    batch = make_batch("llama", batch_size=ROWS, seq=SEQ, seed=seed)
    batch["labels"][:, :3] = -100  # some ignored labels: the token count is the group's, not a shard's
    return batch


# "packed": rows of samples 5 + 13 + 14 tokens (one spans the two ranks' halves), a packed batch's position ids
# "dropout": attention_dropout=0.1 (its masks differ between a slice and the whole rows: the line turns it off)
VERIFIED = [
    "fp32+sp:2",
    "fp32+fsdp+sp:2",
    "fp32+ckpt+loss:chunked+sp:2",
    "bf16+ckpt+sp:2",
    "fp32+sp:2 packed",
    "fp32+sp:2 dropout",
    "fp32+sp:2 BatchEncoding",
]


def _packed():
    batch = make_batch("llama", batch_size=ROWS, seq=32, seed=3)
    batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(13), torch.arange(14)]).expand(ROWS, -1)
    return batch


def _model(lora):
    """The tiny Llama, with LoRA adapters on q/v (their weights drawn after a fixed seed) under ``lora``."""
    model = tiny_llama()
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _trained(model):
    return [p for p in model.parameters() if p.requires_grad]


def _sharded_step(rank, policy, batch):
    """The library's step on this rank's slice: (reported loss, every parameter's full gradient)."""
    from hf_memstack import prepare_model
    from hf_memstack.transforms.sequence_parallel import shard_batch
    from hf_memstack.transforms.sequence_parallel.reduce import average_gradients, backward_loss, reported_loss

    model = prepare_model(_model("lora" in policy), policy.split()[0])
    n = model.memstack.policy.sequence_parallel.size
    loss = model(**shard_batch(batch, sp_rank=rank % n, sp_size=n)).loss
    backward_loss(loss, model).backward()
    average_gradients(model)
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in _trained(model)]
    return float(reported_loss(loss, model)), grads


def _against_unsharded(loss, grads, batch, lora=False):
    """|loss - the unsharded model's loss|, and the largest gradient difference relative to the largest gradient."""
    ref = _model(lora)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_grads = [p.grad for p in _trained(ref)]
    assert len(ref_grads) == len(grads)
    scale = max(float(g.abs().max()) for g in ref_grads)
    dgrad = max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads))
    return abs(loss - float(ref_loss)), dgrad / scale


def _parity(rank, world):
    results = {}
    batch = _batch()
    for name, policy in (
        ("plain", "fp32+sp:2"),
        ("fsdp", "fp32+fsdp+sp:2"),
        ("hybrid_shard", "fp32+fsdp:hybrid_shard+sp:2"),
        ("lora_plain", "fp32+sp:2 lora"),
    ):
        loss, grads = _sharded_step(rank, policy, batch)
        results[name] = _against_unsharded(loss, grads, batch, lora="lora" in policy) if rank == 0 else None
    # (2, 1): sp:1, each rank its own rows (all labelled: the mean of the ranks' means is the whole batch's)
    rows = make_batch("llama", batch_size=2 * ROWS, seq=SEQ, seed=2)
    mine = {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in rows.items()}
    loss, grads = _sharded_step(rank, "fp32+fsdp", mine)
    results["fsdp_dp2"] = _against_unsharded(loss, grads, rows) if rank == 0 else None
    return results


def _meshes(rank, world):
    import torch.distributed as dist

    from hf_memstack.distributed.mesh import group_timeout, sequence_parallel_mesh

    default = group_timeout(dist.distributed_c10d._get_default_group(), "cpu")
    out = {"default": default}
    for n in (2, 1):
        mesh = sequence_parallel_mesh("cpu", n)
        out[n] = (
            tuple(mesh.shape),
            [group_timeout(mesh.get_group(d), "cpu") == default for d in ("dp", "sp")],
            mesh["sp"].mesh.tolist(),
        )
    return out


def _verify_rows(rank, world):
    from hf_memstack import prepare_model, verify

    out = {}
    for policy in VERIFIED:
        model = tiny_llama(attention_dropout=0.1 if "dropout" in policy else 0.0)
        batch = _packed() if "packed" in policy else _batch()
        if "BatchEncoding" in policy:  # what a tokenizer returns: a mapping that is not a dict
            from transformers import BatchEncoding

            batch = BatchEncoding(batch)
        report = verify(prepare_model(model, policy.split()[0]), batch)
        out[policy] = (report.check("sequence parallel").ok, report.ok, str(report))
    # A group whose ranks got different rows: its sharded step mixes them, and the line says so on both ranks.
    report = verify(prepare_model(tiny_llama(), "fp32+sp:2"), _batch(seed=1 + rank))
    out["different rows"] = (report.check("sequence parallel").ok, report.check("sequence parallel").detail)
    return out


def _bad_input(rank, world):
    from hf_memstack import prepare_model, verify

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    batch = _batch()
    if rank == 1:
        batch["labels"] = batch["labels"][:, :-1]  # labels of another shape than input_ids, on one rank only
    return timed(lambda: verify(model, batch))


def _trainer(rank, world, out_dir):
    from dist_utils import outcome
    from transformers import TrainingArguments

    from hf_memstack import prepare_model
    from hf_memstack.integrations.trainer_checks import check_training_arguments

    model = prepare_model(tiny_llama(), "fp32+sp:2")
    plain = TrainingArguments(output_dir=out_dir, use_cpu=True, report_to=[])
    evaluating = TrainingArguments(output_dir=out_dir, use_cpu=True, report_to=[], eval_strategy="steps", eval_steps=1)
    # The Trainer path trains sp:N (tests/distributed/test_sequence_parallel_trainer.py); what its
    # arithmetic cannot honour is refused before training.
    return [
        outcome(lambda: check_training_arguments(model, plain)),
        outcome(lambda: check_training_arguments(model, evaluating)),
    ]


def _scenarios(rank, world, out_dir):
    torch.set_num_threads(1)
    return {
        "parity": _parity(rank, world),
        "meshes": _meshes(rank, world),
        "verify": _verify_rows(rank, world),
        "bad": _bad_input(rank, world),
        "trainer": _trainer(rank, world, out_dir),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_scenarios, str(tmp_path_factory.mktemp("sp_trainer")), timeout=600)


@pytest.mark.parametrize("case", ["plain", "fsdp", "hybrid_shard", "lora_plain", "fsdp_dp2"])
def test_sharded_step_equals_the_unsharded_step(ranks, case):
    """Loss and every gradient within fp32 noise of the unsharded model's (measured: 0 and ~1e-7 relative)."""
    dloss, dgrad = ranks[0]["parity"][case]
    print(f"\n{case}: |dloss| {dloss:.2e}, max|dgrad|/max|g| {dgrad:.2e}")
    assert dloss < 1e-5
    assert dgrad < 1e-5


def test_the_sequence_mesh_is_dp_by_sp_with_contiguous_groups_and_the_job_timeout(ranks):
    for rank, result in enumerate(ranks):
        assert result["meshes"]["default"] == datetime.timedelta(seconds=60)  # dist_utils' group timeout
        assert result["meshes"][2] == ((1, 2), [True, True], [0, 1])
        assert result["meshes"][1] == ((2, 1), [True, True], [rank])


@pytest.mark.parametrize("policy", VERIFIED)
def test_verify_has_a_sequence_parallel_line_that_passes(ranks, policy):
    print(f"\n{policy}: {ranks[0]['verify'][policy][2]}")
    for result in ranks:
        line_ok, all_ok, text = result["verify"][policy]
        assert line_ok, text
        assert "[ok] sequence parallel: sp:2" in text
        assert all_ok, text


def test_verify_sequence_parallel_line_fails_when_a_group_got_different_rows(ranks):
    (ok0, detail0), (ok1, detail1) = (r["verify"]["different rows"] for r in ranks)
    assert not ok0 and not ok1
    assert detail0 == detail1  # the same numbers and verdict on every rank
    assert "got the same rows" in detail0
    # and the model-side causes the numbers cannot tell apart from it (prepare_model refuses them under sp:N)
    assert "bidirectional" in detail0 and "router loss" in detail0 and "sequence-dependent RoPE" in detail0


def test_one_ranks_bad_batch_ends_both_ranks_with_its_message(ranks):
    (kind0, msg0), seconds0 = ranks[0]["bad"]
    (kind1, msg1), seconds1 = ranks[1]["bad"]
    assert kind1 == "ValueError" and "labels" in msg1
    assert kind0 == "DistributedMismatchError"
    assert "rank(s) [1]" in msg0 and msg1 in msg0
    assert max(seconds0, seconds1) < PROMPT


def test_trainer_arguments_under_sp_are_checked_on_every_rank(ranks):
    for result in ranks:
        (plain_kind, _), (eval_kind, message) = result["trainer"]
        assert plain_kind == "ok"
        assert eval_kind == "ValueError" and "eval_strategy='steps'" in message and "without sp:2" in message
