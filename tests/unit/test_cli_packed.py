"""``hf-memstack estimate|plan --packed``: rows packed with several samples each (estimate_memory's and
plan_policy's ``packed=True``), which the docs' sequence-parallel page says the planner offers sp:N for."""

import json

import pytest
from transformers import LlamaConfig

from hf_memstack import estimate_memory
from hf_memstack.cli.main import main

SEQ = 256
BATCH = 2


@pytest.fixture
def llama_dir(tmp_path):
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=4096,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def _estimate(d, policy, packed, seq_len=SEQ, batch_size=BATCH):
    return estimate_memory(d, policy, batch_size=batch_size, seq_len=seq_len, world_size=2, packed=packed, device="cpu")


def test_estimate_packed_traces_packed_rows(llama_dir, capsys):
    argv = ["estimate", llama_dir, "--policy", "fp32,fp32+sp:2", "--batch-size", str(BATCH), "--seq-len", str(SEQ)]
    rows = {}
    for flag in ([], ["--packed"]):
        assert main([*argv, "--world-size", "2", "--device", "cpu", "--json", *flag]) == 0
        rows[bool(flag)] = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["estimates"]}
    for packed, by_policy in rows.items():
        for policy, row in by_policy.items():
            assert row["peak_bytes"] == _estimate(llama_dir, policy, packed).peak_bytes, (packed, policy)
    # One device's packed rows hold what unpacked ones do not (the samples' attention): the flag reaches it.
    assert rows[True]["fp32"]["peak_bytes"] != rows[False]["fp32"]["peak_bytes"]
    assert any("packed rows traced as" in n for n in rows[True]["fp32+sp:2"]["notes"])
    assert not any("packed rows traced as" in n for n in rows[False]["fp32+sp:2"]["notes"])


def test_plan_packed_plans_sequence_parallel_for_packed_rows(llama_dir, capsys):
    seq = 2048
    argv = ["plan", llama_dir, "--seq-len", str(seq), "--world-size", "2", "--device", "cpu", "--margin", "0"]
    assert main([*argv, "--budget", "1KiB", "--packed", "--json"]) == 1  # nothing fits: every rung listed
    policies = [r["policy"] for r in json.loads(capsys.readouterr().out)["rows"]]
    sp_row = next(p for p in policies if "+sp:2" in p)
    heaviest = policies[policies.index(sp_row) - 1]
    one, two = (_estimate(llama_dir, p, True, seq, 1).peak_bytes for p in (heaviest, sp_row))
    plans = {}
    for flag in ([], ["--packed"]):
        assert main([*argv, "--budget", str((one + two) // 2), "--json", *flag]) == 0
        plans[bool(flag)] = json.loads(capsys.readouterr().out)
    chosen = plans[True]
    assert "+sp:2" in chosen["policy"], chosen["policy"]
    assert chosen["estimate"]["peak_bytes"] == _estimate(llama_dir, chosen["policy"], True, seq, 1).peak_bytes
    assert any("packed rows traced as" in n for n in chosen["estimate"]["notes"])
    assert not any("packed rows traced as" in n for n in plans[False]["estimate"]["notes"])


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_help_lists_packed(command, capsys):
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--packed" in out and "DataCollatorWithFlattening" in out
