"""PEFT/LoRA models, in either order with prepare_model: adapters get gradients, verify passes,
adapters save and reload identically; the meter and the estimator count frozen weights as frozen."""

from __future__ import annotations

import pytest
import torch
from tiny import PlainStack, assert_untouched, make_batch, snapshot

from hf_memstack import MemoryPolicy, describe, estimate_memory, measure_step, prepare_model, record_of, verify
from hf_memstack.measure import train_step

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"], "plain": ["ff.0", "ff.2"]}


def _lora(arch, r=4):
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[arch], init_lora_weights=False)


def _lora_model(load_model, arch, policy, order):
    from peft import get_peft_model

    torch.manual_seed(1)
    if order == "peft-first":
        return prepare_model(get_peft_model(load_model(arch), _lora(arch)), policy)
    return get_peft_model(prepare_model(load_model(arch), policy), _lora(arch))


def _adapters(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("order", ["peft-first", "prepare-first"])
@pytest.mark.parametrize("arch, policy", [("llama", "bf16+ckpt"), ("gpt2", "bf16+ckpt:2"), ("plain", "bf16+ckpt")])
def test_lora_trains_verifies_and_saves_in_either_order(load_model, tmp_path, arch, policy, order):
    from peft import PeftModel

    model = _lora_model(load_model, arch, policy, order)
    adapters = _adapters(model)
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    report = verify(model, make_batch(arch))
    assert report.ok, str(report)
    assert report.recomputed_blocks == list(record_of(model).checkpointing.checkpointed)
    batch = make_batch(arch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in adapters.items()}
    losses = [train_step(model, batch, opt) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert all(not torch.equal(before[n], p) for n, p in adapters.items()), "every adapter must have been updated"
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == len(adapters)
    reloaded = prepare_model(PeftModel.from_pretrained(load_model(arch), tmp_path), policy)
    model.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch)["logits"], reloaded(**batch)["logits"])
    for name, value in saved.items():
        param = dict(reloaded.named_parameters())[name.replace(".weight", ".default.weight")]
        assert torch.equal(param.detach(), value)


def test_wrapped_prepared_models_are_not_prepared_twice(load_model):
    from peft import get_peft_model

    model = prepare_model(load_model("llama"), "bf16+ckpt")
    for wrapper in (get_peft_model(model, _lora("llama")), torch.compile(model, backend="eager")):
        with pytest.raises(RuntimeError, match="already prepared with policy 'bf16\\+ckpt'"):
            prepare_model(wrapper, "bf16")
    assert record_of(model).policy.to_string() == "bf16+ckpt"


def test_a_peft_model_whose_adapter_was_deleted_is_described_and_prepared(load_model):
    """PEFT keeps a deleted adapter's name as the active one, and its get_base_model() then raises
    KeyError: 'default'; the wrapper walk takes the model the tuner wraps instead (was: that KeyError
    from describe, prepare_model, verify and merge_adapters)."""
    from peft import get_peft_model

    model = get_peft_model(load_model("llama"), _lora("llama"))
    model.delete_adapter("default")
    assert describe(model) == "PeftModel: not prepared by hf_memstack"
    with pytest.warns(UserWarning, match="no parameter of PeftModel requires grad"):
        prepared = prepare_model(model, "ckpt")
    assert record_of(prepared).policy.to_string() == "fp32+ckpt"
    assert describe(prepared).startswith("hf_memstack policy: fp32+ckpt")


def test_reentrant_on_the_torch_checkpoint_path_is_refused_before_touching(load_model):
    model = load_model("plain")
    before = snapshot(model)
    with pytest.raises(ValueError, match="use_reentrant=True.*Set use_reentrant=False"):
        prepare_model(model, MemoryPolicy(checkpointing={"mode": "full", "use_reentrant": True}))
    assert_untouched(model, before)


def test_integer_weights_are_refused(load_model):
    model = load_model("plain")
    model.head.weight = torch.nn.Parameter(torch.zeros(1, 32, dtype=torch.int8), requires_grad=False)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"quantized \(integer\) weights \(torch.int8\).*QLoRA-style"):
        prepare_model(model, "bf16")
    assert_untouched(model, before)


def test_verify_reports_every_adapter_frozen_instead_of_crashing(load_model):
    from peft import get_peft_model

    model = prepare_model(get_peft_model(load_model("llama"), _lora("llama")), "bf16+ckpt")
    for p in model.parameters():
        p.requires_grad_(False)
    report = verify(model, make_batch("llama"))
    assert not report.check("gradients").ok and "no parameter requires grad" in report.check("gradients").detail


def test_verify_reports_the_frozen_input_reentrant_bug(load_model):
    # Reentrant checkpointing with frozen embeddings and no input that requires grad: the classic
    # silent failure. Transformers' enable_input_require_grads fixes it; undo that to see verify catch it.
    from peft import get_peft_model

    model = get_peft_model(load_model("llama"), _lora("llama"))
    model = prepare_model(model, MemoryPolicy(precision="bf16", checkpointing={"mode": "full", "use_reentrant": True}))
    embeddings = model.get_input_embeddings()
    for hook_id in list(embeddings._forward_hooks):
        embeddings._forward_hooks.pop(hook_id)
    report = verify(model, make_batch("llama"))
    gradients = report.check("gradients")
    assert not gradients.ok and "reentrant checkpointing with block inputs that do not require grad" in gradients.detail


def test_meter_counts_frozen_weights_without_gradients_or_optimizer_state(load_model):
    from peft import get_peft_model

    model = prepare_model(get_peft_model(load_model("llama"), _lora("llama")), "bf16+ckpt")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    m = measure_step(model, make_batch("llama", batch_size=4, seq=32), opt, timed=False)
    trainable_bytes = sum(p.numel() * 4 for p in trainable)
    total_bytes = sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    assert m.parameters == total_bytes
    assert m.gradients <= trainable_bytes and m.optimizer <= 2 * trainable_bytes + 64 * len(trainable)
    assert m.optimizer >= 2 * trainable_bytes  # two fp32 moments for the adapters only


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("policy", ["bf16", "bf16+ckpt"])
def test_lora_estimate_within_ten_percent_of_the_meter(load_model, pretrained_dirs, arch, policy):
    from peft import get_peft_model

    est = estimate_memory(pretrained_dirs[arch], policy, batch_size=4, seq_len=32, trainable=_lora(arch))
    model = prepare_model(get_peft_model(load_model(arch), _lora(arch)), policy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    real = measure_step(model, make_batch(arch, batch_size=4, seq=32), opt, timed=False)
    assert est.parameters == real.parameters and est.trainable_parameters < est.total_parameters
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.10, (est.peak_bytes, real.peak_bytes)
    full = estimate_memory(pretrained_dirs[arch], policy, batch_size=4, seq_len=32)
    assert est.gradients + est.optimizer < 0.5 * (full.gradients + full.optimizer)


@pytest.mark.parametrize(
    "trainable, error, fragment",
    [
        (5, TypeError, r"trainable=5 \(int\) must be 'all', 'lora', a PEFT config"),
        ("adapters", ValueError, "trainable='adapters' is not one of 'all', 'lora'"),
        ({"rank": 8}, ValueError, r"trainable=\{'rank': 8\} is not a valid LoraConfig"),
        ({"target_modules": ["nope"]}, ValueError, r"does not fit LlamaForCausalLM.*linear layers are named .*q_proj"),
    ],
)
def test_estimate_trainable_bad_input(pretrained_dirs, trainable, error, fragment):
    with pytest.raises(error, match=fragment):
        estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=1, seq_len=16, trainable=trainable)


def test_estimate_trainable_lora_and_dict(pretrained_dirs):
    lora = estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=1, seq_len=16, trainable="lora")
    wide = estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=1, seq_len=16, trainable={"r": 16})
    assert 0 < lora.trainable_parameters < wide.trainable_parameters < lora.total_parameters


def test_plain_stack_lora_without_transformers(tmp_path):
    from peft import PeftModel, get_peft_model

    torch.manual_seed(0)
    model = prepare_model(get_peft_model(PlainStack(), _lora("plain")), "ckpt")
    assert record_of(model).checkpointing.method == "torch"
    assert verify(model, make_batch("plain")).ok
    model.save_pretrained(tmp_path)
    torch.manual_seed(0)
    reloaded = PeftModel.from_pretrained(PlainStack(), tmp_path)
    assert set(_adapters(reloaded)) == set(_adapters(model))


def test_estimate_reads_what_trains_from_a_peft_model_and_an_adapter_directory(load_model, pretrained_dirs, tmp_path):
    from peft import get_peft_model

    base = type(load_model("llama")).from_pretrained(pretrained_dirs["llama"])
    peft_model = get_peft_model(base, _lora("llama"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    from_object = estimate_memory(peft_model, "bf16", batch_size=2, seq_len=16)
    assert from_object.trainable_parameters == trainable
    peft_model.save_pretrained(tmp_path / "adapter")  # adapter_config.json names the base directory
    from_directory = estimate_memory(tmp_path / "adapter", "bf16", batch_size=2, seq_len=16)
    assert from_directory.trainable_parameters == trainable and from_directory.peak_bytes == from_object.peak_bytes
    frozen = load_model("llama")
    frozen.get_input_embeddings().weight.requires_grad_(False)
    with pytest.warns(UserWarning, match="has frozen parameters, but the estimate builds it from its config"):
        estimate_memory(frozen, "bf16", batch_size=2, seq_len=16)
