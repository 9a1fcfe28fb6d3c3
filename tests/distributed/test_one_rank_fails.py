"""An error on one rank of an FSDP job ends every rank, promptly, with that rank's own message:
in the batch-size finder (a failing make_batch or loss_fn, a bad argument or budget), in verify
and in the memory meter (a batch without labels), and when one rank is given a forged checkpoint.
Was: the other rank waited in FSDP's next collective until the group's timeout (60 s here) and
both ended with a gloo timeout or "Connection closed by peer". Also: LOCAL_WORLD_SIZE=0 under
hybrid_shard was a bare ZeroDivisionError. One launch runs every scenario; each test checks one."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks, timed
from tiny import batches, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# The group's timeout in dist_utils is 60 s: an error shared at once ends far below it.
PROMPT = 20.0
DISK = "the dataset's disk went away"
# A batch without labels on one rank, under each policy: with loss:chunked rank 0's forward took the
# chunked path (an agreement on the token ids) and rank 1's the model's own (FSDP's all-gathers), and
# both waited out the group's timeout with no message (LoRA as in a fine-tuning run).
POLICIES = ["fp32+fsdp", "bf16+ckpt+fsdp", "bf16+ckpt+fsdp+loss:chunked"]


_make = batches("llama", seq=16)


def _model():
    return tiny_llama(vocab_size=256)  # out_of_vocabulary's id 999 lies outside it


def _lora(policy):
    from peft import LoraConfig, get_peft_model

    from hf_memstack import prepare_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return prepare_model(get_peft_model(_model(), config), policy)


class _RunsCommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoints(rank, sharded, directory):
    """Both ranks save a real checkpoint; rank 1 then loads a forged copy (a .metadata that runs a
    command, with a correct manifest), rank 0 the real one."""
    import torch.distributed as dist

    from hf_memstack.distributed.checkpoint import _write_manifest, load_sharded_checkpoint, save_sharded_checkpoint

    model, opt = sharded()
    model(**_make(2)).loss.backward()
    opt.step()
    save_sharded_checkpoint(model, opt, f"{directory}/real")
    if rank == 0:
        shutil.copytree(f"{directory}/real", f"{directory}/forged")
        Path(directory, "forged", ".metadata").write_bytes(pickle.dumps(_RunsCommand(Path(directory, "MARKER"))))
        _write_manifest(Path(directory, "forged"))
    dist.barrier()
    return timed(lambda: load_sharded_checkpoint(model, opt, f"{directory}/{['real', 'forged'][rank]}"))


def _scenarios(rank, world, directory):
    from hf_memstack import find_batch_size, measure_step, prepare_model, verify

    def sharded():
        model = prepare_model(_model(), "fp32+fsdp")  # a fresh one per case: an aborted step leaves nothing behind
        return model, torch.optim.AdamW(model.parameters())

    def find(make=_make, **kwargs):
        """The finder's call, timed (not the model's preparation)."""
        model, opt = sharded()
        kwargs = {"budget": "64MiB", "max_batch_size": 32, "cache": False, **kwargs}

        def call():
            r = find_batch_size(model, make, opt, **kwargs)
            return r.batch_size, [(p.batch_size, p.fits, p.partial) for p in r.probes]

        return timed(call)

    def make_or_fail(n):
        if rank == 1 and n >= 4:
            raise RuntimeError(DISK)
        return _make(n)

    def loss_or_fail(outputs, batch):
        if rank == 1 and batch["input_ids"].shape[0] >= 4:
            raise ValueError("rank 1's loss_fn cannot score this batch")
        return outputs.loss

    def out_of_memory_at_8(n):
        if rank == 1 and n >= 8:
            raise torch.OutOfMemoryError("rank 1 has no room for the batch")
        return _make(n)

    def unlabelled():
        batch = _make(2)
        if rank == 1:
            del batch["labels"]
        return batch

    def chunked():
        return prepare_model(_model(), "fp32+fsdp+loss:chunked")

    def out_of_vocabulary():
        batch = _make(2)
        if rank == 1:
            batch["input_ids"][0, 0] = 999  # the vocabulary holds 256 ids
        return batch

    find()  # once first: the first sharded step's one-time costs do not count as waiting
    out = {
        "make_batch": find(make_or_fail),
        "loss_fn": find(loss_fn=loss_or_fail),
        "budget": find(budget=["64MiB", "lots"][rank]),
        "argument": find(max_batch_size=[32, 0][rank]),
        "oom_in_make_batch": find(out_of_memory_at_8),
        # A smaller cap on one rank would end its search while the other probes on (was: a hang).
        "different_cap": find(max_batch_size=[32, 4][rank]),
        "different_mode": find(mode=["train", "eval"][rank]),
        "different_global_batch": find(global_batch_size=[64, 8][rank]),
    }
    from hf_memstack.distributed._ranks import share_error

    # Two ranks at different steps, carrying different numbers of values (was: gloo aborted the process).
    out["different_steps"] = timed(lambda: share_error(["step a", "step b"][rank], None, values=[(1, 2), ()][rank]))

    def empty():
        batch = _make(2)
        return {k: v[:0] for k, v in batch.items()} if rank == 1 else batch

    def prepared(policy):
        return sharded() if policy == "fp32+fsdp" else (_lora(policy), None)

    def verify_unlabelled(model, opt):
        return timed(lambda: verify(model, unlabelled()).ok)

    def measure_unlabelled(model, opt):
        return timed(lambda: measure_step(model, unlabelled(), opt, timed=False).peak_bytes)

    for policy in POLICIES:
        out[f"verify {policy}"] = verify_unlabelled(*prepared(policy))
        out[f"measure {policy}"] = measure_unlabelled(*prepared(policy))
    model, opt = sharded()
    out["verify_empty"] = timed(lambda: verify(model, empty()).ok)
    model, opt = sharded()
    out["verify_ok"] = timed(lambda: verify(model, _make(2)).ok)  # every rank well: no error, the same verdict
    model, opt = sharded()
    # Each rank valid alone, but the ranks disagree: rank 0 steps an optimizer, rank 1 does not (was: a hang).
    out["measure_optimizer_on_one_rank"] = timed(
        lambda: measure_step(model, _make(2), opt if rank == 0 else None, timed=False).peak_bytes
    )
    out["vocab_verify"] = timed(lambda: verify(chunked(), out_of_vocabulary()).ok)
    out["vocab_measure"] = timed(lambda: measure_step(chunked(), out_of_vocabulary(), None, timed=False).peak_bytes)
    out["checkpoint"] = _checkpoints(rank, sharded, directory)
    os.environ["LOCAL_WORLD_SIZE"] = "0"
    out["local_world_size"] = timed(lambda: prepare_model(_model(), "fp32+fsdp:hybrid_shard"))
    os.environ["LOCAL_WORLD_SIZE"] = ["1", "2"][
        rank
    ]  # each a divisor of the world size: only their difference is wrong
    out["local_world_size_differs"] = timed(lambda: prepare_model(_model(), "fp32+fsdp:hybrid_shard"))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    results = run_ranks(_scenarios, str(directory), world=2, timeout=300)
    return [{**r, "marker": (directory / "MARKER").exists()} for r in results]


def _both(ranks, case):
    (r0, t0), (r1, t1) = ranks[0][case], ranks[1][case]
    assert t0 < PROMPT and t1 < PROMPT, (case, t0, t1)
    return r0, r1


def test_make_batch_failing_on_one_rank_ends_every_rank(ranks):
    (kind0, msg0), (kind1, msg1) = _both(ranks, "make_batch")
    assert (kind1, msg1) == ("RuntimeError", DISK)
    assert kind0 == "DistributedMismatchError" and f"rank 1: RuntimeError: {DISK}" in msg0


def test_loss_fn_failing_on_one_rank_ends_every_rank_before_the_backward(ranks):
    (kind0, msg0), (kind1, msg1) = _both(ranks, "loss_fn")
    assert kind1 == "ValueError" and "rank 1's loss_fn cannot score this batch" in msg1
    assert (
        kind0 == "DistributedMismatchError" and "rank 1: ValueError: rank 1's loss_fn cannot score this batch" in msg0
    )


def test_a_bad_budget_or_argument_on_one_rank_ends_every_rank(ranks):
    (kind0, msg0), (kind1, msg1) = _both(ranks, "budget")
    assert kind1 == "ValueError" and "budget='lots'" in msg1
    assert kind0 == "DistributedMismatchError" and "rank 1: ValueError:" in msg0 and "budget='lots'" in msg0
    (kind0, msg0), (kind1, msg1) = _both(ranks, "argument")
    assert kind1 == "ValueError" and "max_batch_size=0" in msg1
    assert kind0 == "DistributedMismatchError" and "max_batch_size=0" in msg0


def test_out_of_memory_on_one_rank_is_an_outcome_on_every_rank(ranks):
    # Rank 1 cannot build a batch of 8 or more (the 64 MiB budget holds 32 on both): both ranks
    # see exactly those probes as out of memory, run the same probes and agree on a size below 8.
    ((kind0, (size0, probes0)), (kind1, (size1, probes1))) = _both(ranks, "oom_in_make_batch")
    assert kind0 == kind1 == "ok" and size0 == size1 and probes0 == probes1
    assert all((not fits and partial) == (n >= 8) for n, fits, partial in probes0) and any(
        n >= 8 for n, _, _ in probes0
    )
    assert size0 == max(n for n, fits, _ in probes0 if fits) < 8


@pytest.mark.parametrize("policy", POLICIES)
def test_verify_without_labels_on_one_rank_ends_every_rank(ranks, policy):
    (kind0, msg0), (kind1, msg1) = _both(ranks, f"verify {policy}")
    assert kind1 == "ValueError" and "returned no loss" in msg1
    assert kind0 == "DistributedMismatchError" and "rank 1: ValueError:" in msg0 and "returned no loss" in msg0


def test_verify_on_every_rank_well_gives_the_same_verdict(ranks):
    assert _both(ranks, "verify_ok") == (("ok", True), ("ok", True))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_meter_without_labels_on_one_rank_ends_every_rank(ranks, policy):
    (kind0, msg0), (kind1, msg1) = _both(ranks, f"measure {policy}")
    assert kind1 == "ValueError" and "returned no loss" in msg1
    assert kind0 == "DistributedMismatchError" and "rank 1: ValueError:" in msg0 and "returned no loss" in msg0


def test_an_empty_batch_on_one_rank_ends_every_rank_in_verify(ranks):
    """Refused before any collective and agreed there (was: rank 1 refused it after the agreement on the
    model, and went to share that while rank 0 went on into the forward's all-gather)."""
    (kind0, msg0), (kind1, msg1) = _both(ranks, "verify_empty")
    assert kind1 == "ValueError" and "batch['input_ids'] has shape (0, 16)" in msg1, msg1
    assert kind0 == "DistributedMismatchError" and "rank 1: ValueError: verify: batch['input_ids'] has shape" in msg0, (
        msg0
    )


def test_a_forged_checkpoint_on_one_rank_runs_no_code_and_ends_every_rank(ranks):
    (kind0, msg0), (kind1, msg1) = _both(ranks, "checkpoint")
    assert not ranks[0]["marker"]
    assert kind1 == "UntrustedCheckpointError" and "names the global posix.system" in msg1 and "trusted=True" in msg1
    assert (
        kind0 == "DistributedMismatchError" and "rank 1: UntrustedCheckpointError:" in msg0 and "posix.system" in msg0
    )


def test_local_world_size_zero_under_hybrid_shard_is_a_clear_error(ranks):
    for kind, message in _both(ranks, "local_world_size"):
        assert kind == "ValueError", message
        assert "LOCAL_WORLD_SIZE='0'" in message and "positive whole number" in message and "unset it" in message


def test_different_search_arguments_on_the_ranks_end_every_rank(ranks):
    for case, field in (
        ("different_cap", "max_batch_size=4 where rank 0 has 32"),
        ("different_mode", "mode='eval' where rank 0 has 'train'"),
        ("different_global_batch", "global_batch_size=8 where rank 0 has 64"),
    ):
        for kind, message in _both(ranks, case):
            assert kind == "DistributedMismatchError" and f"rank 1: {field}" in message, (case, message)
    for kind, message in _both(ranks, "different_steps"):
        assert (
            kind == "DistributedMismatchError" and "rank 0 at 'step a'" in message and "rank 1 at 'step b'" in message
        )


def test_ids_outside_the_vocabulary_on_one_rank_end_every_rank_with_that_message(ranks):
    """verify and measure_step refuse such ids before the forward (as loss:chunked does in it); under
    FSDP the refusal is shared first (was: the other rank waited in the backbone's all-gather, and
    rank 1's message was lost)."""
    for case, where in (("vocab_verify", "verify"), ("vocab_measure", "measure_step")):
        (kind0, msg0), (kind1, msg1) = _both(ranks, case)
        assert kind1 == "ValueError" and "input_ids holds id 999" in msg1 and "256 ids" in msg1, (case, msg1)
        assert kind0 == "DistributedMismatchError" and f"rank 1: ValueError: {where}: input_ids holds id 999" in msg0, (
            case,
            msg0,
        )


def test_the_meter_given_an_optimizer_on_one_rank_only_ends_every_rank(ranks):
    for kind, message in _both(ranks, "measure_optimizer_on_one_rank"):
        assert kind == "DistributedMismatchError" and "rank 1: optimizer=False where rank 0 has True" in message, (
            message
        )


def test_different_local_world_sizes_under_hybrid_shard_end_every_rank(ranks):
    for kind, message in _both(ranks, "local_world_size_differs"):
        assert kind == "DistributedMismatchError", message
        assert "rank 0: LOCAL_WORLD_SIZE='1'; rank 1: LOCAL_WORLD_SIZE='2'" in message, message
