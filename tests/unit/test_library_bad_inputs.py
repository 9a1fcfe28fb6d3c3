"""Bad input, area by area: each case must raise its documented exception type with a message
that names the field and the value (and what is allowed, or the fix), and must leave the user's
model untouched. Each case is one test id, ``<area>-<what>``; the finder, its cache, the recipe
and the 2-rank FSDP pre-flight have their own tables beside their tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import VOCAB, PlainStack, assert_untouched, make_batch, snapshot, tiny_llama
from torch import nn

from hf_memstack import (
    BudgetTooSmallError,
    MemoryPolicy,
    PolicyError,
    estimate_memory,
    measure_step,
    merge_adapters,
    parse_bytes,
    plan_policy,
    prepare_model,
    verify,
)
from hf_memstack.cli.main import main as cli


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Any], Any]
    """``call(ctx)``; ``ctx`` gives ``load``, ``dirs`` and ``tmp``."""
    error: type[BaseException]
    fragments: tuple[str, ...]
    """Every fragment must appear in the message (the field, the value, the allowed values or fix)."""


def C(id: str, call: Callable[[Any], Any], error: type[BaseException], *fragments: str) -> Any:
    return pytest.param(Case(id, call, error, fragments), id=id)


def _yaml(ctx: Any, text: bytes) -> str:
    path = ctx.tmp / "policy.yaml"
    path.write_bytes(text)
    return str(path)


P = MemoryPolicy
POLICY = [
    C("policy-precision", lambda c: P(precision="fp8"), PolicyError, "policy.precision='fp8'", "'bf16'"),
    C("policy-precision-none", lambda c: P(precision=None), PolicyError, "policy.precision=None", "'fp32'"),
    C(
        "policy-ckpt-mode",
        lambda c: P(checkpointing="partial"),
        PolicyError,
        "policy.checkpointing.mode='partial'",
        "'every_n'",
    ),
    C(
        "policy-every-n-0",
        lambda c: P(checkpointing={"mode": "every_n", "every_n": 0}),
        PolicyError,
        "every_n=0",
        ">= 2",
    ),
    C(
        "policy-every-n-1",
        lambda c: P(checkpointing={"mode": "every_n", "every_n": 1}),
        PolicyError,
        "every_n=1",
        "mode='full'",
    ),
    C("policy-every-n-negative", lambda c: P(checkpointing={"every_n": -2}), PolicyError, "every_n=-2"),
    C("policy-every-n-str", lambda c: P(checkpointing={"every_n": "2"}), PolicyError, "every_n='2'", "integer"),
    C("policy-every-n-float", lambda c: P(checkpointing={"every_n": 2.5}), PolicyError, "every_n=2.5"),
    C("policy-every-n-bool", lambda c: P(checkpointing={"every_n": True}), PolicyError, "every_n=True"),
    C(
        "policy-every-n-with-selective",
        lambda c: P(checkpointing={"mode": "selective", "every_n": 3}),
        PolicyError,
        "every_n=3 only applies to mode='every_n'",
        "(mode is 'selective'",
        "set mode='every_n' or drop every_n",
    ),
    C(
        "policy-every-n-without-mode",
        lambda c: P(checkpointing={"every_n": 4}),
        PolicyError,
        "every_n=4 only applies",
        "(mode is 'none'",
    ),
    C(
        "policy-every-n-huge",
        lambda c: P(checkpointing={"mode": "every_n", "every_n": 10**20}),
        PolicyError,
        "every_n=100000000000000000000 must be at most 10000",
    ),
    C(
        "policy-reentrant",
        lambda c: P(checkpointing={"use_reentrant": "yes"}),
        PolicyError,
        "use_reentrant='yes'",
        "True or False",
    ),
    C(
        "policy-block-classes-int",
        lambda c: P(checkpointing={"block_classes": 5}),
        PolicyError,
        "block_classes=5",
        "class names",
    ),
    C(
        "policy-block-classes-empty",
        lambda c: P(checkpointing={"block_classes": []}),
        PolicyError,
        "block_classes=",
        "non-empty",
    ),
    C(
        "policy-block-classes-blank",
        lambda c: P(checkpointing={"block_classes": [""]}),
        PolicyError,
        "block_classes=('',)",
    ),
    C(
        "policy-block-classes-number",
        lambda c: P(checkpointing={"block_classes": [1]}),
        PolicyError,
        "block_classes=(1,)",
    ),
    C("policy-compile-mode", lambda c: P(compile="fast"), PolicyError, "policy.compile.mode='fast'", "'regional'"),
    C(
        "policy-compile-backend-empty",
        lambda c: P(compile={"backend": ""}),
        PolicyError,
        "policy.compile.backend=''",
        "'inductor'",
    ),
    C("policy-compile-backend-int", lambda c: P(compile={"backend": 3}), PolicyError, "policy.compile.backend=3"),
    C(
        "policy-inductor-mode",
        lambda c: P(compile={"mode": "full", "inductor_mode": "turbo"}),
        PolicyError,
        "inductor_mode='turbo'",
        "'max-autotune'",
    ),
    C(
        "policy-inductor-mode-backend",
        lambda c: P(compile={"mode": "full", "backend": "aot_eager", "inductor_mode": "default"}),
        PolicyError,
        "inductor_mode='default'",
        "only applies to backend='inductor'",
    ),
    C(
        "policy-compile-dynamic",
        lambda c: P(compile={"dynamic": "yes"}),
        PolicyError,
        "policy.compile.dynamic='yes'",
        "None, True or False",
    ),
    C("policy-compile-fullgraph", lambda c: P(compile={"fullgraph": 1}), PolicyError, "policy.compile.fullgraph=1"),
    C("policy-fsdp-mode", lambda c: P(fsdp="zero3"), PolicyError, "policy.fsdp.mode='zero3'", "'full_shard'"),
    C(
        "policy-fsdp-offload-without-mode",
        lambda c: P(fsdp={"cpu_offload": True}),
        PolicyError,
        "policy.fsdp.mode='none'",
        "full_shard",
    ),
    C(
        "policy-fsdp-offload-str",
        lambda c: P(fsdp={"mode": "full_shard", "cpu_offload": "yes"}),
        PolicyError,
        "cpu_offload='yes'",
    ),
    C(
        "policy-fsdp-reshard",
        lambda c: P(fsdp={"mode": "full_shard", "reshard_after_forward": "x"}),
        PolicyError,
        "reshard_after_forward='x'",
    ),
    C(
        "policy-offload-under-fsdp",
        lambda c: P(checkpointing="offload", fsdp="full_shard"),
        PolicyError,
        "checkpointing.mode='offload'",
        "cpu_offload=True",
    ),
    C(
        "policy-subconfig-type",
        lambda c: P(compile=3),
        PolicyError,
        "policy.compile=3 has type int",
        "a mode string or a dict",
    ),
    C(
        "policy-optimizer-type",
        lambda c: P(optimizer=8),
        PolicyError,
        "policy.optimizer=8 has type int",
        "'8bit+in_backward'",
    ),
    C(
        "policy-selective-alternate-as-mode",
        lambda c: P(checkpointing="selective:alternate"),
        PolicyError,
        "mode='selective:alternate' is not a mode",
        "selective_matmuls='save_alternate'",
    ),
    C(
        "policy-dict-unknown",
        lambda c: P.from_dict({"speed": 2}),
        PolicyError,
        "policy.speed is not a policy field",
        "precision",
    ),
    C(
        "policy-subdict-unknown",
        lambda c: P.from_dict({"checkpointing": {"layers": 2}}),
        PolicyError,
        "policy.checkpointing.layers",
        "every_n",
    ),
    C("policy-from-dict-type", lambda c: P.from_dict("bf16"), TypeError, "policy dict must be a dict"),
    C("policy-coerce-int", lambda c: P.coerce(3), TypeError, "policy=3 has type int", "'bf16+ckpt'"),
    C("policy-coerce-list", lambda c: P.coerce(["bf16"]), TypeError, "policy=['bf16'] has type list"),
    C(
        "policy-token",
        lambda c: P.from_string("bf16+warp"),
        PolicyError,
        "unknown token 'warp'",
        "'ckpt:N' (2 <= N <= 10000)",
    ),
    C("policy-two-precisions", lambda c: P.from_string("bf16+fp16"), PolicyError, "'fp16' conflicts with 'bf16'"),
    C(
        "policy-ckpt-0",
        lambda c: P.from_string("ckpt:0"),
        PolicyError,
        "'ckpt:0' is not one of",
        "'ckpt:N' (2 <= N <= 10000)",
    ),
    C("policy-ckpt-x", lambda c: P.from_string("ckpt:x"), PolicyError, "'ckpt:x'"),
    C("policy-ckpt-negative", lambda c: P.from_string("ckpt:-2"), PolicyError, "'ckpt:-2'"),
    C(
        "policy-ckpt-huge",
        lambda c: P.from_string("ckpt:99999999999999999999"),
        PolicyError,
        "'ckpt:99999999999999999999' is not one of",
        "'ckpt:N' (2 <= N <= 10000)",
    ),
    C("policy-ckpt-superscript", lambda c: P.from_string("ckpt:²"), PolicyError, "'ckpt:²' is not one of", "'ckpt:N'"),
    C("policy-ckpt-arabic-digit", lambda c: P.from_string("ckpt:٣"), PolicyError, "'ckpt:٣' is not one of"),
    C(
        "policy-compile-token",
        lambda c: P.from_string("compile:fast"),
        PolicyError,
        "'compile:fast'",
        "'compile:regional'",
    ),
    C("policy-fsdp-token", lambda c: P.from_string("fsdp:zero3"), PolicyError, "'fsdp:zero3'", "'fsdp:offload'"),
    C("policy-precision-arg", lambda c: P.from_string("bf16:2"), PolicyError, "precision 'bf16' takes no ':' argument"),
    C("policy-empty-string", lambda c: P.from_string(""), PolicyError, "unknown token ''"),
    C("policy-only-plus", lambda c: P.from_string("+"), PolicyError, "unknown token ''"),
    C("policy-two-ckpt", lambda c: P.from_string("bf16+ckpt+ckpt:2"), PolicyError, "'ckpt:2' conflicts with 'ckpt'"),
    C("policy-string-type", lambda c: P.from_string(5), TypeError, "policy string must be a str"),
    C(
        "policy-yaml-missing",
        lambda c: P.from_yaml(c.tmp / "none.yaml"),
        FileNotFoundError,
        "none.yaml",
        "does not exist",
    ),
    C(
        "policy-yaml-tab",
        lambda c: P.from_yaml(_yaml(c, b"precision: bf16\n\tcheckpointing: full\n")),
        PolicyError,
        "policy.yaml",
        "not valid YAML at line 2",
        "tabs",
    ),
    C(
        "policy-yaml-utf16",
        lambda c: P.from_yaml(_yaml(c, "precision: bf16\n".encode("utf-16"))),
        PolicyError,
        "policy.yaml",
        "not UTF-8",
    ),
    C(
        "policy-yaml-int",
        lambda c: P.from_yaml(_yaml(c, b"5\n")),
        PolicyError,
        "policy.yaml",
        "holds int 5, not a mapping",
    ),
    C(
        "policy-yaml-list",
        lambda c: P.from_yaml(_yaml(c, b"[1, 2]\n")),
        PolicyError,
        "holds list [1, 2], not a mapping",
    ),
    C(
        "policy-yaml-unknown-field",
        lambda c: P.from_yaml(_yaml(c, b"speed: 2\n")),
        PolicyError,
        "policy.speed is not a policy field",
    ),
    C(
        "policy-yaml-bad-value",
        lambda c: P.from_yaml(_yaml(c, b"precision: fp9\n")),
        PolicyError,
        "policy.precision='fp9'",
    ),
    C(
        "policy-yaml-bad-string",
        lambda c: P.from_yaml(_yaml(c, b"policy: bf16+turbo\n")),
        PolicyError,
        "unknown token 'turbo'",
    ),
    C(
        "policy-yaml-duplicate-key",
        lambda c: P.from_yaml(_yaml(c, b"precision: bf16\nprecision: fp32\n")),
        PolicyError,
        "policy.yaml",
        "line 2",
        "duplicate key 'precision'",
    ),
    C("policy-yaml-empty", lambda c: P.from_yaml(_yaml(c, b"")), PolicyError, "policy.yaml", "is empty"),
]

SIZES = [
    C(
        f"sizes-{name}",
        (lambda v: lambda c: parse_bytes(v, field="--memory-budget"))(value),
        error,
        "--memory-budget=",
        *extra,
    )
    for name, value, error, extra in [
        ("word", "lots", ValueError, ("'lots' is not a size", "GiB")),
        ("unit", "20 parsecs", ValueError, ("'20 parsecs' is not a size",)),
        ("negative", "-3GiB", ValueError, ("'-3GiB' must be positive",)),
        ("zero-str", "0", ValueError, ("'0' must be positive",)),
        ("zero", 0, ValueError, ("=0 must be positive",)),
        ("negative-int", -1, ValueError, ("=-1 must be positive",)),
        ("sub-byte", 0.5, ValueError, ("=0.5 must be positive",)),
        ("bool", True, TypeError, ("=True (bool)",)),
        ("none", None, TypeError, ("=None (NoneType)",)),
        ("list", [1], TypeError, ("=[1] (list)",)),
        ("nan-str", "nan", ValueError, ("'nan' is not a finite size",)),
        ("inf-str", "inf", ValueError, ("'inf' is not a finite size",)),
        ("nan", float("nan"), ValueError, ("=nan is not a finite size",)),
        ("inf", float("inf"), ValueError, ("=inf is not a finite size",)),
        ("overflow", "1e400", ValueError, ("'1e400' is not a finite size",)),
        ("absurd", "1e30", ValueError, ("larger than any machine",)),
        ("empty", "", ValueError, ("='' is not a size",)),
        ("unit-only", "GiB", ValueError, ("'GiB' is not a size",)),
        ("two-dots", "1.5.3GB", ValueError, ("'1.5.3GB' is not a size",)),
    ]
]


def _prepared_peft(c: Any) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(prepare_model(c.load("llama"), "bf16"), LoraConfig(r=2, target_modules=["q_proj"]))


def _lora(model: nn.Module, *, deleted: bool = False, other: bool = False) -> nn.Module:
    """A LoRA model on q_proj; ``other``: a second adapter on v_proj; ``deleted``: its 'default' adapter deleted."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    if other:
        model.add_adapter("other", LoraConfig(r=2, target_modules=["v_proj"]))
    if deleted:
        model.delete_adapter("default")
    return model


def _int8(c: Any) -> nn.Module:
    model = c.load("plain")
    model.head.weight = nn.Parameter(torch.zeros(1, 32, dtype=torch.int8), requires_grad=False)
    return model


def _checkpointed_by_hand(c: Any) -> nn.Module:
    model = c.load("llama")
    model.gradient_checkpointing_enable()
    return model


def _compiled_in_place(c: Any) -> nn.Module:
    model = c.load("plain")
    model.compile(backend="eager")
    return model


def _dynamic_int8(c: Any) -> nn.Module:
    return torch.ao.quantization.quantize_dynamic(c.load("plain"), {nn.Linear}, dtype=torch.qint8)


def _meta(c: Any) -> nn.Module:
    with torch.device("meta"):
        return PlainStack()


# (model builder, policy, error, fragments): prepare_model(model, policy) must raise and leave the model as it was.
PREPARE = [
    ("policy-string", lambda c: c.load("llama"), "bf16+warp", PolicyError, ("unknown token 'warp'",)),
    (
        "policy-dict",
        lambda c: c.load("llama"),
        {"precision": "bf16", "speed": 2},
        PolicyError,
        ("policy.speed is not a policy field",),
    ),
    ("policy-type", lambda c: c.load("llama"), 3.5, TypeError, ("policy=3.5 has type float",)),
    (
        "backend-unknown",
        lambda c: c.load("llama"),
        P(compile={"mode": "full", "backend": "no_such_backend"}),
        RuntimeError,
        ("policy.compile.backend='no_such_backend' is not a torch.compile backend", "'inductor'"),
    ),
    (
        "backend-tvm",
        lambda c: c.load("llama"),
        P(compile={"mode": "regional", "backend": "tvm"}),
        RuntimeError,
        ("policy.compile.backend='tvm' needs",),
    ),
    (
        "fsdp-no-group",
        lambda c: c.load("llama"),
        "bf16+ckpt+fsdp",
        RuntimeError,
        ("policy.fsdp.mode='full_shard' needs a torch.distributed process group", "torchrun"),
    ),
    (
        "hybrid-no-group",
        lambda c: c.load("llama"),
        "bf16+fsdp:hybrid_shard",
        RuntimeError,
        ("policy.fsdp.mode='hybrid_shard'",),
    ),
    (
        "block-classes-nothing",
        lambda c: c.load("llama"),
        P(checkpointing={"mode": "full", "block_classes": ["NoSuchLayer"]}),
        ValueError,
        ("block_classes=['NoSuchLayer'] names no module", "LlamaDecoderLayer"),
    ),
    (
        "no-blocks-ckpt",
        lambda c: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
        "ckpt",
        ValueError,
        ("cannot find repeated blocks in Sequential", "block_classes"),
    ),
    (
        "no-blocks-regional",
        lambda c: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
        P(compile={"mode": "regional", "backend": "aot_eager"}),
        ValueError,
        ("cannot find repeated blocks",),
    ),
    (
        "reentrant-torch-path",
        lambda c: c.load("plain"),
        P(checkpointing={"mode": "full", "use_reentrant": True}),
        ValueError,
        ("use_reentrant=True", "Set use_reentrant=False"),
    ),
    (
        "reentrant-override",
        lambda c: c.load("llama"),
        P(checkpointing={"mode": "full", "use_reentrant": True, "block_classes": ["LlamaDecoderLayer"]}),
        ValueError,
        ("use_reentrant=True", "block_classes was given"),
    ),
    (
        "int8-weights",
        _int8,
        "bf16",
        ValueError,
        ("quantized (integer) weights (torch.int8)", "QLoRA-style", "dtype=torch.float32"),
    ),
    ("meta-weights", _meta, "bf16+ckpt", ValueError, ("parameters on the meta device", "from_pretrained")),
    (
        "checkpointed-by-hand",
        _checkpointed_by_hand,
        "bf16",
        ValueError,
        ("already has activation checkpointing on", "gradient_checkpointing_disable()", "'bf16+ckpt'"),
    ),
    (
        "compiled-in-place",
        _compiled_in_place,
        "bf16+ckpt",
        ValueError,
        ("already compiled in place", "'bf16+compile:regional'"),
    ),
    ("dynamic-int8", _dynamic_int8, "bf16+ckpt", ValueError, ("quantized modules (Linear", "QLoRA-style")),
    (
        "twice",
        lambda c: prepare_model(c.load("llama"), "bf16"),
        "bf16+ckpt",
        RuntimeError,
        ("already prepared with policy 'bf16'", "Load a fresh model"),
    ),
    ("twice-through-peft", _prepared_peft, "bf16+ckpt", RuntimeError, ("already prepared with policy 'bf16'",)),
    (
        "twice-through-compile",
        lambda c: torch.compile(prepare_model(c.load("plain"), "fp32"), backend="eager"),
        "bf16",
        RuntimeError,
        ("already prepared with policy 'fp32'",),
    ),
    # Issue 38: torch.compile before prepare_model was taken, and only verify said so afterwards.
    (
        "compiled-wrapper",
        lambda c: torch.compile(c.load("llama"), backend="eager"),
        "bf16+ckpt",
        ValueError,
        (
            "this model is a torch.compile wrapper (OptimizedModule around LlamaForCausalLM)",
            "Call prepare_model on the LlamaForCausalLM itself (model._orig_mod)",
            "put compile in the policy (e.g. 'bf16+ckpt+compile'",
        ),
    ),
    (
        "compiled-wrapper-around-peft",
        lambda c: torch.compile(_lora(c.load("llama")), backend="eager"),
        "bf16+ckpt",
        ValueError,
        ("a torch.compile wrapper (OptimizedModule around PeftModel)", "Call prepare_model on the PeftModel itself"),
    ),
    (
        "peft-over-compiled-base",
        lambda c: _lora(torch.compile(c.load("llama"), backend="eager")),
        "bf16+ckpt",
        ValueError,
        (
            "this PeftModel holds a torch.compile wrapper at 'base_model.model' (OptimizedModule around LlamaForCausalLM)",
            "Build the PeftModel on the LlamaForCausalLM itself (not compiled)",
        ),
    ),
    # Issue 38: a model with 0 blocks under ckpt was taken; describe showed `blocks []`, nothing said why.
    *[
        (
            f"zero-blocks-{token}",
            lambda c: tiny_llama(num_hidden_layers=0),
            f"bf16+{token}",
            ValueError,
            (
                "LlamaForCausalLM has 0 blocks (config.num_hidden_layers=0)",
                f"the policy's '{token}' has no block to {verb}",
                f"drop '{token}' from the policy",
                "'block_classes': ['MyBlock']",
            ),
        )
        for token, verb in [
            ("ckpt", "checkpoint"),
            ("ckpt:2", "checkpoint"),
            ("ckpt:selective", "checkpoint"),
            ("ckpt:offload", "checkpoint"),
            ("mlp:tiled", "tile"),
            ("compile:regional", "compile"),
            ("quant:nf4", "quantize"),
        ]
    ],
    (
        "zero-blocks-two-tokens",
        lambda c: tiny_llama(num_hidden_layers=0),
        "bf16+ckpt+mlp:tiled",
        ValueError,
        ("the policy's 'ckpt' and 'mlp:tiled' have no block to checkpoint or tile",),
    ),
    (
        "zero-blocks-plain",
        lambda c: PlainStack(depth=0),
        "ckpt",
        ValueError,
        ("PlainStack has 0 blocks (its ModuleList 'layers' is empty)", "no block to checkpoint", "drop 'ckpt'"),
    ),
]
PREPARE_TYPES = [
    ("not-module-str", "meta-llama/Llama-3"),
    ("not-module-none", None),
    ("not-module-dict", {"weights": 1}),
]


def _config_dir(c: Any, name: str, text: str | None) -> str:
    path = c.tmp / name
    path.mkdir()
    if text is not None:
        (path / "config.json").write_text(text)
    return str(path)


BAD_HEADS = json.dumps(
    {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 5,
        "num_key_value_heads": 5,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 128,
    }
)


def _est(c: Any, **kw: Any) -> Any:
    args = {"batch_size": 1, "seq_len": 16, **kw}
    model = args.pop("model", c.dirs["llama"])
    return estimate_memory(model, args.pop("policy", "bf16"), **args)


ESTIMATE = [
    C(
        "estimate-batch-negative",
        lambda c: _est(c, batch_size=-1),
        ValueError,
        "batch_size=-1 must be a positive integer",
    ),
    C("estimate-batch-zero", lambda c: _est(c, batch_size=0), ValueError, "batch_size=0"),
    C("estimate-batch-bool", lambda c: _est(c, batch_size=True), ValueError, "batch_size=True"),
    C("estimate-batch-str", lambda c: _est(c, batch_size="4"), ValueError, "batch_size='4'"),
    C("estimate-seq-zero", lambda c: _est(c, seq_len=0), ValueError, "seq_len=0 must be a positive integer"),
    C(
        "estimate-seq-limit",
        lambda c: _est(c, seq_len=4096),
        ValueError,
        "seq_len=4096 is above the model's limit of 64",
        "seq_len=64 or less",
    ),
    C("estimate-world-zero", lambda c: _est(c, world_size=0), ValueError, "world_size=0"),
    C(
        "estimate-optimizer",
        lambda c: _est(c, optimizer="lion"),
        ValueError,
        "optimizer='lion' is not one of 'adamw', 'sgd'",
    ),
    C("estimate-task", lambda c: _est(c, task="seq2seq"), ValueError, "task='seq2seq' is not one of"),
    C("estimate-trainable-int", lambda c: _est(c, trainable=5), TypeError, "trainable=5 (int)", "'lora'"),
    C("estimate-trainable-str", lambda c: _est(c, trainable="adapters"), ValueError, "trainable='adapters'"),
    C(
        "estimate-trainable-dict",
        lambda c: _est(c, trainable={"rank": 8}),
        ValueError,
        "trainable={'rank': 8}",
        "LoraConfig",
    ),
    C(
        "estimate-trainable-targets",
        lambda c: _est(c, trainable={"target_modules": ["nope"]}),
        ValueError,
        "does not fit",
        "q_proj",
    ),
    C("estimate-policy", lambda c: _est(c, policy="bf16+warp"), PolicyError, "unknown token 'warp'"),
    C(
        "estimate-unknown-model",
        lambda c: _est(c, model="no-such-org/no-such-model"),
        ValueError,
        "model='no-such-org/no-such-model'",
        "not in the local Hugging Face cache",
        "hf download",
    ),
    C(
        "estimate-dir-no-config",
        lambda c: _est(c, model=_config_dir(c, "empty", None)),
        ValueError,
        "directory without a config.json",
    ),
    C(
        "estimate-config-json",
        lambda c: _est(c, model=_config_dir(c, "broken", "{not json")),
        ValueError,
        "config.json is not valid JSON",
    ),
    C(
        "estimate-config-no-type",
        lambda c: _est(c, model=_config_dir(c, "untyped", '{"hidden_size": 64}')),
        ValueError,
        "has no 'model_type'",
    ),
    C(
        "estimate-config-invalid",
        lambda c: _est(c, model=_config_dir(c, "heads", BAD_HEADS)),
        ValueError,
        "not a valid Transformers config",
        "not a multiple of the number of attention heads",
    ),
    C(
        # Found by a new-user trial: Transformers failed on it with torch's words ("module 'torch' has
        # no attribute 'float8'"), naming neither the field nor what it may be.
        "estimate-config-dtype",
        lambda c: _est(c, model=_config_dir(c, "f8", json.dumps({**json.loads(BAD_HEADS), "dtype": "float8"}))),
        ValueError,
        "config.json has dtype='float8'",
        "['bfloat16', 'float16', 'float32', 'float64']",
        "or remove the field",
    ),
    C(
        "estimate-config-class",
        lambda c: _est(c, model=__import__("transformers").LlamaConfig),
        TypeError,
        "the class LlamaConfig, not a config: pass LlamaConfig(...)",
    ),
    C(
        "estimate-model-int",
        lambda c: _est(c, model=7),
        TypeError,
        "model=7 (int)",
        "a config dict with its 'model_type'",
    ),
    C(
        "estimate-config-dict-untyped",
        lambda c: _est(c, model={"hidden_size": 64}),
        ValueError,
        "a config dict without a 'model_type'",
        "{'model_type': 'llama', ...}",
    ),
    C(
        "estimate-config-dict-typo",
        lambda c: _est(c, model={"model_type": "llama", "hiden_size": 64}),
        ValueError,
        "'hiden_size', which LlamaConfig does not define",
        "default hidden_size=4096",
        "did you mean 'hidden_size'?",
    ),
    C(
        "estimate-config-dict-unknown-type",
        lambda c: _est(c, model={"model_type": "no_such_arch"}),
        ValueError,
        "model_type='no_such_arch', which this Transformers does not know",
    ),
    C(
        "estimate-config-dict-invalid",
        lambda c: _est(c, model=json.loads(BAD_HEADS)),
        ValueError,
        "model_type='llama' is not a valid Transformers config",
        "not a multiple of the number of attention heads",
    ),
    C(
        "estimate-untraceable",
        lambda c: _est(c, model=c.dirs["t5"], task="classification"),
        ValueError,
        "cannot trace T5ForSequenceClassification",
        "task='classification'",
        "measure_step",
    ),
    C(
        "plan-budget-word",
        lambda c: plan_policy(c.dirs["llama"], budget="lots", seq_len=16),
        ValueError,
        "budget='lots' is not a size",
    ),
    C(
        "plan-budget-inf",
        lambda c: plan_policy(c.dirs["llama"], budget=float("inf"), seq_len=16),
        ValueError,
        "budget=inf is not a finite size",
    ),
    C(
        "plan-margin-high",
        lambda c: plan_policy(c.dirs["llama"], budget="1GiB", seq_len=16, margin=1.5),
        ValueError,
        "margin=1.5",
        "[0, 1)",
    ),
    C(
        "plan-margin-str",
        lambda c: plan_policy(c.dirs["llama"], budget="1GiB", seq_len=16, margin="x"),
        ValueError,
        "margin='x'",
    ),
    C(
        "plan-batch-word",
        lambda c: plan_policy(c.dirs["llama"], budget="1GiB", seq_len=16, batch_size="many"),
        ValueError,
        "batch_size='many' must be a positive integer or 'max'",
    ),
    C(
        "plan-batch-zero",
        lambda c: plan_policy(c.dirs["llama"], budget="1GiB", seq_len=16, batch_size=0),
        ValueError,
        "batch_size=0",
    ),
    C(
        "verify-unprepared",
        lambda c: verify(c.load("llama"), make_batch("llama")),
        ValueError,
        "verify needs a model returned by prepare_model",
    ),
    C(
        "verify-no-labels",
        lambda c: verify(prepare_model(c.load("llama"), "fp32"), {"input_ids": make_batch("llama")["input_ids"]}),
        ValueError,
        "returned no loss",
        "labels",
        "loss_fn",
    ),
    # New-user trial: an empty batch gave a raw reshape RuntimeError from inside the model.
    C(
        "verify-empty-rows",
        lambda c: verify(prepare_model(c.load("llama"), "fp32"), _empty((0, 8))),
        ValueError,
        "batch['input_ids'] has shape (0, 8)",
        "an empty batch (0 rows or 0 tokens)",
    ),
    C(
        "verify-empty-tokens",
        lambda c: verify(prepare_model(c.load("llama"), "fp32"), _empty((2, 0))),
        ValueError,
        "batch['input_ids'] has shape (2, 0)",
        "at least one token",
    ),
    # New-user trial: a make_batch returning [batch] gave a raw TypeError from embedding().
    C(
        "finder-make-batch-list",
        lambda c: _find(c, lambda n: [make_batch("llama", batch_size=n)]),
        TypeError,
        "make_batch(1) returned a list of dict",
        "must return a dict of tensors (a Mapping such as the BatchEncoding",
    ),
]


def _with(**changes: Any) -> dict[str, torch.Tensor]:
    """The tiny Llama's batch of 2 rows of 16 tokens, ``changes(batch)`` giving fields to replace."""
    batch = make_batch("llama")
    return {**batch, **{k: f(batch) for k, f in changes.items()}}


def _set(t: torch.Tensor, index: tuple[int, int], value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _verify(c: Any, batch: dict[str, Any], **kw: Any) -> Any:
    return verify(prepare_model(c.load("llama"), "fp32"), batch, **kw)


# Issue 38: each gave torch's own words from deep inside the model (an IndexError from the embedding,
# "Expected input batch_size (32) to match target batch_size (26)"), or, for the mask, no error at all.
# One check (measure/batch_checks.py) for verify, measure_step and the finder's first sample.
BATCH = [
    C(
        "verify-labels-shorter",
        lambda c: _verify(c, _with(labels=lambda b: b["labels"][:, :-3])),
        ValueError,
        "verify: labels has shape (2, 13) and input_ids (2, 16)",
        "the same shape",
        "pad them to the same length",
    ),
    C(
        "verify-labels-rows",
        lambda c: _verify(c, _with(labels=lambda b: b["labels"][:1])),
        ValueError,
        "verify: labels has shape (1, 16) and input_ids (2, 16)",
    ),
    C(
        "verify-mask-length",
        lambda c: _verify(c, _with(attention_mask=lambda b: torch.ones(2, 5, dtype=torch.long))),
        ValueError,
        "verify: attention_mask has shape (2, 5) and input_ids (2, 16)",
        "the same shape as input_ids",
    ),
    C(
        "verify-ids-above-vocab",
        lambda c: _verify(c, _with(input_ids=lambda b: _set(b["input_ids"], (1, 3), VOCAB + 5))),
        ValueError,
        f"verify: input_ids holds id {VOCAB + 5} (1 id(s) in all) outside the vocabulary of LlamaForCausalLM",
        f"({VOCAB} ids: 0-{VOCAB - 1})",
        "resize_token_embeddings",
    ),
    C(
        "verify-ids-negative",
        lambda c: _verify(c, _with(input_ids=lambda b: _set(b["input_ids"], (0, 0), -1))),
        ValueError,
        "verify: input_ids holds id -1",
        f"({VOCAB} ids: 0-{VOCAB - 1})",
    ),
    C(
        "verify-labels-above-vocab",
        lambda c: _verify(c, _with(labels=lambda b: _set(b["labels"], (0, 5), VOCAB))),
        ValueError,
        f"verify: labels holds id {VOCAB}",
        "-100 (ignore_index) is the one label outside it",
    ),
    C(
        "verify-ids-float",
        lambda c: _verify(c, _with(input_ids=lambda b: b["input_ids"].float())),
        TypeError,
        "verify: input_ids has dtype torch.float32",
        "integers",
    ),
    C(
        "measure-labels-shorter",
        lambda c: measure_step(c.load("llama"), _with(labels=lambda b: b["labels"][:, :-3]), timed=False),
        ValueError,
        "measure_step: labels has shape (2, 13) and input_ids (2, 16)",
    ),
    C(
        "measure-ids-above-vocab",
        lambda c: measure_step(
            c.load("llama"), _with(input_ids=lambda b: _set(b["input_ids"], (0, 1), VOCAB)), timed=False
        ),
        ValueError,
        f"measure_step: input_ids holds id {VOCAB}",
    ),
    C(
        "finder-ids-above-vocab",
        lambda c: _find(c, lambda n: {**make_batch("llama", batch_size=n), "input_ids": torch.full((n, 16), VOCAB)}),
        ValueError,
        f"find_batch_size: make_batch(1): input_ids holds id {VOCAB}",
    ),
    # Issue 38: KeyError: 'default' from PEFT (the deleted adapter's name is still the active one).
    C(
        "merge-no-adapters",
        lambda c: merge_adapters(_lora(c.load("llama"), deleted=True)),
        ValueError,
        "merge_adapters: this PeftModel has no adapters left (peft_config lists none",
        "model.load_adapter(path",
        "base = model.unload()",
    ),
    C(
        "merge-active-adapter-deleted",
        lambda c: merge_adapters(_lora(c.load("llama"), deleted=True, other=True)),
        ValueError,
        "none of this PeftModel's adapters ['other'] is active",
        "model.set_adapter('other')",
    ),
]


def _empty(shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 64, shape), "labels": torch.randint(0, 64, shape)}


def _find(c: Any, make: Callable[[int], Any]) -> Any:
    from hf_memstack import find_batch_size

    model = prepare_model(c.load("llama"), "fp32")
    return find_batch_size(model, make, torch.optim.AdamW(model.parameters()), budget="20MiB", cache=False)


# argv -> exit 2 and these fragments on stderr ({d}: the tiny Llama's directory, {t}: tmp).
CLI = [
    ("budget-word", ["plan", "{d}", "--budget", "lots", "--seq-len", "16"], ("--budget='lots' is not a size",)),
    (
        "budget-overflow",
        ["plan", "{d}", "--budget", "1e400", "--seq-len", "16"],
        ("--budget='1e400' is not a finite size",),
    ),
    (
        "budget-negative",
        ["estimate", "{d}", "--batch-size", "1", "--seq-len", "16", "--budget=-1GiB"],
        ("--budget='-1GiB' must be positive",),
    ),
    # As two words: argparse used to read -1GiB as an option and say "expected one argument".
    (
        "budget-negative-spaced",
        ["plan", "{d}", "--budget", "-1GiB", "--seq-len", "16"],
        ("--budget='-1GiB' must be positive", "'20GiB'"),
    ),
    (
        "budget-negative-decimal",
        ["find-batch-size", "{d}", "--seq-len", "16", "--budget", "-.5GB"],
        ("--budget='-.5GB' must be positive",),
    ),
    (
        "batch-negative",
        ["estimate", "{d}", "--batch-size", "-3", "--seq-len", "16"],
        ("--batch-size='-3' must be a positive integer",),
    ),
    (
        "seq-zero",
        ["find-batch-size", "{d}", "--seq-len", "0", "--budget", "1GiB"],
        ("--seq-len='0' must be a positive integer",),
    ),
    (
        "seq-limit",
        ["find-batch-size", "{d}", "--seq-len", "4096", "--budget", "1GiB"],
        ("seq_len=4096 is above the model's limit of 64",),
    ),
    (
        "world-zero",
        ["estimate", "{d}", "--batch-size", "1", "--seq-len", "16", "--world-size", "0"],
        ("--world-size='0'",),
    ),
    (
        "margin",
        ["plan", "{d}", "--budget", "1GiB", "--seq-len", "16", "--margin", "2"],
        ("--margin='2' must be a number in [0, 1)",),
    ),
    (
        "batch-word",
        ["plan", "{d}", "--budget", "1GiB", "--seq-len", "16", "--batch-size", "many"],
        ("--batch-size='many'",),
    ),
    (
        "policy-token",
        ["estimate", "{d}", "--policy", "bf16+warp", "--batch-size", "1", "--seq-len", "16"],
        ("unknown token 'warp'",),
    ),
    (
        "unknown-model",
        ["estimate", "no-such-org/no-such-model", "--batch-size", "1", "--seq-len", "16"],
        ("not in the local Hugging Face cache",),
    ),
    (
        "config-json",
        ["estimate", "{t}/broken", "--batch-size", "1", "--seq-len", "16"],
        ("config.json is not valid JSON",),
    ),
    (
        "config-heads",
        ["plan", "{t}/heads", "--budget", "1GiB", "--seq-len", "16"],
        ("not a multiple of the number of attention heads",),
    ),
    (
        "trainable-conflict",
        ["estimate", "{d}", "--batch-size", "1", "--seq-len", "16", "--trainable", "all", "--lora-r", "8"],
        ("--trainable all contradicts --lora-* options",),
    ),
    (
        "lora-r-zero",
        ["estimate", "{d}", "--batch-size", "1", "--seq-len", "16", "--lora-r", "0"],
        ("--lora-r='0' must be a positive integer",),
    ),
    (
        "lora-target",
        ["estimate", "{d}", "--batch-size", "1", "--seq-len", "16", "--lora-target", "nope"],
        ("linear layers are named",),
    ),
    (
        "task",
        ["estimate", "{d}", "--batch-size", "1", "--seq-len", "16", "--task", "vision"],
        ("invalid choice: 'vision'",),
    ),
    ("missing-args", ["estimate"], ("the following arguments are required",)),
]


class Ctx:
    def __init__(self, load: Any, dirs: dict[str, Path], tmp: Path):
        self.load, self.dirs, self.tmp = load, dirs, tmp


@pytest.fixture
def ctx(load_model: Any, pretrained_dirs: dict[str, Path], tmp_path: Path) -> Ctx:
    return Ctx(load_model, pretrained_dirs, tmp_path)


@pytest.mark.parametrize("case", [*POLICY, *SIZES, *ESTIMATE, *BATCH])
def test_bad_input_is_a_clear_error(ctx: Ctx, case: Case) -> None:
    with pytest.raises(case.error) as raised:
        case.call(ctx)
    message = str(raised.value)
    missing = [f for f in case.fragments if f not in message]
    assert not missing, f"{case.id}: {missing} not in: {message}"


@pytest.mark.parametrize("name, build, policy, error, fragments", PREPARE, ids=[f"prepare-{c[0]}" for c in PREPARE])
def test_prepare_bad_input_leaves_the_model_untouched(
    ctx: Ctx, name: str, build: Any, policy: Any, error: type, fragments: tuple
) -> None:
    model = build(ctx)
    before = snapshot(model)
    record = getattr(model, "memstack", None)
    with pytest.raises(error) as raised:
        prepare_model(model, policy)
    missing = [f for f in fragments if f not in str(raised.value)]
    assert not missing, f"{name}: {missing} not in: {raised.value}"
    if record is None:
        assert_untouched(model, before)
    else:  # prepared before: still exactly as it was, with its first record
        assert getattr(model, "memstack", None) is record


@pytest.mark.parametrize("name, value", PREPARE_TYPES, ids=[f"prepare-{n}" for n, _ in PREPARE_TYPES])
def test_prepare_needs_a_module(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=f"model must be a torch.nn.Module .*got {type(value).__name__}"):
        prepare_model(value, "bf16")


@pytest.mark.parametrize("name, argv, fragments", CLI, ids=[f"cli-{c[0]}" for c in CLI])
def test_cli_input_errors_exit_2(ctx: Ctx, capsys: Any, name: str, argv: list[str], fragments: tuple) -> None:
    _config_dir(ctx, "broken", "{not json")
    _config_dir(ctx, "heads", BAD_HEADS)
    argv = [a.replace("{d}", str(ctx.dirs["llama"])).replace("{t}", str(ctx.tmp)) for a in argv]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    missing = [f for f in fragments if f not in err]
    assert not missing, f"{name}: {missing} not in: {err}"
    assert "Traceback" not in err


def test_cli_does_not_fit_is_exit_1_by_type(ctx: Ctx, capsys: Any) -> None:
    assert issubclass(BudgetTooSmallError, ValueError)
    assert cli(["find-batch-size", str(ctx.dirs["llama"]), "--seq-len", "16", "--budget", "100KiB", "--no-cache"]) == 1
    assert "does not fit" in capsys.readouterr().err
