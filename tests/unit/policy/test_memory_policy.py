import pytest

from hf_memstack import LADDER, MemoryPolicy, PolicyError, prepare_model
from hf_memstack.policy import CheckpointingConfig, CompileConfig, FSDPConfig


def test_defaults_are_eager_fp32():
    p = MemoryPolicy()
    assert (p.precision, p.checkpointing.mode, p.compile.mode, p.fsdp.mode) == ("fp32", "none", "none", "none")


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("bf16+compile+ckpt", ("bf16", "full", "full", "none")),
        ("ckpt+compile+bf16", ("bf16", "full", "full", "none")),  # order does not matter
        ("fp32+ckpt", ("fp32", "full", "none", "none")),
        ("fp16+compile", ("fp16", "none", "full", "none")),
        ("bf16+ckpt+fsdp", ("bf16", "full", "none", "full_shard")),
        ("bf16+compile:regional+ckpt:3", ("bf16", "every_n", "regional", "none")),
        ("ckpt:offload", ("fp32", "offload", "none", "none")),
        ("auto", ("auto", "none", "none", "none")),
        (" BF16 + CKPT ", ("bf16", "full", "none", "none")),
    ],
)
def test_from_string(spec, expected):
    p = MemoryPolicy.from_string(spec)
    assert (p.precision, p.checkpointing.mode, p.compile.mode, p.fsdp.mode) == expected


def test_every_n_and_fsdp_options_from_string():
    assert MemoryPolicy.from_string("ckpt:3").checkpointing.every_n == 3
    off = MemoryPolicy.from_string("bf16+fsdp:offload").fsdp
    assert (off.mode, off.cpu_offload) == ("full_shard", True)
    assert MemoryPolicy.from_string("fsdp:shard_grad_op").fsdp.mode == "shard_grad_op"


def test_ladder_presets_parse_and_climb():
    modes = [MemoryPolicy.coerce(name) for name in LADDER]
    assert [m.precision for m in modes] == ["fp32", "bf16", "bf16", "bf16", "bf16"]
    assert modes[2].compile.mode == "full" and modes[3].checkpointing.mode == "full"
    assert modes[4].fsdp.mode == "full_shard"


def test_kwargs_accept_mode_strings_and_dicts():
    p = MemoryPolicy(
        precision="bf16", checkpointing="full", compile={"mode": "regional", "backend": "aot_eager"}, fsdp=FSDPConfig()
    )
    assert isinstance(p.checkpointing, CheckpointingConfig) and p.checkpointing.mode == "full"
    assert isinstance(p.compile, CompileConfig) and p.compile.backend == "aot_eager"


@pytest.mark.parametrize(
    "spec",
    ["fp32", "bf16+ckpt:4", "fp16+compile:regional+ckpt:offload", "bf16+ckpt+fsdp:hybrid_shard", "bf16+fsdp:offload"],
)
def test_string_round_trip(spec):
    p = MemoryPolicy.from_string(spec)
    assert MemoryPolicy.from_string(p.to_string()) == p


def test_dict_and_yaml_round_trip(tmp_path):
    p = MemoryPolicy(
        precision="bf16",
        checkpointing=CheckpointingConfig(mode="every_n", every_n=3, block_classes=("LlamaDecoderLayer",)),
        compile=CompileConfig(mode="regional", inductor_mode="max-autotune-no-cudagraphs"),
    )
    assert MemoryPolicy.from_dict(p.to_dict()) == p
    path = tmp_path / "policy.yaml"
    p.to_yaml(path)
    assert MemoryPolicy.from_yaml(path) == p
    assert MemoryPolicy.coerce(str(path)) == p
    (tmp_path / "wrapped.yaml").write_text("policy: bf16+ckpt\n")
    assert MemoryPolicy.from_yaml(tmp_path / "wrapped.yaml") == MemoryPolicy.from_string("bf16+ckpt")


def test_unknown_preset_names_token_and_allowed():
    with pytest.raises(PolicyError) as e:
        MemoryPolicy.coerce("bf16+turbo")
    msg = str(e.value)
    assert "'turbo'" in msg and "ckpt" in msg and "compile" in msg and "bf16+compile+ckpt" in msg


def test_conflicting_tokens_are_reported():
    with pytest.raises(PolicyError, match="'fp16' conflicts with 'bf16'"):
        MemoryPolicy.from_string("bf16+fp16")


def test_all_problems_reported_at_once():
    with pytest.raises(PolicyError) as e:
        MemoryPolicy(
            precision="fp8",
            checkpointing={"mode": "sometimes"},
            compile={"mode": "turbo", "backend": "aot_eager", "inductor_mode": "max-autotune"},
            fsdp={"mode": "zero3"},
        )
    problems = e.value.problems
    assert len(problems) == 5
    joined = "\n".join(problems)
    for field, value in [
        ("policy.precision", "'fp8'"),
        ("policy.checkpointing.mode", "'sometimes'"),
        ("policy.compile.mode", "'turbo'"),
        ("policy.compile.inductor_mode", "'max-autotune'"),
        ("policy.fsdp.mode", "'zero3'"),
    ]:
        assert f"{field}={value}" in joined
    assert "'fp32', 'bf16', 'fp16', 'auto'" in joined  # the allowed values are listed


def test_unknown_fields():
    with pytest.raises(
        PolicyError,
        match=r"policy.speed is not a policy field; allowed fields: precision, checkpointing, compile, fsdp",
    ):
        MemoryPolicy.from_dict({"precision": "bf16", "speed": "max"})
    with pytest.raises(PolicyError, match=r"policy.checkpointing.layers is not a field of CheckpointingConfig"):
        MemoryPolicy(checkpointing={"mode": "full", "layers": 2})


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            {"checkpointing": CheckpointingConfig(mode="every_n", every_n=1)},
            "policy.checkpointing.every_n=1 must be an integer >= 2",
        ),
        ({"fsdp": FSDPConfig(cpu_offload=True)}, "but policy.fsdp.mode='none'"),
        (
            {"fsdp": "full_shard", "checkpointing": "offload"},
            "checkpointing.mode='offload' with policy.fsdp.mode='full_shard'",
        ),
        (
            {"checkpointing": CheckpointingConfig(mode="full", block_classes=())},
            "policy.checkpointing.block_classes=()",
        ),
        (
            {"compile": CompileConfig(mode="full", fullgraph="yes")},
            "policy.compile.fullgraph='yes' must be True or False",
        ),
    ],
)
def test_conflicting_or_bad_fields(kwargs, fragment):
    with pytest.raises(PolicyError) as e:
        MemoryPolicy(**kwargs)
    assert fragment in str(e.value)


def test_validate_catches_mutation_after_construction():
    p = MemoryPolicy.from_string("bf16+ckpt")
    p.checkpointing.mode = "partial"
    with pytest.raises(PolicyError, match="policy.checkpointing.mode='partial'"):
        p.validate()
    # Nor is it printed or saved as if it were a policy (describe prints to_string).
    for use in (p.to_string, p.to_dict, p.to_yaml):
        with pytest.raises(PolicyError, match="policy.checkpointing.mode='partial'"):
            use()


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("precision", "nonsense", "policy.precision='nonsense' is not one of"),
        ("checkpointing", 3, "policy.checkpointing=3 has type int"),
        ("checkpointing", "offload", "checkpointing.mode='offload' with policy.fsdp.mode='full_shard'"),
        ("optimizer", "in_backward", "optimizer.step='in_backward' with policy.precision='fp16'"),
    ],
)
def test_setting_a_field_of_a_built_policy_validates_it_and_keeps_the_old_value(field, value, fragment):
    """policy.precision = "nonsense" after construction used to be kept, and printed by to_string."""
    p = MemoryPolicy.from_string("fp16+ckpt+fsdp")
    before = p.to_dict()
    with pytest.raises(PolicyError) as e:
        setattr(p, field, value)
    assert fragment in str(e.value), str(e.value)
    assert p.to_dict() == before and p.to_string() == "fp16+ckpt+fsdp:full_shard"


def test_setting_a_valid_field_coerces_it_as_the_constructor_does(load_model):
    p = MemoryPolicy.from_string("bf16")
    p.checkpointing = "full"
    p.precision = "fp32"
    assert p == MemoryPolicy.from_string("fp32+ckpt") and p.to_string() == "fp32+ckpt"
    assert prepare_model(load_model("llama"), p).memstack.policy == p


def test_every_n_is_refused_where_it_would_be_ignored_but_the_default_is_kept(tmp_path):
    """every_n=3 with mode 'selective' used to be accepted and ignored; to_dict writes every_n=2 for every
    mode (the default cannot be told from an explicit 2), so a saved policy still loads."""
    for spec in ("bf16", "bf16+ckpt", "bf16+ckpt:selective", "bf16+ckpt:offload", "bf16+ckpt:7"):
        p = MemoryPolicy.from_string(spec)
        p.to_yaml(tmp_path / "policy.yaml")
        assert MemoryPolicy.from_dict(p.to_dict()) == p == MemoryPolicy.from_yaml(tmp_path / "policy.yaml")
    assert MemoryPolicy(checkpointing={"mode": "full", "every_n": 2}) == MemoryPolicy.from_string("ckpt")
    with pytest.raises(PolicyError, match="every_n=3 only applies to mode='every_n'"):
        MemoryPolicy(checkpointing={"mode": "full", "every_n": 3})


def test_wrong_types():
    with pytest.raises(TypeError, match="pass a MemoryPolicy, a string"):
        MemoryPolicy.coerce(42)
    with pytest.raises(PolicyError, match="policy.compile=3 has type int"):
        MemoryPolicy(compile=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MemoryPolicy.coerce("missing-policy.yaml")


@pytest.mark.parametrize("kind", ["FIFO", "directory", "link to /dev/zero", "nested 100,000 deep"])
def test_a_policy_file_that_cannot_be_read_is_named_for_what_it_is(tmp_path, kind):
    """Was "does not exist" for a FIFO, a directory or a link to /dev/zero standing at the path, and a
    RecursionError (exit 3 from hf-memstack) for YAML nested 100,000 deep. A FIFO is never waited on."""
    import os
    import threading

    path = tmp_path / "policy.yaml"
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind.startswith("link"):
        path.symlink_to("/dev/zero")
    else:
        path.write_text("[" * 100_000)
    raised = []
    reader = threading.Thread(target=lambda: raised.append(_error_of(MemoryPolicy.coerce, str(path))), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader gets end-of-file
        pytest.fail("reading a FIFO policy file blocked")
    what = {
        "FIFO": "is a FIFO (named pipe), not a regular file",
        "directory": "is a directory, not a regular file",
        "link to /dev/zero": "is a character device, not a regular file",
    }.get(kind, "is nested too deeply to read")
    assert isinstance(raised[0], PolicyError) and f"policy file {str(path)!r}" in str(raised[0]), repr(raised[0])
    assert what in str(raised[0]) and "does not exist" not in str(raised[0]), str(raised[0])


def _error_of(call, *args):
    try:
        call(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the test
        return e
    return None
