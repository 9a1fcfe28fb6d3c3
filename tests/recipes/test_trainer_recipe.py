"""recipes/trainer.py on a causal LM: padded batches or --packing (whole samples in --seq_len rows,
collated by PackedCollator), prompt tokens left unlearnt, and --packing refused where it cannot apply."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from recipe_utils import ROOT, reset_accelerate


@pytest.fixture
def trainer_recipe():
    spec = importlib.util.spec_from_file_location("trainer_recipe", ROOT / "recipes" / "trainer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # HfArgumentParser reads the dataclass's module
    spec.loader.exec_module(module)
    reset_accelerate()
    yield module
    reset_accelerate()


@pytest.fixture
def varied(tiny_lm, tmp_path):
    """Samples of 1 to 8 of the tiny LM's words, as text and as prompt/response."""
    words = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
    path = tmp_path / "varied.jsonl"
    rows = []
    for i in range(160):
        text = " ".join(words[(i + j) % len(words)] for j in range(1 + (i * 5) % 8))
        rows.append({"text": text, "prompt": words[i % len(words)], "response": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _varied_args(tiny_lm, varied, out, policy, steps, *extra) -> list[str]:
    """The script's flags for ``steps`` steps of the tiny LM on the varied samples (rows of 32, batches of 4)."""
    return [
        *("--model", str(tiny_lm["model"]), "--dataset", str(varied), "--seq_len", "32", "--policy", policy),
        *("--max_steps", str(steps), "--per_device_train_batch_size", "4", "--output_dir", str(out), *extra),
    ]


def test_packed_lora_run_verifies_the_rows_and_pads_less(trainer_recipe, tiny_lm, varied, tmp_path, capsys):
    out = tmp_path / "out"
    metrics = trainer_recipe.main(_varied_args(tiny_lm, varied, out, "fp32", 3, "--packing", "--lora_r", "4"))
    printed = capsys.readouterr().out
    packed, padded = map(
        float, re.search(r"packing: .* rows of 32: ([\d.]+)% padding, against ([\d.]+)% in padded", printed).groups()
    )
    assert packed < padded / 2, printed
    # The callback's verify ran on the first packed batch (its packing check compares each row with its samples alone).
    assert metrics["memstack/verify_ok"] == 1.0 and metrics["eval_loss"] < 10
    assert (out / "adapter_config.json").exists()


def test_prompt_tokens_are_not_learnt(trainer_recipe, tiny_lm, varied):
    from transformers import AutoTokenizer

    script = trainer_recipe.ScriptArguments(
        model=str(tiny_lm["model"]), dataset=str(varied), prompt_field="prompt", seq_len=32
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_lm["model"])
    encoded = trainer_recipe._lm_encoder(script, tokenizer)({"prompt": ["cat sat"], "response": ["on a mat"]})
    prompt = tokenizer("cat sat\n", add_special_tokens=False)["input_ids"]
    assert encoded["labels"][0][: len(prompt)] == [-100] * len(prompt)
    assert encoded["labels"][0][len(prompt) :] == encoded["input_ids"][0][len(prompt) :] != []


def test_packing_a_classification_dataset_is_refused(trainer_recipe, tmp_path):
    data = ROOT / "recipes" / "data" / "topics.jsonl"
    before = data.read_bytes()
    with pytest.raises(SystemExit, match=r"packing=True only applies to causal-lm.*drop --packing"):
        trainer_recipe.main(["--dataset", str(data), "--packing", "--output_dir", str(tmp_path / "out")])
    assert data.read_bytes() == before and not (tmp_path / "out").exists()


def test_prompts_filling_every_token_and_empty_files_are_refused(trainer_recipe, tiny_lm, tmp_path):
    """Trial findings (issue 22): prompts longer than --seq_len trained on nothing (loss 0, eval nan)
    and saved a model; an empty file ended in datasets' StopIteration."""
    words = "the cat sat on a mat dog ran to park".split()
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt": " ".join(words * 4), "response": "cat"}) + "\n" for _ in range(20)))
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"training row 1: the prompt fills all --seq_len=8 tokens.*raise --seq_len"):
        trainer_recipe.main(
            [
                "--model",
                str(tiny_lm["model"]),
                "--dataset",
                str(long),
                "--prompt_field",
                "prompt",
                "--packing",
                "--seq_len",
                "8",
                "--output_dir",
                str(out),
            ]
        )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=r"dataset='.*empty.jsonl' (could not be read|has 0 row).*"):
        trainer_recipe.main(["--model", str(tiny_lm["model"]), "--dataset", str(empty), "--output_dir", str(out)])
    assert not out.exists()


@pytest.mark.filterwarnings("ignore:policy.precision='bf16' on a CPU without:UserWarning")
def test_pure_bf16_trains_through_trainer_with_the_policys_optimizer(
    trainer_recipe, tiny_lm, varied, tmp_path, monkeypatch
):
    """weights:bf16 through Trainer: the recipe passes make_optimizer's BF16AdamW (Trainer's own AdamW
    is refused by the callback under that policy), over the bf16 weights."""
    import torch
    from transformers import Trainer

    from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW

    seen = {}
    original = Trainer.create_optimizer

    def spy(self):
        seen["optimizer"] = original(self)
        return seen["optimizer"]

    monkeypatch.setattr(Trainer, "create_optimizer", spy)
    metrics = trainer_recipe.main(_varied_args(tiny_lm, varied, tmp_path / "out", "bf16+weights:bf16", 4))
    assert isinstance(seen["optimizer"], BF16AdamW)
    assert {p.dtype for g in seen["optimizer"].param_groups for p in g["params"]} == {torch.bfloat16}
    assert metrics["eval_loss"] < 10
