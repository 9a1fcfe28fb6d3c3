"""The policy string's one table (hf_memstack/policy/tokens.py): the token list of docs/policies.md is
the table's, every token parses to its row's fragment and prints back as itself (or as its canonical
spelling), and each group's error names that group's spellings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_memstack import MemoryPolicy, PolicyError
from hf_memstack.policy import MAX_EVERY_N
from hf_memstack.policy.config import SUBCONFIGS, MasterWeights
from hf_memstack.policy.tokens import TOKENS, listed_spellings

POLICIES = Path(__file__).resolve().parents[3] / "docs" / "policies.md"


def _readme_tokens() -> set[str]:
    text = POLICIES.read_text()
    start = text.index("String tokens, joined with `+` in any order:")
    paragraph = text[start : text.index("`auto` precision picks", start)]
    return set(re.findall(r"`([a-z0-9_:N]+)`", paragraph)) - {"+"}


def test_from_strings_docstring_names_every_token_of_the_table():
    named = set(re.findall(r"``([a-z0-9_:N]+)``", MemoryPolicy.from_string.__doc__))
    assert set(listed_spellings()) <= named, set(listed_spellings()) - named


def test_the_docs_token_list_is_the_table():
    precisions = {"fp32", "bf16", "fp16", "auto"}
    assert _readme_tokens() == precisions | set(listed_spellings())


@pytest.mark.parametrize("token", [t for t in TOKENS], ids=lambda t: t.spelling)
def test_every_token_sets_its_fragment_and_prints_back(token):
    spelling = token.spelling.replace(":N", ":3") if token.number else token.spelling
    policy = MemoryPolicy.from_string(f"bf16+{spelling}")
    value = getattr(policy, token.field)
    fragment = token.number("3") if token.number else token.fragment
    if isinstance(fragment, dict):
        assert {k: getattr(value, k) for k in fragment} == fragment
        # Everything else of the sub-config stays at its default.
        default = SUBCONFIGS[token.field]()
        assert all(getattr(value, f) == getattr(default, f) for f in default.__slots__ if f not in fragment)
    else:
        assert value == fragment
    printed = policy.to_string()
    assert MemoryPolicy.from_string(printed) == policy
    if token.canonical:
        assert printed == ("bf16" if token.field == "master_weights" and fragment == "fp32" else f"bf16+{spelling}")


def test_two_optimizer_tokens_go_together_and_others_conflict():
    both = MemoryPolicy.from_string("bf16+optim:in_backward+optim:8bit")
    assert (both.optimizer.state, both.optimizer.step) == ("8bit", "in_backward")
    assert both.to_string() == "bf16+optim:8bit+optim:in_backward"
    for pair in ("ckpt+ckpt:offload", "optim:8bit+optim:8bit", "weights:bf16+weights:fp32", "fsdp+fsdp:offload"):
        first, second = pair.split("+")
        with pytest.raises(PolicyError, match=rf"'{second}' conflicts with '{first}'"):
            MemoryPolicy.from_string(f"bf16+{pair}")


@pytest.mark.parametrize("group", sorted({t.spelling.partition(":")[0] for t in TOKENS}))
def test_a_bad_argument_names_its_groups_spellings(group):
    with pytest.raises(PolicyError) as caught:
        MemoryPolicy.from_string(f"bf16+{group}:nonsense")
    message = str(caught.value)
    named = re.findall(r"'([a-z0-9_:N]+)'", message.split("is not one of", 1)[1])
    assert named == listed_spellings(group)


def test_an_unknown_token_lists_every_spelling_and_the_numbered_one_its_range():
    with pytest.raises(PolicyError, match="unknown token 'warp'") as caught:
        MemoryPolicy.from_string("bf16+warp")
    message = str(caught.value)
    assert all(f"'{s}'" in message for s in listed_spellings())
    assert f"'ckpt:N' (2 <= N <= {MAX_EVERY_N})" in message
    for bad in ("ckpt:1000001", "ckpt:0", "ckpt:²"):
        with pytest.raises(PolicyError, match=rf"'{bad}' is not one of 'ckpt'"):
            MemoryPolicy.from_string(bad)


def test_the_master_weights_tokens_are_the_fields_values():
    from typing import get_args

    assert {t.fragment for t in TOKENS if t.field == "master_weights"} == set(get_args(MasterWeights))


def test_options_without_a_token_are_left_out_of_the_string():
    policy = MemoryPolicy(
        precision="bf16",
        fsdp={"mode": "shard_grad_op", "cpu_offload": True},
        compile={"mode": "none", "backend": "aot_eager"},
        loss={"mode": "chunked", "chunk_tokens": 256},
    )
    assert policy.to_string() == "bf16+fsdp:shard_grad_op+loss:chunked"


def test_a_preset_whose_name_is_a_token_is_refused_beside_tokens_without_a_precision():
    # Issue 39: 'fsdp' alone is the preset bf16+ckpt+fsdp; 'fsdp+loss:chunked' parsed to fp32
    # without checkpointing. Every preset whose name is not its own token string is checked.
    from hf_memstack.policy import LADDER

    named = {name: expansion for name, expansion in LADDER.items() if name != expansion}
    assert named  # fsdp
    for name, expansion in named.items():
        assert MemoryPolicy.from_string(name) == MemoryPolicy.from_string(expansion)
        for addition, preset_reading in (
            ("loss:chunked", f"{expansion}+loss:chunked"),
            ("ckpt", expansion),
            ("ckpt:2", expansion.replace("ckpt", "ckpt:2")),
            ("optim:8bit+optim:in_backward", f"{expansion}+optim:8bit+optim:in_backward"),
        ):
            spec = f"{name}+{addition}"
            with pytest.raises(PolicyError) as caught:
                MemoryPolicy.from_string(spec)
            message = str(caught.value)
            assert f"{name!r} alone is the preset {expansion!r}" in message, message
            # Both readings are named, each a string that parses to what it says.
            assert f"Write {preset_reading!r} for the preset" in message, message
            assert f"or 'fp32+{spec}' for the tokens as written" in message, message
            assert MemoryPolicy.from_string(preset_reading).precision == "bf16"
            assert MemoryPolicy.from_string(f"fp32+{spec}").precision == "fp32"
            # The same words after the preset's other name order: refused too.
            with pytest.raises(PolicyError, match="alone is the preset"):
                MemoryPolicy.from_string(f"{addition}+{name.upper()}")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("bf16+fsdp", "bf16+fsdp:full_shard"),
        ("fsdp+fp32", "fp32+fsdp:full_shard"),
        ("fp16+ckpt+fsdp", "fp16+ckpt+fsdp:full_shard"),
    ],
)
def test_a_string_naming_its_precision_reads_fsdp_as_the_token(spec, expected):
    # As the planner and the docs write them: FSDP only, with the precision and checkpointing named.
    assert MemoryPolicy.from_string(spec).to_string() == expected


def test_a_conflict_beside_the_preset_name_is_said_once_as_a_conflict():
    with pytest.raises(PolicyError) as caught:
        MemoryPolicy.from_string("fsdp+fsdp:offload")
    assert caught.value.problems == [caught.value.problems[0]] and "conflicts with 'fsdp'" in str(caught.value)
