import math

import pytest
import torch
from tiny import ARCHS, PlainStack, assert_untouched, make_batch, snapshot
from torch import nn

from hf_memstack import MemoryPolicy, PolicyError, describe, prepare_model, train_step, verify

# Every valid combination short of FSDP, with a cheap compile backend (one real inductor test lives
# in test_compile.py).
POLICIES = [
    "fp32",
    "bf16",
    "fp32+ckpt",
    "bf16+ckpt",
    "bf16+ckpt:2",
    "bf16+ckpt:offload",
    "bf16+compile:regional",
    "bf16+compile+ckpt",
    "bf16+compile:regional+ckpt",
]


def _policy(spec: str) -> MemoryPolicy:
    p = MemoryPolicy.from_string(spec)
    p.compile.backend = "aot_eager"
    return p


def _train(model, arch, steps=4, lr=1e-2, scaler=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batch = make_batch(arch)
    return [train_step(model, batch, opt, grad_scaler=scaler) for _ in range(steps)]


@pytest.mark.parametrize("spec", POLICIES)
@pytest.mark.parametrize("arch", [*ARCHS, "plain"])
def test_every_policy_prepares_verifies_and_trains(load_model, arch, spec):
    if (arch, spec) == ("t5", "bf16+compile:regional+ckpt"):
        pytest.skip("known graph break inside T5's checkpointed block: see test_verify_flags_t5_eager_region")
    model = prepare_model(load_model(arch), _policy(spec))
    report = verify(model, make_batch(arch))
    assert report.ok, str(report)
    losses = _train(model, arch)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses  # the same batch four times: the loss must fall


@pytest.mark.parametrize("arch", [*ARCHS, "plain"])
def test_bf16_loss_close_to_fp32(load_model, arch):
    batch = make_batch(arch)
    fp32 = train_step(prepare_model(load_model(arch), "fp32"), batch)
    bf16 = train_step(prepare_model(load_model(arch), "bf16"), batch)
    assert bf16 != fp32  # autocast really changed the arithmetic
    assert abs(bf16 - fp32) <= 0.02 * abs(fp32) + 1e-3


def test_bf16_outputs_are_fp32_with_and_without_labels(load_model):
    """fp32 outputs as Accelerate returns them, the logits included when the model computed its
    loss: a user's own loss term from the logits then runs in fp32 (a model's KL to itself is 0)."""
    model = prepare_model(load_model("llama"), "bf16").eval()
    batch = make_batch("llama")
    with torch.no_grad():
        with_labels = model(**batch)
        without = model(input_ids=batch["input_ids"])
        as_tuple = model(input_ids=batch["input_ids"], labels=batch["labels"], return_dict=False)
    assert with_labels.loss.dtype == torch.float32 and with_labels.logits.dtype == torch.float32
    assert without.loss is None and without.logits.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in as_tuple if torch.is_tensor(t))
    a, b = with_labels.logits.log_softmax(-1), without.logits.log_softmax(-1)
    assert torch.nn.functional.kl_div(a, b, log_target=True, reduction="batchmean") == 0


@pytest.mark.parametrize("arch, method", [("llama", "transformers"), ("t5", "transformers"), ("plain", "torch")])
def test_checkpointing_method_and_recompute(load_model, arch, method):
    plain = verify(prepare_model(load_model(arch), "fp32"), make_batch(arch))
    model = prepare_model(load_model(arch), "fp32+ckpt")
    report = verify(model, make_batch(arch))
    assert model.memstack.checkpointing.method == method
    assert report.recomputed_blocks == list(range(len(model.memstack.blocks)))
    # The proof that memory is saved: far fewer bytes saved for backward.
    assert report.saved_activation_bytes < 0.6 * plain.saved_activation_bytes


def test_verify_flags_t5_eager_region(load_model):
    # T5's first decoder block sets requires_grad on its position bias, which dynamo cannot trace
    # inside a checkpoint: that region silently runs eager (pytorch#97436). verify must say so.
    model = prepare_model(load_model("t5"), _policy("bf16+compile:regional+ckpt"))
    report = verify(model, make_batch("t5"))
    compile_check = report.check("compile")
    assert not compile_check.ok
    assert "ran eager" in compile_check.detail and "graph breaks:" in compile_check.detail
    assert report.check("checkpointing").ok and report.check("gradients").ok


def test_wrapper_keeps_state_dict_keys(load_model):
    before = set(load_model("plain").state_dict())
    model = prepare_model(load_model("plain"), "ckpt")
    assert set(model.state_dict()) == before


@pytest.mark.parametrize("arch, expected", [("llama", [0]), ("t5", [0, 2]), ("plain", [0, 2])])
def test_every_n_checkpoints_every_other_block(load_model, arch, expected):
    model = prepare_model(load_model(arch), "ckpt:2")
    report = verify(model, make_batch(arch))
    assert report.ok, str(report)
    assert report.recomputed_blocks == expected


@pytest.mark.parametrize("reentrant", [False, True])
def test_frozen_embeddings_still_train_under_checkpointing(load_model, reentrant):
    model = load_model("llama")
    model.get_input_embeddings().weight.requires_grad_(False)
    policy = MemoryPolicy(precision="bf16", checkpointing={"mode": "full", "use_reentrant": reentrant})
    report = verify(prepare_model(model, policy), make_batch("llama"))
    assert report.check("gradients").ok, str(report)
    assert report.check("checkpointing").ok, str(report)


def test_verify_catches_eval_mode_and_unused_parameters(load_model):
    model = prepare_model(load_model("llama"), "ckpt")
    model.eval()
    report = verify(model, make_batch("llama"))
    assert not report.check("checkpointing").ok
    assert "eval mode" in report.check("checkpointing").detail
    model.train()
    model.unused = nn.Linear(4, 4)  # a trainable parameter the forward never touches
    report = verify(model, make_batch("llama"))
    assert not report.check("gradients").ok and "unused.weight" in report.check("gradients").detail
    with pytest.raises(RuntimeError, match="unused.weight"):
        verify(model, make_batch("llama"), raise_on_failure=True)


def test_verify_leaves_gradients_and_rng_as_they_were(load_model):
    model = prepare_model(load_model("plain"), "bf16+ckpt")
    train_step(model, make_batch("plain"))  # leaves .grad populated (no optimizer)
    grads = [p.grad.clone() for p in model.parameters()]
    state = torch.get_rng_state()
    verify(model, make_batch("plain"))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))


def test_old_transformers_api_only_gradient_checkpointing_enable(load_model, monkeypatch):
    from transformers import PreTrainedModel

    model = load_model("llama")
    cls = type(model)
    calls = []

    # transformers < 5: no activation_checkpointing_enable, and gradient_checkpointing_enable takes
    # only gradient_checkpointing_kwargs. The stand-in runs Transformers' real implementation.
    def old_gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        calls.append(gradient_checkpointing_kwargs)
        PreTrainedModel._activation_checkpointing_enable(self, gradient_checkpointing_kwargs)

    monkeypatch.setattr(
        cls,
        "activation_checkpointing_enable",
        property(lambda self: (_ for _ in ()).throw(AttributeError)),
        raising=False,
    )
    monkeypatch.setattr(cls, "gradient_checkpointing_enable", old_gradient_checkpointing_enable, raising=False)
    prepare_model(model, "ckpt")
    assert calls == [{"use_reentrant": False}]
    assert model.memstack.checkpointing.method == "transformers"
    assert verify(model, make_batch("llama")).recomputed_blocks == [0, 1]
    # every_n is not in the old API: the PyTorch wrapper does it instead.
    model2 = load_model("llama")
    prepare_model(model2, "ckpt:2")
    assert model2.memstack.checkpointing.method == "torch"
    assert verify(model2, make_batch("llama")).recomputed_blocks == [0]


def test_fp16_loop_with_grad_scaler_on_cpu(load_model):
    with pytest.warns(UserWarning, match="fp16' on CPU"):
        model = prepare_model(load_model("llama"), "fp16+ckpt")
    scaler = model.memstack.grad_scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    # The loop the README documents for fp16 without an Accelerator.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = make_batch("llama")
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert verify(model, batch).check("precision").detail.startswith("Linear outputs in ['torch.float16']")


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_with_accelerator_autocast_comes_from_prepare(load_model, fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="bf16")
    model = prepare_model(load_model("llama"), "bf16+ckpt", accelerator=acc)
    assert model.memstack.autocast_by == "accelerator.prepare"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    report = verify(model, make_batch("llama"))
    assert report.ok, str(report)
    batch = make_batch("llama")
    losses = []
    for _ in range(3):
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_accelerator_precision_mismatch(load_model, fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, mixed_precision="no")
    model = load_model("llama")
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"Accelerator\(mixed_precision='bf16'\)"):
        prepare_model(model, "bf16", accelerator=acc)
    assert_untouched(model, before)


def test_describe_says_what_was_applied(load_model):
    model = prepare_model(load_model("gpt2"), "bf16+ckpt:2")
    text = describe(model)
    assert "bf16 on cpu" in text and "every_n via transformers, blocks [0]" in text and "2 x GPT2Block" in text
    assert "not prepared" in describe(load_model("gpt2"))


# ----------------------------------------------------------------------------- bad input


def test_prepare_twice_is_refused_and_keeps_first_policy(load_model):
    model = prepare_model(load_model("llama"), "bf16")
    with pytest.raises(RuntimeError, match="already prepared with policy 'bf16'.*Load a fresh model"):
        prepare_model(model, "bf16+ckpt")
    assert model.memstack.policy.checkpointing.mode == "none"
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize(
    "policy, error, fragment",
    [
        ("bf16+warp", PolicyError, "unknown token 'warp'"),
        ({"precision": "bf16", "speed": 2}, PolicyError, "policy.speed is not a policy field"),
        (
            MemoryPolicy(compile={"mode": "full", "backend": "no_such_backend"}),
            RuntimeError,
            "policy.compile.backend='no_such_backend' is not a torch.compile backend",
        ),
        (
            MemoryPolicy(compile={"mode": "regional", "backend": "tvm"}),
            RuntimeError,
            "policy.compile.backend='tvm' needs",
        ),
        ("bf16+ckpt+fsdp", RuntimeError, "needs a torch.distributed process group.*torchrun --nproc_per_node 2"),
        (
            MemoryPolicy(checkpointing={"mode": "full", "block_classes": ["NoSuchLayer"]}),
            ValueError,
            "block_classes=\\['NoSuchLayer'\\] names no module.*LlamaDecoderLayer",
        ),
    ],
)
def test_bad_input_leaves_model_untouched(load_model, policy, error, fragment):
    model = load_model("llama")
    before = snapshot(model)
    with pytest.raises(error, match=fragment):
        prepare_model(model, policy)
    assert_untouched(model, before)


def test_checkpointing_without_detectable_blocks():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"cannot find repeated blocks in Sequential.*block_classes"):
        prepare_model(model, "ckpt")
    assert_untouched(model, before)
    with pytest.raises(ValueError, match="cannot find repeated blocks"):
        prepare_model(model, MemoryPolicy(compile={"mode": "regional", "backend": "aot_eager"}))
    prepare_model(model, "bf16")  # needs no blocks: fine


def test_mixed_precision_on_a_device_without_autocast():
    from hf_memstack.transforms.precision import resolve_precision

    with pytest.raises(RuntimeError, match="device type 'meta' has no autocast; use precision='fp32'"):
        resolve_precision("fp16", "meta")


def test_model_without_weights_is_refused_unless_sharded():
    with torch.device("meta"):
        model = PlainStack()
    before_forward = model.__dict__.get("forward")
    with pytest.raises(ValueError, match="parameters on the meta device.*from_pretrained_for_fsdp"):
        prepare_model(model, "fp16")
    assert model.__dict__.get("forward") is before_forward and getattr(model, "memstack", None) is None


def test_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        prepare_model("meta-llama/Llama-3", "bf16")


def test_low_precision_weights_without_autocast_warn(load_model):
    model = load_model("llama").to(torch.bfloat16)
    with pytest.warns(
        UserWarning, match=r"trainable parameter\(s\) of LlamaForCausalLM are torch.bfloat16: they train in 16 bits"
    ):
        prepare_model(model, "fp32")
    assert {p.dtype for p in model.parameters()} == {
        torch.bfloat16
    }  # left as loaded: no autocast to mix them with fp32
