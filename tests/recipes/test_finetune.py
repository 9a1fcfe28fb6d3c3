"""The fine-tuning recipe on its happy paths, run for real: in process for most cases, through
`accelerate launch` and `torchrun` in subprocesses for the launch paths."""

import json
from pathlib import Path

import pytest
import torch
from recipe_utils import (
    ACCELERATE,
    ACCELERATE_FSDP,
    AUTO_BATCH,
    RECIPE,
    ROOT,
    assert_same_weights,
    launch,
    lm_args,
    read_report,
    torchrun,
)


@pytest.mark.slow
def test_default_run_learns(recipe, tmp_path):
    """The embedded default (real pretrained MiniLM-L6 on the shipped topics data), shortened."""
    out = tmp_path / "out"
    report = recipe.main(["--output-dir", str(out), "--max-steps", "16", "--log-every", "4", "--eval-every", "8"])
    assert report["task"] == "classification" and report["precision"] in ("bf16", "fp32")
    assert report["last_logged_loss"] < 0.85 * report["first_logged_loss"], report["history"]
    assert report["final_metrics"]["eval_accuracy"] > 0.6  # 4 classes: chance is 0.25
    assert json.loads((out / "report.json").read_text())["steps"] == 16
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    # run_config.yaml is a config file: it reproduces the run's settings.
    again = recipe.parse_config(["--config", str(out / "run_config.yaml")])
    assert again == recipe.parse_config(
        ["--output-dir", str(out), "--max-steps", "16", "--log-every", "4", "--eval-every", "8"]
    )


def test_saved_model_loads_and_reproduces_eval(recipe, tiny_lm, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    report = recipe.main(lm_args(tiny_lm, out, "--max-steps", "8", "--memory-plot"))
    assert report["last_logged_loss"] < report["first_logged_loss"]
    assert (out / "memory.png").stat().st_size > 1000
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    # Recompute the validation loss with the reloaded model: it must equal the recipe's own.
    cfg = recipe.parse_config(lm_args(tiny_lm, out))
    train, val, task, _ = recipe.load_raw_data(cfg)
    tok = recipe.load_tokenizer(cfg, str(out / "model"))
    _, val_ds, _ = recipe.tokenize(train, val, task, tok, cfg)
    batches = [
        recipe.collate(tok)([val_ds[j] for j in range(i, min(i + 8, len(val_ds)))]) for i in range(0, len(val_ds), 8)
    ]
    with torch.no_grad():
        loss = sum(model(**b).loss.item() for b in batches) / len(batches)
    assert loss == pytest.approx(report["final_metrics"]["eval_loss"], rel=1e-5)


def test_prompt_response_masks_the_prompt(recipe, tiny_lm, tmp_path):
    cfg = recipe.parse_config(
        lm_args(tiny_lm, tmp_path / "o", "--prompt-field", "prompt", "--response-field", "response")
    )
    train, val, task, _ = recipe.load_raw_data(cfg)
    assert task == "causal-lm"
    tok = recipe.load_tokenizer(cfg, str(tiny_lm["model"]))
    train_ds, _, _ = recipe.tokenize(train, val, task, tok, cfg)
    row = train_ds[0]
    n_prompt = len(tok(train[0]["prompt"] + "\n", add_special_tokens=False)["input_ids"])
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    report = recipe.main(
        lm_args(
            tiny_lm, tmp_path / "pr", "--prompt-field", "prompt", "--response-field", "response", "--max-steps", "6"
        )
    )
    assert report["steps"] == 6


def test_wrapped_packing_fills_blocks(recipe, tiny_lm, tmp_path):
    cfg = recipe.parse_config(lm_args(tiny_lm, tmp_path / "o", "--packing", "wrapped"))
    train, val, task, _ = recipe.load_raw_data(cfg)
    train_ds, _, _ = recipe.tokenize(train, val, task, recipe.load_tokenizer(cfg, str(tiny_lm["model"])), cfg)
    assert {len(r["input_ids"]) for r in train_ds} == {16}


def test_config_file_and_flags(recipe, tiny_lm, tmp_path):
    """Defaults <- YAML/JSON file <- flags, through HfArgumentParser; YAML's '2e-4' (a string to
    YAML 1.1) is typed by the flag; paths come back absolute."""
    yml = tmp_path / "run.yaml"
    yml.write_text(f"model: {tiny_lm['model']}\nlr: 2e-4\nbatch_size: 4\nseq_len: 16\noutput_dir: ./rel\n")
    cfg = recipe.parse_config(["--config", str(yml), "--seq-len", "8"])
    assert cfg.train.lr == 2e-4 and cfg.memory.batch_size == "4" and cfg.data.seq_len == 8 and cfg.train.epochs == 3.0
    assert cfg.output.output_dir == str((Path.cwd() / "rel").resolve())
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"lr": 1e-3, "epochs": 2, "packing": True}))
    cfg = recipe.parse_config(["--config", str(js)])
    assert (
        cfg.train.lr == 1e-3
        and cfg.train.epochs == 2.0
        and isinstance(cfg.train.epochs, float)
        and cfg.data.packing == "on"
    )


def test_shipped_config_is_the_embedded_default(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)  # its paths are relative to where the command runs: the repository root
    assert recipe.parse_config(["--config", "recipes/configs/finetune-default.yaml"]) == recipe.parse_config([])


def test_flags_grouped_and_saved_flat(recipe, capsys):
    """One --help group per dataclass, read as cfg.<group>.<flag>; the flat form (a --config file,
    run_config.yaml, a checkpoint's record) holds every flag once and reads back the same config."""
    from finetune_support.flags import GROUP_OF, GROUPS, FinetuneConfig

    with pytest.raises(SystemExit):
        recipe.parse_config(["--help"])
    text = capsys.readouterr().out
    for kind in GROUPS.values():
        assert f"\n{kind._argument_group_name}:\n" in text
    assert text.index("TrainArgs, cfg.train") < text.index("  --lr LR") < text.index("EvalArgs, cfg.eval")
    cfg = recipe.parse_config(["--lr", "1e-3", "--lora-r", "4", "--seed", "7"])
    assert (cfg.train.lr, cfg.lora.lora_r, cfg.train.seed) == (1e-3, 4, 7)
    flat = cfg.flat()
    assert list(flat) == list(GROUP_OF) and len(flat) == 44 and flat["lr"] == 1e-3
    assert FinetuneConfig.from_flat(flat) == cfg and cfg.replaced(lr=2e-4).train.lr == 2e-4
    with pytest.raises(TypeError, match="learning_rate"):
        FinetuneConfig.from_flat({"learning_rate": 1.0})


def test_resume_equals_uninterrupted(recipe, tiny_lm, tmp_path):
    common = ["--max-steps", "8", "--save-every", "4", "--global-batch-size", "16"]
    recipe.main(lm_args(tiny_lm, tmp_path / "full", *common))
    stopped = recipe.main(lm_args(tiny_lm, tmp_path / "cut", *common, "--stop-after", "4"))
    assert stopped["stopped_at"] == 4
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-0000004"]
    report = recipe.main(lm_args(tiny_lm, tmp_path / "cut", *common, "--resume-from", "latest"))
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
    # The history survives the interruption: the report covers steps 2..8 like the uninterrupted run's.
    assert (
        [h["step"] for h in report["history"]]
        == [h["step"] for h in read_report(tmp_path / "full")["history"]]
        == [2, 4, 6, 8]
    )
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-0000004", "step-0000008"]


def test_batch_size_auto_with_global_batch(recipe, tiny_lm, tmp_path):
    report = recipe.main(lm_args(tiny_lm, tmp_path / "auto", *AUTO_BATCH))
    bs, acc = report["batch_size"], report["grad_accum"]
    assert 1 <= bs and acc == -(-64 // bs)


def test_policy_auto_with_budget_uses_the_planner(recipe, tiny_lm, tmp_path, capsys):
    args = lm_args(tiny_lm, tmp_path / "plan", "--max-steps", "2")
    args[args.index("--policy") + 1] = "auto"
    report = recipe.main([*args, "--memory-budget", "1GiB"])
    from hf_memstack.transforms.precision.apply import resolve_precision

    mixed = resolve_precision("auto", "cpu").name  # bf16 on CPUs with native bf16, else fp32
    assert report["policy"] == mixed  # generous: the plain rung in this CPU's mixed precision
    assert f"choose: {mixed} at" in capsys.readouterr().out


# ----------------------------------------------------------------------------- launch paths


@pytest.mark.slow
def test_accelerate_launch_single_process(tiny_lm, tmp_path):
    out = tmp_path / "out"
    launch([*ACCELERATE, "--num_processes", "1", "--cpu", RECIPE, *lm_args(tiny_lm, out, "--max-steps", "4")])
    report = read_report(out)
    assert report["steps"] == 4 and report["world_size"] == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_processes_on_cpu(tiny_lm, tmp_path):
    out = tmp_path / "out"
    torchrun(tiny_lm, out, "--max-steps", "4", "--policy", "bf16+ckpt")
    report = read_report(out)
    assert report["world_size"] == 2 and report["steps"] == 4 and report["route"] == "none"
    assert report["last_logged_loss"] < report["first_logged_loss"]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_processes_with_fsdp_policy(tiny_lm, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    torchrun(tiny_lm, out, "--max-steps", "6", "--policy", "fp32+ckpt+fsdp")
    report = read_report(out)
    assert (
        report["world_size"] == 2
        and report["policy"] == "fp32+ckpt+fsdp:full_shard"
        and report["route"] == "fully_shard"
    )
    # On CPU prepare_model shards (Accelerate 1.15 has no CPU FSDP); only rank 0 read the weights.
    assert report["fsdp"]["by"] == "fully_shard" and report["fsdp"]["weights_from"] == "rank 0 broadcast"
    assert report["last_logged_loss"] < report["first_logged_loss"]
    # The full model was gathered from both ranks and loads in one process.
    assert type(AutoModelForCausalLM.from_pretrained(out / "model")).__name__ == "LlamaForCausalLM"


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_resume_equals_uninterrupted(tiny_lm, tmp_path):
    # 6 steps of batch 4 x 2 ranks with 2 accumulation steps (global batch 16), saved at step 3.
    common = [
        "--max-steps",
        "6",
        "--save-every",
        "3",
        "--policy",
        "fp32+fsdp",
        "--batch-size",
        "4",
        "--global-batch-size",
        "16",
    ]
    torchrun(tiny_lm, tmp_path / "full", *common)
    cut = tmp_path / "cut"
    torchrun(tiny_lm, cut, *common, "--stop-after", "3")
    assert (cut / "checkpoints" / "step-0000003" / "sharded").is_dir()
    assert (cut / "checkpoints" / "step-0000003" / "checkpoint.json").is_file()
    torchrun(tiny_lm, cut, *common, "--resume-from", "latest")
    report = read_report(cut)
    assert report["grad_accum"] == 2 and report["steps"] == 6
    assert_same_weights(tmp_path / "full", cut)


def test_fsdp_launch_config_without_fsdp_policy(recipe, tiny_lm, tmp_path, capsys, monkeypatch):
    # What `accelerate launch --config_file recipes/configs/fsdp.yaml` puts in the environment.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "out"
    with pytest.raises(recipe.RecipeError, match=r"Accelerate FSDP config but policy='bf16\+ckpt' has no fsdp"):
        recipe.main(lm_args(tiny_lm, out, "--policy", "bf16+ckpt"))
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.slow
def test_accelerate_launch_fsdp_plugin_on_gpu(tiny_lm, tmp_path):
    """On a GPU the recipe shards through Accelerate's FSDP2 plugin built from the policy: its
    prepare, backward, clipping and (sharded) save_state run; the saved model loads in one process;
    a resume from the sharded checkpoint continues."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    launch(
        [
            *ACCELERATE_FSDP,
            *lm_args(tiny_lm, out, "--max-steps", "6", "--save-every", "3", "--policy", "bf16+ckpt+fsdp"),
        ]
    )
    report = read_report(out)
    assert report["fsdp"]["by"].startswith("accelerator.prepare") and report["route"] == "accelerate"
    assert report["last_logged_loss"] < report["first_logged_loss"]
    assert (out / "checkpoints" / "step-0000006" / "checkpoint.json").is_file()
    assert type(AutoModelForCausalLM.from_pretrained(out / "model")).__name__ == "LlamaForCausalLM"
