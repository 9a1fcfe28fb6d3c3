"""TRL's SFTTrainer on prepared models: the policy's precision holds under TRL's fused LM head,
TRL's default checkpointing flag keeps the policy's checkpointing, loss:chunked under TRL's head
is reported, and the callback measures the step that runs. Tiny Llama, in-memory data, no Hub."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memstack import prepare_model, verify
from hf_memstack.integrations.trainer import MemstackCallback

trl = pytest.importorskip("trl")

WORDS = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def _dataset():
    import datasets

    return datasets.Dataset.from_list(
        [{"text": " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(4 + i % 5))} for i in range(32)]
    )


def _config(tmp_path, **overrides):
    # TRL's defaults (bf16=True, gradient_checkpointing=True) unless overridden; use_cpu because
    # Transformers accepts bf16 without a GPU only when told it trains on the CPU.
    fields = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
        **overrides,
    }
    return trl.SFTConfig(**fields)


def _trainer(model, tokenizer, config, callbacks=None, peft_config=None):
    return trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=_dataset(),
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class _ForwardMatmuls(TorchDispatchMode):
    """The dtypes of every forward matmul's inputs, as the kernels receive them (after autocast)."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _MATMULS and torch._C._current_graph_task_id() == -1:  # not in a backward
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


# ----------------------------------------------------------------------------- precision under TRL


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_a_bf16_policy_trains_in_bf16_under_sft_trainer_with_bf16_false(load_model, word_tokenizer, tmp_path, peft):
    """TRL's fused LM head replaces model.forward and calls the backbone itself. With bf16=False
    nothing autocasts it but the callback: every forward matmul of the training steps runs in bf16,
    and the losses are those of TRL's own bf16 path (bf16=True: Accelerate's autocast around TRL's
    forward), not those of fp32 training."""

    def run(spec, callbacks, **overrides):
        model = prepare_model(load_model("llama"), spec)
        trainer = _trainer(
            model,
            word_tokenizer,
            _config(tmp_path, gradient_checkpointing=False, **overrides),
            callbacks=callbacks,
            peft_config=_lora() if peft else None,
        )
        seen = _ForwardMatmuls()
        with seen:
            trainer.train()
        return _losses(trainer), seen.dtypes

    callback = MemstackCallback(raise_on_failure=True)
    ours, dtypes = run("bf16", [callback], bf16=False)
    reference, reference_dtypes = run("bf16", None, bf16=True)
    fp32, _ = run("fp32", None, bf16=False)
    assert dtypes == reference_dtypes == {torch.bfloat16}, dtypes
    assert ours == pytest.approx(reference, abs=1e-6), (ours, reference)
    assert ours != pytest.approx(fp32, abs=1e-4), (ours, fp32)  # bf16 arithmetic, not fp32's
    # verify checked the forward that trains (TRL's fused head), and saw bf16 there.
    assert callback.first_step.verify.ok and "bfloat16" in callback.first_step.verify.check("precision").detail


def test_without_the_callback_a_bypassed_autocast_is_refused_before_any_step(load_model, word_tokenizer, tmp_path):
    model = prepare_model(load_model("llama"), "bf16")
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(model, word_tokenizer, _config(tmp_path, bf16=False, gradient_checkpointing=False))
    with pytest.raises(
        RuntimeError, match=r"outside hf_memstack's bf16 autocast.*TRL's fused LM head.*MemstackCallback.*bf16=True"
    ):
        trainer.train()
    assert trainer.state.global_step == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


# ----------------------------------------------------------------------------- TRL's default checkpointing


@pytest.mark.parametrize(
    "spec, recomputed", [("bf16+ckpt:2", [0]), ("bf16+ckpt:selective", [0, 1]), ("bf16+ckpt:offload", [0, 1])]
)
def test_default_sft_config_keeps_the_policy_checkpointing(load_model, word_tokenizer, tmp_path, spec, recomputed):
    """SFTConfig's gradient_checkpointing=True (its default) over a policy that checkpoints its own
    way: accepted, one warning, and Trainer's activation_checkpointing_enable changes nothing - the
    same blocks recompute the same FLOPs after training as before."""
    from tiny import make_batch

    model = prepare_model(load_model("llama"), spec)
    before = verify(model, make_batch("llama"))
    flags = [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(model, word_tokenizer, _config(tmp_path), callbacks=[MemstackCallback()])
        assert trainer.args.gradient_checkpointing  # TRL's default, untouched
        trainer.train()
    kept = [w for w in caught if "the policy's checkpointing is kept" in str(w.message)]
    assert len(kept) == 1, [str(w.message) for w in caught]
    after = verify(model, make_batch("llama"))
    assert before.recomputed_blocks == after.recomputed_blocks == recomputed
    assert after.recompute_flops == before.recompute_flops and after.ok, str(after)
    assert [getattr(m, "gradient_checkpointing", None) for m in model.modules()] == flags


def test_default_sft_config_over_a_policy_without_checkpointing_names_sft_config(load_model, word_tokenizer, tmp_path):
    model = prepare_model(load_model("llama"), "bf16")
    forward, flags = model.__dict__["forward"], [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    with pytest.raises(
        ValueError,
        match=r"SFTConfig\(gradient_checkpointing=True\) asks for checkpointing.*policy 'bf16' "
        r"\(no checkpointing\).*set SFTConfig\(gradient_checkpointing=False\).*'bf16\+ckpt'",
    ):
        _trainer(model, word_tokenizer, _config(tmp_path), callbacks=[MemstackCallback()])
    assert model.__dict__["forward"] is forward  # refused before TRL patched anything
    assert [getattr(m, "gradient_checkpointing", None) for m in model.modules()] == flags


# ----------------------------------------------------------------------------- loss:chunked under TRL


def test_chunked_loss_under_trl_is_reported_and_the_forward_that_trains_is_measured(
    load_model, word_tokenizer, tmp_path
):
    """TRL's fused head computes the loss instead of hf_memstack's chunked one: a warning says so,
    the losses are TRL's (the same as without loss:chunked), and the callback's memory figure is
    the meter's on TRL's forward (fused_lm_head=True), not on hf_memstack's chunked loss."""
    from hf_memstack import measure_step

    callback = MemstackCallback()
    model = prepare_model(load_model("llama"), "bf16+ckpt+loss:chunked")
    with pytest.warns(UserWarning, match="TRL's trainer computes the training loss with its own chunked LM head"):
        trainer = _trainer(model, word_tokenizer, _config(tmp_path), callbacks=[callback])
        trainer.train()
    plain = _trainer(prepare_model(load_model("llama"), "bf16+ckpt"), word_tokenizer, _config(tmp_path))
    plain.train()
    assert _losses(trainer) == pytest.approx(_losses(plain), abs=1e-6)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trl_forward = measure_step(model, {**batch, "fused_lm_head": True, "use_cache": False}, timed=False)
    ours = measure_step(model, batch, timed=False)  # without fused_lm_head: hf_memstack's chunked loss
    assert trl_forward.peak_bytes != ours.peak_bytes
    assert callback.first_step.memory.peak_bytes == trl_forward.peak_bytes
    logged = [h["memory/peak_mib"] for h in trainer.state.log_history if "loss" in h]
    assert logged and logged[0] * 2**20 > trl_forward.peak_bytes  # plus AdamW's state


def test_packed_sft_trainer_runs_with_the_callback_and_verify_checks_the_rows(load_model, word_tokenizer, tmp_path):
    """SFTConfig(packing=True): verify's packed-vs-alone comparison ran TRL's fused head without
    labels (TypeError at train start); it now compares the model's logits and reports the packing line."""
    callback = MemstackCallback()
    model = prepare_model(load_model("llama"), "fp32+ckpt")
    trainer = _trainer(
        model,
        word_tokenizer,
        _config(tmp_path, bf16=False, gradient_checkpointing=False, packing=True, padding_free=True, max_length=32),
        callbacks=[callback],
    )
    trainer.train()
    checks = {c.name: c for c in callback.first_step.verify.checks}
    assert "packing" in checks and checks["packing"].ok, callback.first_step.verify
    assert len(_losses(trainer)) == 2


# ----------------------------------------------------------------------------- a vision-language model


def _tiny_llava(tokenizer):
    """A tiny LLaVA (CLIP vision tower of 2 blocks, 2 Llama blocks) and its processor over the word
    tokenizer plus an <image> token: 28x28 images, 4 patches each. (Qwen2-VL's processor needs a
    video processor, which needs torchvision: not installed here.)"""
    from tiny import llama_config
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    config = LlavaConfig(
        text_config=llama_config(pad_token_id=0),
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).train(), processor


def _image_dataset():
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict(
        {
            "text": [f"{WORDS[i]} <image> {WORDS[i + 1]} {WORDS[i + 2]}" for i in range(8)],
            "images": [[Image.fromarray(rng.integers(0, 255, (28, 28, 3), dtype=np.uint8))] for _ in range(8)],
        }
    )


def test_sft_trainer_on_a_vlm_with_a_processor_trains_with_the_callback(word_tokenizer, tmp_path):
    """SFTTrainer with a processor (TRL's vision collator: pixel_values built per batch) on a prepared
    LLaVA: the callback's pass runs TRL's forward on the pixel batch, in bf16, and the losses are the
    unprepared trainer's."""

    def run(prepared):
        model, processor = _tiny_llava(word_tokenizer)
        callback = MemstackCallback() if prepared else None
        trainer = trl.SFTTrainer(
            model=prepare_model(model, "bf16") if prepared else model,
            args=_config(
                tmp_path, gradient_checkpointing=False, per_device_train_batch_size=2, remove_unused_columns=False
            ),
            train_dataset=_image_dataset(),
            processing_class=processor,
            callbacks=[callback] if callback else None,
        )
        trainer.train()
        return _losses(trainer), callback

    ours, callback = run(prepared=True)
    reference, _ = run(prepared=False)
    assert len(ours) == 2 and ours == pytest.approx(reference, abs=2e-3), (ours, reference)
    report = callback.first_step.verify
    assert report.check("policy").ok and report.check("precision").ok, report
    assert "bfloat16" in report.check("precision").detail and callback.first_step.memory.peak_bytes > 0
