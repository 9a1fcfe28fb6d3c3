"""The fine-tuning recipe, run for real: in-process for most cases, through `accelerate launch`
and `torchrun` in subprocesses for the launch paths."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "finetune.py"


@pytest.fixture
def recipe():
    from accelerate.state import AcceleratorState

    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    AcceleratorState._reset_state(True)
    yield module
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer fitted to a small text file (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny_lm")
    words = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
    lines = [" ".join(words[(i * 3 + j) % len(words)] for j in range(8)) for i in range(120)]
    data = root / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t, "prompt": t[:11], "response": t[12:]}) + "\n" for t in lines))
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    model_dir = root / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=len(vocab), max_position_embeddings=32,
                                 pad_token_id=1, eos_token_id=2, bos_token_id=2)).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    return {"model": model_dir, "data": data}


def lm_args(tiny_lm, out, *extra):
    return ["--model", str(tiny_lm["model"]), "--dataset", str(tiny_lm["data"]), "--output-dir", str(out), "--seq-len", "16",
            "--batch-size", "8", "--lr", "3e-3", "--policy", "fp32", "--log-every", "2", "--eval-every", "0", *extra]


def test_default_run_learns(recipe, tmp_path):
    """The embedded default (real pretrained MiniLM-L6 on the shipped topics data), shortened."""
    report = recipe.main(["--output-dir", str(tmp_path / "out"), "--max-steps", "24", "--log-every", "4", "--eval-every", "12"])
    assert report["task"] == "classification" and report["precision"] in ("bf16", "fp32")
    assert report["last_logged_loss"] < 0.7 * report["first_logged_loss"], report["history"]
    assert report["final_metrics"]["eval_accuracy"] > 0.6  # 4 classes: chance is 0.25
    out = tmp_path / "out"
    assert json.loads((out / "report.json").read_text())["steps"] == 24
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()
    assert (out / "run_config.yaml").is_file()


def test_saved_model_loads_and_reproduces_eval(recipe, tiny_lm, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    report = recipe.main(lm_args(tiny_lm, out, "--max-steps", "8", "--memory-plot"))
    assert report["last_logged_loss"] < report["first_logged_loss"]
    assert (out / "memory.png").stat().st_size > 1000
    model = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    # Recompute the validation loss with the reloaded model: it must equal the recipe's own.
    cfg = recipe.parse_config(lm_args(tiny_lm, out))
    train, val, task = recipe.load_raw_data(cfg)
    tok = recipe.load_tokenizer(cfg, str(out / "model"))
    _, val_ds, _ = recipe.tokenize(train, val, task, tok, cfg)
    batches = [recipe.collate(tok)([val_ds[j] for j in range(i, min(i + 8, len(val_ds)))]) for i in range(0, len(val_ds), 8)]
    with torch.no_grad():
        loss = sum(model(**b).loss.item() for b in batches) / len(batches)
    assert loss == pytest.approx(report["final_metrics"]["eval_loss"], rel=1e-5)


def test_prompt_response_masks_the_prompt(recipe, tiny_lm, tmp_path):
    cfg = recipe.parse_config(lm_args(tiny_lm, tmp_path / "o", "--prompt-field", "prompt", "--response-field", "response"))
    train, val, task = recipe.load_raw_data(cfg)
    assert task == "causal-lm"
    tok = recipe.load_tokenizer(cfg, str(tiny_lm["model"]))
    train_ds, _, _ = recipe.tokenize(train, val, task, tok, cfg)
    row = train_ds[0]
    n_prompt = len(tok(train[0]["prompt"] + "\n", add_special_tokens=False)["input_ids"])
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    report = recipe.main(lm_args(tiny_lm, tmp_path / "pr", "--prompt-field", "prompt", "--response-field", "response", "--max-steps", "6"))
    assert report["steps"] == 6


def test_packing_fills_blocks(recipe, tiny_lm, tmp_path):
    cfg = recipe.parse_config(lm_args(tiny_lm, tmp_path / "o", "--packing"))
    train, val, task = recipe.load_raw_data(cfg)
    train_ds, _, _ = recipe.tokenize(train, val, task, recipe.load_tokenizer(cfg, str(tiny_lm["model"])), cfg)
    assert {len(r["input_ids"]) for r in train_ds} == {16}


def test_resume_equals_uninterrupted(recipe, tiny_lm, tmp_path):
    from safetensors.torch import load_file

    common = ["--max-steps", "8", "--save-every", "4", "--global-batch-size", "16"]
    recipe.main(lm_args(tiny_lm, tmp_path / "full", *common))
    stopped = recipe.main(lm_args(tiny_lm, tmp_path / "cut", *common, "--stop-after", "4"))
    assert stopped["stopped_at"] == 4
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-0000004"]
    recipe.main(lm_args(tiny_lm, tmp_path / "cut", *common, "--resume-from", "latest"))
    full = load_file(tmp_path / "full" / "model" / "model.safetensors")
    cut = load_file(tmp_path / "cut" / "model" / "model.safetensors")
    assert full.keys() == cut.keys()
    for k in full:
        assert torch.equal(full[k], cut[k]), k
    # keep_last=2: the checkpoints at steps 4 and 8 remain, none half-written.
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-0000004", "step-0000008"]


def test_batch_size_auto_with_global_batch(recipe, tiny_lm, tmp_path):
    report = recipe.main(lm_args(tiny_lm, tmp_path / "auto", "--batch-size", "auto", "--memory-budget", "40MiB",
                                 "--global-batch-size", "64", "--max-steps", "2"))
    bs, acc = report["batch_size"], report["grad_accum"]
    assert 1 <= bs and acc == -(-64 // bs)


def test_policy_auto_with_budget_uses_the_planner(recipe, tiny_lm, tmp_path, capsys):
    args = [a for a in lm_args(tiny_lm, tmp_path / "plan", "--max-steps", "2") if a != "fp32"]
    args[args.index("--policy") + 1:args.index("--policy") + 1] = ["auto"]
    from hf_memstack.precision import resolve_precision

    report = recipe.main([*args, "--memory-budget", "1GiB"])
    mixed = resolve_precision("auto", "cpu").name  # bf16 on CPUs with native bf16, else fp32
    assert report["policy"] == mixed  # generous: the plain rung in this CPU's mixed precision
    assert f"choose: {mixed} at" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        recipe.main([*args, "--memory-budget", "64KiB", "--output-dir", str(tmp_path / "tiny")])
    assert e.value.code == 2 and "nothing fits --memory-budget 64KiB" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


# ----------------------------------------------------------------------------- bad input


def _fails(recipe, argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        recipe.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    return err


def test_bad_config_reports_everything_before_loading(recipe, tmp_path, capsys):
    out = tmp_path / "never"
    err = _fails(recipe, ["--dataset", str(tmp_path / "missing.jsonl"), "--batch-size", "0", "--policy", "bf16+turbo",
                          "--seq-len", "-1", "--output-dir", str(out)], "missing.jsonl': no such file", capsys)
    assert "--batch-size='0'" in err and "unknown token 'turbo'" in err and "--seq-len=-1" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--text-field", "body"], "field(s) ['body'] not in the data; its columns are ['text', 'prompt', 'response']"),
        (["--seq-len", "64"], "--seq-len=64 is above"),
    ],
)
def test_bad_data_or_length_writes_nothing(recipe, tiny_lm, tmp_path, capsys, extra, fragment):
    out = tmp_path / "out"
    _fails(recipe, lm_args(tiny_lm, out, *extra), fragment, capsys)
    assert not out.exists()


def test_model_without_tokenizer(recipe, tmp_path, capsys, pretrained_dirs):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n' * 20)
    out = tmp_path / "out"
    _fails(recipe, ["--model", str(pretrained_dirs["llama"]), "--dataset", str(data), "--output-dir", str(out)],
           "no tokenizer could be loaded", capsys)
    assert not out.exists()


def test_output_dir_with_another_run(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "out"
    recipe.main(lm_args(tiny_lm, out, "--max-steps", "2"))
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    _fails(recipe, lm_args(tiny_lm, out, "--max-steps", "2", "--lr", "1e-4"), "already holds a different run; pass --overwrite", capsys)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    _fails(recipe, lm_args(tiny_lm, tmp_path / "other", "--max-steps", "2"), "files that are not a run", capsys)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    report = recipe.main(lm_args(tiny_lm, out, "--max-steps", "2", "--lr", "1e-4", "--overwrite"))
    assert report["steps"] == 2


def test_corrupted_checkpoint(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "out"
    recipe.main(lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2", "--stop-after", "2"))
    ckpt = out / "checkpoints" / "step-0000002"
    for f in ckpt.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])  # truncated, as by a crash or a full disk
    _fails(recipe, lm_args(tiny_lm, out, "--max-steps", "4", "--save-every", "2", "--resume-from", "latest"),
           "the checkpoint is corrupted or incomplete", capsys)
    _fails(recipe, lm_args(tiny_lm, out, "--max-steps", "4", "--resume-from", str(tmp_path)), "not a complete checkpoint", capsys)


# ----------------------------------------------------------------------------- launch paths


def _launch(cmd, out, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.slow
def test_accelerate_launch_single_process(tiny_lm, tmp_path):
    out = tmp_path / "out"
    report = _launch([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", str(RECIPE),
                      *lm_args(tiny_lm, out, "--max-steps", "4")], out)
    assert report["steps"] == 4 and report["world_size"] == 1


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_processes_on_cpu(tiny_lm, tmp_path):
    out = tmp_path / "out"
    report = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(RECIPE),
                      *lm_args(tiny_lm, out, "--max-steps", "4", "--policy", "bf16+ckpt")], out)
    assert report["world_size"] == 2 and report["steps"] == 4
    assert report["last_logged_loss"] < report["first_logged_loss"]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_processes_with_fsdp_policy(tiny_lm, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    report = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(RECIPE),
                      *lm_args(tiny_lm, out, "--max-steps", "6", "--policy", "fp32+ckpt+fsdp")], out)
    assert report["world_size"] == 2 and report["policy"] == "fp32+ckpt+fsdp:full_shard"
    # On CPU prepare_model shards (Accelerate 1.15 has no CPU FSDP); only rank 0 read the weights.
    assert report["fsdp"]["by"] == "fully_shard" and report["fsdp"]["weights_from"] == "rank 0 broadcast"
    assert report["last_logged_loss"] < report["first_logged_loss"]
    # The full model was gathered from both ranks and loads in one process.
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForCausalLM"




@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_resume_equals_uninterrupted(tiny_lm, tmp_path):
    from safetensors.torch import load_file

    # 6 steps of batch 4 x 2 ranks with 2 accumulation steps (global batch 16), saved at step 3.
    common = ["--max-steps", "6", "--save-every", "3", "--policy", "fp32+fsdp", "--batch-size", "4", "--global-batch-size", "16"]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(RECIPE)]
    _launch([*run, *lm_args(tiny_lm, tmp_path / "full", *common)], tmp_path / "full")
    cut = tmp_path / "cut"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.run([*run, *lm_args(tiny_lm, cut, *common, "--stop-after", "3")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (cut / "checkpoints" / "step-0000003" / "sharded").is_dir()
    report = _launch([*run, *lm_args(tiny_lm, cut, *common, "--resume-from", "latest")], cut)
    assert report["grad_accum"] == 2 and report["steps"] == 6
    full, resumed = load_file(tmp_path / "full" / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.allclose(full[k], resumed[k], atol=1e-6), k


def test_fsdp_launch_config_without_fsdp_policy(recipe, tiny_lm, tmp_path, capsys, monkeypatch):
    # What `accelerate launch --config_file recipes/configs/fsdp.yaml` puts in the environment.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    out = tmp_path / "out"
    with pytest.raises(recipe.RecipeError, match=r"Accelerate FSDP config but --policy='bf16\+ckpt' has no fsdp"):
        recipe.main(lm_args(tiny_lm, out, "--policy", "bf16+ckpt"))
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.slow
def test_accelerate_launch_fsdp_plugin_on_gpu(tiny_lm, tmp_path):
    """On a GPU the recipe shards through Accelerate's FSDP2 plugin built from the policy: its
    prepare, backward, clipping and (sharded) save_state run; the saved model loads in one process."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    report = _launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "recipes/configs/fsdp.yaml"),
                      "--num_processes", "1", str(RECIPE),
                      *lm_args(tiny_lm, out, "--max-steps", "6", "--save-every", "3", "--policy", "bf16+ckpt+fsdp")], out)
    assert report["fsdp"]["by"].startswith("accelerator.prepare")
    assert report["last_logged_loss"] < report["first_logged_loss"]
    assert (out / "checkpoints" / "step-0000006").is_dir()
    assert type(AutoModelForCausalLM.from_pretrained(out / "model")).__name__ == "LlamaForCausalLM"
