"""estimate_memory under sequence parallelism (sp:N): one rank traced at ceil(S/N) tokens through the real
Ulysses attention on fake exchanges - the model states as without it (or sharded over every rank under
FSDP), the activations between one rank's tokens without the exchange and the whole rows; the fields
that say where sp is; the process's own sequence-parallel group left as it was; and the refusals, with
the fix. The readings against the meter on each of 2 ranks: tests/distributed/test_sp_estimate.py."""

import pytest
from transformers import LlamaConfig

from hf_memstack import estimate_memory

B, FP32 = 2, 4


def _config(heads=4, kv=2, layers=2):
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=128,
        max_position_embeddings=1024,
    )


def _exchange(n, s, heads, kv, d, r):
    """One block's all-to-all, from the shape: the caller's local q/k/v (and the repeated k/v when
    r > 1), a send copy and a receive buffer of q, and the gathered position ids and their copy."""
    held = heads + 2 * kv + (2 * kv * r if r > 1 else 0)
    return B * s * d * (held + 2 * heads) * FP32 + 2 * n * B * s * 8


MODEL_STATES = ("parameters", "gradients", "optimizer", "trainable_parameters", "total_parameters")


@pytest.mark.parametrize("seq", [64, 63])
def test_one_sp_rank_holds_its_tokens_and_the_exchange(seq):
    cfg = _config()
    half = estimate_memory(cfg, "fp32", batch_size=B, seq_len=32, device="cpu")  # ceil(63 / 2) = 32: tail padded
    sp = estimate_memory(cfg, "fp32+sp:2", batch_size=B, seq_len=seq, device="cpu")
    whole = estimate_memory(cfg, "fp32", batch_size=B, seq_len=seq, device="cpu")
    assert (sp.sequence_parallel, sp.sp_tokens_per_rank, sp.seq_len, sp.world_size) == (2, 32, seq, 2)
    assert sp.sp_all_to_all_bytes == _exchange(2, 32, heads=4, kv=2, d=16, r=1) and sp.sp_kv_repeat_bytes == 0
    for k in MODEL_STATES:
        assert getattr(sp, k) == getattr(half, k), k
    # The exchange's buffers on top of one rank's tokens; less than the whole rows on one device.
    assert half.peak_bytes < sp.peak_bytes < whole.peak_bytes
    assert half.activations <= sp.activations < whole.activations
    assert "sp:2" in sp.summary() and "32 tokens per rank" in sp.summary()
    assert any(n.startswith("sp:2: one rank of 2, traced at its 32 of the") for n in sp.notes)
    # The traces without sp are not touched by one with it (the attention is switched on a copy).
    assert estimate_memory(cfg, "fp32", batch_size=B, seq_len=32, device="cpu") == half


@pytest.mark.parametrize(("policy", "saved_blocks"), [("fp32", 2), ("fp32+ckpt", 0)])
def test_fewer_kv_heads_than_ranks_report_the_repeated_keys_and_values(policy, saved_blocks):
    sp = estimate_memory(_config(heads=4, kv=1), f"{policy}+sp:2", batch_size=B, seq_len=64, device="cpu")
    repeated = 2 * B * 32 * 16 * 1 * (2 - 1) * FP32  # k and v, one more copy each, per block
    assert sp.sp_kv_repeat_bytes == repeated * saved_blocks  # kept by every block not checkpointed
    assert sp.sp_all_to_all_bytes == _exchange(2, 32, heads=4, kv=1, d=16, r=2)
    assert any("k/v x2 (kv heads repeated)" in n for n in sp.notes)


def test_sp_with_fsdp_shards_the_model_states_over_every_rank():
    cfg = _config()
    sp = estimate_memory(cfg, "fp32+fsdp+sp:2", batch_size=B, seq_len=64, world_size=4, device="cpu")
    half = estimate_memory(cfg, "fp32+fsdp", batch_size=B, seq_len=32, world_size=4, device="cpu")
    for k in MODEL_STATES:
        assert getattr(sp, k) == getattr(half, k), k
    assert sp.peak_bytes > half.peak_bytes and sp.world_size == 4


def test_the_processs_own_sequence_parallel_group_is_left_as_it_was():
    from hf_memstack.transforms.sequence_parallel import active_group, register_group, set_active_group

    mine = register_group(None, size=4)  # stands for the group a real sp:4 run set in this process
    set_active_group(mine)
    estimate_memory(_config(), "fp32+sp:2", batch_size=B, seq_len=64, device="cpu")
    assert active_group() is mine


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"policy": "fp32+sp:3"}, ("sp:3", "num_attention_heads", "4", "sp:2")),  # H % N
        ({"policy": "fp32+sp:2", "world_size": 3}, ("world_size=3", "groups of 2", "sp:3")),
        ({"policy": "fp32+sp:4", "world_size": 2}, ("world_size=2", "groups of 4", "sp:2")),  # N > world size
        ({"policy": "fp32+sp:2", "mode": "eval"}, ("mode='eval'", "unsharded", "without sp:2")),
        ({"policy": "fp32+sp:2", "task": "classification"}, ("task='classification'", "drop sp:N")),
    ],
)
def test_what_sp_cannot_shard_is_refused_with_the_fix(kwargs, words):
    with pytest.raises(ValueError) as err:
        estimate_memory(_config(), batch_size=B, seq_len=64, device="cpu", **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_sp_1_is_no_token():
    with pytest.raises(ValueError, match="sp:"):
        estimate_memory(_config(), "fp32+sp:1", batch_size=B, seq_len=64, device="cpu")


def test_the_cli_estimates_an_sp_policy_per_rank(tmp_path, capsys):
    from hf_memstack.cli.main import main

    _config().save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--policy", "fp32,fp32+sp:2", "--batch-size", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "| fp32+sp:2 |" in out and "note: sp:2: one rank of 2, traced at its 32 of the 64 tokens" in out
    assert main(["estimate", str(tmp_path), "--policy", "fp32+sp:3", "--batch-size", "2", "--seq-len", "64"]) != 0
    assert "num_attention_heads" in capsys.readouterr().err
