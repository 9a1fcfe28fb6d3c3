"""The sequence-parallel policy: the token ``sp:N`` (parsed, printed, refused out of range), the
field ``sequence_parallel.size`` and its check, each way a policy is built."""

from __future__ import annotations

import pytest

from hf_memstack import MemoryPolicy, PolicyError
from hf_memstack.policy import MAX_SEQUENCE_PARALLEL, SequenceParallelConfig


def test_the_default_is_off():
    assert MemoryPolicy().sequence_parallel == SequenceParallelConfig(size=1)
    assert "sp" not in MemoryPolicy().to_string()


@pytest.mark.parametrize("n", [2, 4, MAX_SEQUENCE_PARALLEL])
def test_sp_n_parses_to_its_size_and_prints_back(n):
    policy = MemoryPolicy.from_string(f"bf16+ckpt+sp:{n}+loss:chunked")
    assert policy.sequence_parallel.size == n
    printed = policy.to_string()
    assert printed.endswith(f"+sp:{n}")
    assert MemoryPolicy.from_string(printed) == policy


@pytest.mark.parametrize(
    "bad", ["sp:1", "sp:0", f"sp:{MAX_SEQUENCE_PARALLEL + 1}", "sp:²", "sp:-2", "sp:2.0", "sp:", "sp"]
)
def test_a_bad_size_names_the_token_and_its_range(bad):
    with pytest.raises(PolicyError) as caught:
        MemoryPolicy.from_string(f"bf16+{bad}")
    message = str(caught.value)
    assert repr(bad) in message
    assert f"'sp:N' (2 <= N <= {MAX_SEQUENCE_PARALLEL})" in message


def test_two_sp_tokens_conflict():
    with pytest.raises(PolicyError, match="'sp:4' conflicts with 'sp:2'"):
        MemoryPolicy.from_string("bf16+sp:2+sp:4")


def test_kwargs_dicts_and_yaml_carry_the_size(tmp_path):
    assert MemoryPolicy(sequence_parallel=2).sequence_parallel.size == 2
    policy = MemoryPolicy(sequence_parallel={"size": 4})
    assert policy.to_dict()["sequence_parallel"] == {"size": 4}
    assert MemoryPolicy.from_dict(policy.to_dict()) == policy
    path = tmp_path / "policy.yaml"
    policy.to_yaml(path)
    assert MemoryPolicy.from_yaml(path) == policy


@pytest.mark.parametrize("size", [0, -1, MAX_SEQUENCE_PARALLEL + 1, True, 2.0, "2"])
def test_the_validator_names_field_value_range_and_fix(size):
    with pytest.raises(PolicyError) as caught:
        MemoryPolicy(sequence_parallel=SequenceParallelConfig(size=size))
    message = str(caught.value)
    assert f"policy.sequence_parallel.size={size!r}" in message
    assert f"1 (off) to {MAX_SEQUENCE_PARALLEL}" in message and "sp:N" in message


def test_a_string_for_the_field_is_refused_naming_the_spellings():
    with pytest.raises(
        PolicyError, match=r"policy.sequence_parallel='ulysses' is not a sequence-parallel setting.*'sp:2'"
    ):
        MemoryPolicy(sequence_parallel="ulysses")


def test_setting_a_bad_size_on_a_built_policy_keeps_the_old_value():
    policy = MemoryPolicy.from_string("sp:2")
    with pytest.raises(PolicyError, match="policy.sequence_parallel.size=0"):
        policy.sequence_parallel = {"size": 0}
    assert policy.sequence_parallel.size == 2
