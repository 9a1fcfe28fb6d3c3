"""The recipe with a 4-bit base (--policy ...+quant:nf4 --lora-r): it learns, saves only the adapters,
resumes exactly, merges into a 16-bit model that computes what the 4-bit model computed, and refuses
4-bit weights without adapters before loading anything."""

from __future__ import annotations

import pytest
import torch
from recipe_utils import fails, lm_args, read_report, run, snapshot
from safetensors.torch import load_file

pytest.importorskip("torchao")
pytest.importorskip("peft")

QLORA = [
    "--policy",
    "fp32+quant:nf4",
    "--lora-r",
    "8",
    "--lora-target",
    "q_proj,v_proj,up_proj,down_proj",
    "--lr",
    "3e-2",
]


def test_qlora_learns_saves_adapters_and_merges_16_bit(recipe, tiny_lm, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_memstack import prepare_model

    out = tmp_path / "qlora"
    report = run(recipe, lm_args(tiny_lm, out, *QLORA, "--max-steps", "12", "--merge-lora"))
    assert report["policy"].endswith("quant:nf4"), report["policy"]
    assert report["last_logged_loss"] < 0.9 * report["first_logged_loss"], report["history"]
    files = {p.name for p in (out / "model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "merged"} <= files and "model.safetensors" not in files
    saved = load_file(out / "model" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)  # no 4-bit base weights in the adapters file
    # The reference: the base quantized the same way, the saved adapters on it (what training saw).
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        base = prepare_model(
            AutoModelForCausalLM.from_pretrained(tiny_lm["model"], dtype=torch.float32), "fp32+quant:nf4"
        )
        four_bit = PeftModel.from_pretrained(base, out / "model").eval()
        merged = AutoModelForCausalLM.from_pretrained(out / "model" / "merged").eval()
        plain = AutoModelForCausalLM.from_pretrained(tiny_lm["model"]).eval()
        assert merged.dtype == torch.float32  # fp32 policy: merged in fp32, no rounding beyond the 4-bit one
        assert torch.allclose(four_bit(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
        assert not torch.allclose(plain(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-3)


def test_qlora_resume_equals_uninterrupted(recipe, tiny_lm, tmp_path):
    common = [*QLORA, "--max-steps", "6", "--save-every", "2"]  # saves on the log steps (log every 2)
    run(recipe, lm_args(tiny_lm, tmp_path / "full", *common))
    assert run(recipe, lm_args(tiny_lm, tmp_path / "cut", *common, "--stop-after", "4"))["stopped_at"] == 4
    run(recipe, lm_args(tiny_lm, tmp_path / "cut", *common, "--resume-from", "latest"))
    full, cut = (load_file(tmp_path / d / "model" / "adapter_model.safetensors") for d in ("full", "cut"))
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    losses = [[h["loss"] for h in read_report(tmp_path / d)["history"]] for d in ("full", "cut")]
    assert losses[0] == losses[1]


def test_a_4bit_base_without_adapters_is_refused_before_loading(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "out"
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--policy", "fp32+quant:nf4"),
        capsys,
        "keeps the base weights in 4 bits, which cannot be trained",
        "--lora-r 16",
    )
    assert snapshot(out) == before


def test_resuming_a_4bit_run_from_a_dense_runs_checkpoint_is_refused_naming_the_keys(recipe, tiny_lm, tmp_path, capsys):
    """A checkpoint holding other weights than this 4-bit run's (here a dense LoRA run's, which saves
    the base too) is refused before anything loads, and left as it was."""
    dense = [*QLORA[2:], "--max-steps", "4", "--save-every", "2", "--stop-after", "2"]
    run(recipe, lm_args(tiny_lm, tmp_path / "dense", *dense))
    checkpoint = next((tmp_path / "dense" / "checkpoints").glob("step-*"))
    before = snapshot(checkpoint)
    fails(
        recipe,
        lm_args(
            tiny_lm,
            tmp_path / "q",
            *QLORA,
            "--max-steps",
            "4",
            "--resume-from",
            str(checkpoint),
            "--allow-config-change",
        ),
        capsys,
        "does not hold this run's trainable weights",
        "unexpected",
    )
    assert snapshot(checkpoint) == before
