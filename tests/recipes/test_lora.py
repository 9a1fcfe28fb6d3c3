"""The recipe with LoRA (--lora-r): it learns, saves the adapters alone (and merged on request),
resumes exactly, and refuses LoRA settings that cannot work before writing anything."""

from __future__ import annotations

import pytest
import torch
from recipe_utils import fails, lm_args, read_report, run, snapshot
from safetensors.torch import load_file

LORA = ["--lora-r", "8", "--lora-target", "q_proj,v_proj,up_proj,down_proj", "--lr", "3e-2"]


def _adapters(out):
    return load_file(out / "model" / "adapter_model.safetensors")


def test_lora_learns_saves_adapters_and_merges(recipe, tiny_lm, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    report = run(recipe, lm_args(tiny_lm, out, *LORA, "--max-steps", "12", "--merge-lora"))
    assert report["last_logged_loss"] < 0.9 * report["first_logged_loss"], report["history"]
    assert report["lora"]["r"] == 8 and 0 < report["trainable_parameters"] < 0.5 * sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_lm["model"]).parameters()
    )
    files = {p.name for p in (out / "model").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "merged"} <= files and "model.safetensors" not in files
    saved = _adapters(out)
    assert saved and all("lora_" in k for k in saved)
    # The adapters reload onto the base model; merged into its weights they give the same logits.
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_lm["model"]), out / "model").eval()
        merged = AutoModelForCausalLM.from_pretrained(out / "model" / "merged").eval()
        base = AutoModelForCausalLM.from_pretrained(tiny_lm["model"]).eval()
        assert torch.allclose(peft(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)
        assert not torch.allclose(
            base(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-3
        )  # it learned something


def test_lora_resume_equals_uninterrupted(recipe, tiny_lm, tmp_path):
    common = [*LORA, "--max-steps", "8", "--save-every", "4", "--global-batch-size", "16"]
    run(recipe, lm_args(tiny_lm, tmp_path / "full", *common))
    assert run(recipe, lm_args(tiny_lm, tmp_path / "cut", *common, "--stop-after", "4"))["stopped_at"] == 4
    run(recipe, lm_args(tiny_lm, tmp_path / "cut", *common, "--resume-from", "latest"))
    full, cut = _adapters(tmp_path / "full"), _adapters(tmp_path / "cut")
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    losses = [[h["loss"] for h in read_report(tmp_path / run_dir)["history"]] for run_dir in ("full", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 4


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--lora-r", "4", "--lora-target", "nope"], ("lora_target='nope' does not fit", "q_proj")),
        (["--lora-r", "-1"], ("lora_r=-1 must be >= 0",)),
        (["--merge-lora"], ("--merge-lora given without --lora-r",)),
        (["--lora-target", "q_proj"], ("--lora-target given without --lora-r",)),
        (["--lora-r", "4", "--lora-dropout", "1.5"], ("lora_dropout=1.5 must be in [0, 1)",)),
        (["--lora-r", "4", "--lora-alpha", "0"], ("lora_alpha=0.0 must be a positive number",)),
        (["--lora-r", "4", "--policy", "fp32+fsdp"], ("LoRA under FSDP is not supported",)),
    ],
    ids=["target-nothing", "rank-negative", "merge-without-lora", "target-without-lora", "dropout", "alpha", "fsdp"],
)
def test_lora_bad_input_writes_nothing(recipe, tiny_lm, tmp_path, capsys, extra, fragments):
    out = tmp_path / "out"
    before = snapshot(out)
    fails(recipe, lm_args(tiny_lm, out, "--max-steps", "2", *extra), capsys, *fragments)
    assert snapshot(out) == before
