"""estimate_memory / plan_policy / the CLI on vision-language models: built whole (vision tower and
language model), traced with pixel inputs sized from the config, within 10% of the meter's real step."""

import json

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

from hf_memstack import estimate_memory, measure_step, plan_policy, prepare_model
from hf_memstack.cli.main import main
from hf_memstack.planning.model.vision_inputs import image_batch, images_for, pixel_tensors

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
}
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "image_size": 56, "patch_size": 14}
QWEN_TEXT = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
QWEN_IDS = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}


def vlm_config(family):
    """A tiny config of each family: 2 vision blocks and 4 text blocks (Mllama: 2 of them cross-attention)."""
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14}
        return CONFIG_MAPPING[family](text_config=QWEN_TEXT, vision_config=vision, **QWEN_IDS)
    if family == "qwen2_5_vl":
        vision = {"depth": 2, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2, "intermediate_size": 64}
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
        return CONFIG_MAPPING[family](text_config=QWEN_TEXT, vision_config=vision, **QWEN_IDS)
    if family in ("llava", "llava_next"):
        vision = {"model_type": "clip_vision_model", **TOWER, "num_attention_heads": 2, "projection_dim": 32}
        extra = {"image_grid_pinpoints": [[56, 112], [112, 56], [112, 112]]} if family == "llava_next" else {}
        text = {"model_type": "llama", **TEXT}
        return CONFIG_MAPPING[family](text_config=text, vision_config=vision, image_token_index=250, **extra)
    if family == "gemma3":
        text = {**TEXT, "head_dim": 16, "sliding_window": 64}
        ids = {"image_token_index": 250, "boi_token_index": 251, "eoi_token_index": 252}
        return CONFIG_MAPPING[family](
            text_config=text, vision_config={**TOWER, "num_attention_heads": 2}, mm_tokens_per_image=4, **ids
        )
    if family == "mllama":
        text = {**TEXT, "cross_attention_layers": [1, 3], "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        vision = {**TOWER, "num_global_layers": 1, "attention_heads": 2, "vision_output_dim": 96}
        vision["intermediate_layers_indices"] = [0, 1]
        return CONFIG_MAPPING[family](text_config=text, vision_config=vision, image_token_index=250)
    if family in ("idefics3", "smolvlm"):
        tower = {**TOWER, "num_attention_heads": 2}
        return CONFIG_MAPPING[family](
            text_config={"model_type": "llama", **TEXT}, vision_config=tower, scale_factor=2, image_token_id=250
        )
    return CONFIG_MAPPING[family]()


ESTIMATED = ["qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3", "mllama"]
# Qwen's tower takes any size: 56 pixels keep its patch-major rows few (16 patches, 4 tokens an image).
IMAGE_SIZE = {"qwen2_vl": 56, "qwen2_5_vl": 56}


def _measured(config, policy, batch, seq, images):
    """The meter's peak of a real step on the real model, with a batch of real pixels of the sizes estimated
    (the model's own forward checks that its image tokens match the features the pixels make)."""
    torch.manual_seed(0)
    model = prepare_model(AutoModelForImageTextToText.from_config(config).train(), policy)
    ints, floats = image_batch(config, images, batch, seq)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, measure_step(model, {**ints, **pixel_tensors(floats)}, opt, timed=False)


@pytest.mark.parametrize("family", ESTIMATED)
def test_vlm_estimate_within_ten_percent_of_the_meter(family):
    config = vlm_config(family)
    size = IMAGE_SIZE.get(family)
    images = images_for(config, size, 2, 10**6)
    seq = images.image_tokens + 24
    est = estimate_memory(config, "bf16", batch_size=2, seq_len=seq, image_size=size, images_per_sample=2, device="cpu")
    model, real = _measured(config, "bf16", 2, seq, images)
    # Both towers built and counted: every parameter of the image-text-to-text model, none left out.
    assert est.total_parameters == sum(p.numel() for p in model.parameters())
    assert est.parameters == real.parameters
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.10, (est.peak_bytes, real.peak_bytes)
    assert any(n.startswith("images: 2 per sample") for n in est.notes), est.notes


def test_qwen2_vl_from_the_model_object_with_task_causal_lm():
    # Refused before: "has no causal-lm model in Transformers", even with task='causal-lm'.
    config = vlm_config("qwen2_vl")
    model = AutoModelForImageTextToText.from_config(config)
    est = estimate_memory(model, "fp32", batch_size=1, seq_len=64, task="causal-lm", image_size=112, device="cpu")
    assert est.total_parameters == sum(p.numel() for p in model.parameters())
    # 112 pixels: 8 x 8 patches of 14, merged 2 x 2 into 16 image tokens, 64 patch rows.
    assert any("16 image tokens" in n and "64 patches" in n for n in est.notes), est.notes
    images = images_for(config, 112, 1, 64)
    batch, pixels = image_batch(config, images, 1, 64)
    assert pixels["pixel_values"][0] == 64 and int((batch["input_ids"] == 250).sum()) == 16


def test_gemma3_estimate_does_not_crash_on_its_composite_config():
    # Was AttributeError: 'Gemma3Config' object has no attribute 'vocab_size' (the CLI's exit 3).
    config = vlm_config("gemma3")
    est = estimate_memory(config, "bf16+ckpt", batch_size=2, seq_len=32, device="cpu")
    assert est.peak_bytes > est.parameters > 0
    # The default image is the tower's, said in the notes with where it came from.
    note = next(n for n in est.notes if n.startswith("images:"))
    assert "56x56" in note and "vision_config.image_size=56" in note and "4 image tokens" in note


def test_cli_estimate_and_plan_on_a_saved_vlm_folder(tmp_path, capsys):
    folder = tmp_path / "gemma3"
    vlm_config("gemma3").save_pretrained(folder)
    args = ["--seq-len", "48", "--image-size", "300", "--images-per-sample", "3", "--device", "cpu"]
    assert main(["estimate", str(folder), "--policy", "bf16,bf16+ckpt", "--batch-size", "2", "--json", *args]) == 0
    rows = json.loads(capsys.readouterr().out)["estimates"]
    assert len(rows) == 2 and rows[1]["peak_bytes"] < rows[0]["peak_bytes"]
    assert any("3 per sample of 300x300 pixels (image_size=)" in n for n in rows[0]["notes"]), rows[0]["notes"]
    assert main(["plan", str(folder), "--budget", "64MiB", *args]) == 0
    out = capsys.readouterr().out
    assert "choose: bf16" in out and "images: 3 per sample" in out


def test_plan_policy_answers_for_qwen2_vl():
    plan = plan_policy(vlm_config("qwen2_vl"), budget="64MiB", seq_len=64, image_size=56, device="cpu")
    assert plan.fits and plan.estimate is not None
    assert plan.images.startswith("images: 1 per sample of 56x56")


def test_qwen2_vl_images_scale_the_estimate():
    config = vlm_config("qwen2_vl")
    small, large = (
        estimate_memory(config, "fp32", batch_size=1, seq_len=200, image_size=s, device="cpu") for s in (56, 168)
    )
    assert large.activations > small.activations


@pytest.mark.parametrize("family", ["idefics3", "smolvlm", "paligemma"])
def test_unsupported_vlm_refused_naming_its_type_and_the_supported(family, capsys, tmp_path):
    config = vlm_config(family)
    with pytest.raises(ValueError, match=f"model_type='{family}'.*Supported vision-language models: qwen2_vl"):
        estimate_memory(config, "bf16", batch_size=1, seq_len=64)
    config.save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--batch-size", "1", "--seq-len", "64"]) == 2
    assert f"model_type='{family}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"image_size": 0}, "image_size=0 must be an integer of at least 1"),
        ({"images_per_sample": -1}, "images_per_sample=-1 must be an integer of at least 0"),
        ({"images_per_sample": 9, "seq_len": 40}, "seq_len=40 .* cannot hold the images of a sample"),
        ({"task": "classification"}, "task='classification' on Qwen2VLConfig"),
    ],
)
def test_bad_image_arguments_refused(kwargs, match):
    job = {"batch_size": 1, "seq_len": 64, "image_size": 56, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_memory(vlm_config("qwen2_vl"), "fp32", **job)


def test_image_arguments_on_a_text_model_refused():
    with pytest.raises(ValueError, match="image_size=56 given for LlamaConfig, which has no vision tower"):
        estimate_memory(vlm_config("llava").text_config, "fp32", batch_size=1, seq_len=64, image_size=56)


def test_text_only_step_of_a_vlm():
    est = estimate_memory(vlm_config("llava"), "fp32", batch_size=1, seq_len=32, images_per_sample=0, device="cpu")
    assert any("images: none" in n for n in est.notes)


def test_plan_advice_shorter_sequence_stops_at_the_image_tokens():
    # Half of seq_len=24 cannot hold an image of 112 pixels (17 tokens): no shorter sequence is advised,
    # where the advice's estimate at 12 tokens raised the image-tokens refusal out of plan_policy.
    from hf_memstack.planning.plan.advice import _shorter_sequence
    from hf_memstack.planning.plan.estimates import Estimates

    job = {"seq_len": 24, "world_size": 1, "task": "causal-lm", "trainable": "all", "dtype": torch.float32}
    est = Estimates(vlm_config("qwen2_vl"), **job, packed=False, device="cpu", image_size=112, images_per_sample=1)
    full = est("fp32", 1)
    assert _shorter_sequence(est, "fp32", full, 24, usable=full.peak_bytes / 2) is None


@pytest.mark.parametrize(
    "family, match",
    [
        ("gemma3", r"mm_tokens_per_image=256 must be the square of a divisor of the 14 patches a side"),
        ("qwen2_vl", r"vision_config.hidden_size=3584 .* must equal text_config.hidden_size=8192"),
    ],
)
def test_inconsistent_vision_fields_refused_by_name(family, match):
    # Transformers' default configs of these families do not build a working model: torch's error from
    # inside the forward ("stride should not be zero") was an internal error (exit 3).
    with pytest.raises(ValueError, match=match):
        estimate_memory(CONFIG_MAPPING[family](), "fp32", batch_size=1, seq_len=4096, device="cpu")


def test_seq_len_above_the_language_models_positions_refused():
    # The composite config has no max_position_embeddings: its text_config's limit was never checked.
    with pytest.raises(ValueError, match="seq_len=2048 is above the model's limit of 1024 positions"):
        estimate_memory(vlm_config("gemma3"), "fp32", batch_size=1, seq_len=2048)
