import json

import pytest

from hf_memstack.cli.main import main
from hf_memstack.sizes import format_bytes


def test_estimate_table_and_exit_codes(pretrained_dirs, capsys):
    d = str(pretrained_dirs["llama"])
    assert main(["estimate", d, "--policy", "fp32,bf16+ckpt", "--batch-size", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "| bf16+ckpt |" in out and "| fp32 |" in out and "KiB" in out
    assert main(["estimate", d, "--batch-size", "2", "--seq-len", "16", "--budget", "64KiB"]) == 1
    assert "does not fit in 64.00 KiB" in capsys.readouterr().out


def test_estimate_json_and_plot(pretrained_dirs, capsys, tmp_path):
    png = tmp_path / "breakdown.png"
    code = main(
        [
            "estimate",
            str(pretrained_dirs["gpt2"]),
            "--policy",
            "bf16,bf16+ckpt",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--json",
            "--plot",
            str(png),
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and [e["policy"] for e in data["estimates"]] == ["bf16", "bf16+ckpt"]
    assert png.stat().st_size > 1000


def test_plan_fits_and_does_not_fit(pretrained_dirs, capsys):
    d = str(pretrained_dirs["llama"])
    assert main(["plan", d, "--budget", "4GiB", "--seq-len", "16", "--batch-size", "2"]) == 0
    assert "choose:" in capsys.readouterr().out
    assert main(["plan", d, "--budget", "100KiB", "--seq-len", "16", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["shortfall_bytes"] > 0


def test_plan_for_another_device(pretrained_dirs, capsys):
    """Planning on a laptop for a GPU run: --device cuda plans bf16 rungs whatever this machine does natively."""
    from hf_memstack import plan_policy

    d = str(pretrained_dirs["llama"])
    assert main(["plan", d, "--budget", "4GiB", "--seq-len", "16", "--device", "cuda", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"] and all(row["policy"].startswith("bf16") for row in data["rows"]), data["rows"]
    reference = plan_policy(d, budget="4GiB", seq_len=16, device="cuda").as_dict()
    assert [r["policy"] for r in data["rows"]] == [r["policy"] for r in reference["rows"]] and data[
        "policy"
    ] == reference["policy"]


def test_find_batch_size_command(pretrained_dirs, capsys):
    code = main(
        [
            "find-batch-size",
            str(pretrained_dirs["llama"]),
            "--policy",
            "bf16",
            "--seq-len",
            "16",
            "--budget",
            "24MiB",
            "--global-batch-size",
            "32",
            "--json",
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["batch_size"] >= 1 and data["steps_run"] <= 4 and data["global_batch_size"] == 32


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", "{d}", "--budget", "lots", "--seq-len", "16"], "--budget='lots' is not a size"),
        (["estimate", "{d}", "--batch-size", "-3", "--seq-len", "16"], "--batch-size='-3' must be a positive integer"),
        (["plan", "{d}", "--budget", "1GiB", "--seq-len", "16", "--batch-size", "many"], "--batch-size='many'"),
        (
            ["estimate", "no-such-org/no-such-model", "--batch-size", "1", "--seq-len", "16"],
            "not in the local Hugging Face cache",
        ),
        (["estimate", "{d}", "--policy", "bf16+warp", "--batch-size", "1", "--seq-len", "16"], "unknown token 'warp'"),
        # A folder that is not there is named as one: no `hf download ./no-such-folder` advice.
        (
            ["estimate", "./no-such-folder", "--batch-size", "1", "--seq-len", "16"],
            "'./no-such-folder': no such directory",
        ),
    ],
)
def test_usage_errors_exit_2(pretrained_dirs, capsys, argv, fragment):
    argv = [a.replace("{d}", str(pretrained_dirs["llama"])) for a in argv]
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_missing_arguments_exit_2(capsys):
    assert main(["estimate"]) == 2
    assert "the following arguments are required: model, --seq-len, --batch-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("budget", "noted"), [("16GB", True), ("16 gb", True), ("16GiB", False), ("17179869184", False)]
)
def test_a_decimal_budget_is_noted_with_its_binary_size(pretrained_dirs, capsys, budget, noted):
    argv = ["estimate", str(pretrained_dirs["llama"]), "--batch-size", "1", "--seq-len", "16", "--budget", budget]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ("note: --budget" in err and "14.90 GiB (GB = 10^9 bytes; GiB = 2^30)" in err) is noted, err


def test_a_negative_budget_is_named_through_the_installed_command(tmp_path):
    """The real entry point (the console script), with the size as its own word."""
    import shutil
    import subprocess
    import sys

    script = shutil.which("hf-memstack") or f"{sys.executable} -m hf_memstack.cli.main"
    done = subprocess.run(
        [*script.split(), "estimate", str(tmp_path), "--batch-size", "1", "--seq-len", "16", "--budget", "-1GiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done
    assert "--budget='-1GiB' must be positive" in done.stderr and "expected one argument" not in done.stderr, (
        done.stderr
    )


def _peaks(d, policies, **kw):
    from hf_memstack import estimate_memory

    return {p: estimate_memory(d, p, **kw).peak_bytes for p in policies}


def test_several_policies_each_get_their_verdict(pretrained_dirs, capsys):
    """Issue 18: --policy bf16,bf16+ckpt with a budget only bf16+ckpt fits printed 'does not fit' and
    exited 1. Each policy gets its own verdict; the status is 0 when one fits, 1 when none does."""
    d = str(pretrained_dirs["llama"])
    peaks = _peaks(d, ["fp32", "fp32+ckpt"], batch_size=8, seq_len=64)
    assert peaks["fp32+ckpt"] < peaks["fp32"]
    budget = (peaks["fp32+ckpt"] + peaks["fp32"]) // 2
    argv = [
        "estimate",
        d,
        "--policy",
        "fp32,fp32+ckpt",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--budget",
        str(budget),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fp32: does not fit in" in out and "fp32+ckpt: fits in" in out and "1 of 2 policies fit" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["fitting_policies"] == ["fp32+ckpt"]
    assert [e["fits"] for e in data["estimates"]] == [False, True]
    # Without a budget there is no verdict (found by a new-user trial: "fits": true for a 135 GiB peak).
    unbudgeted = argv[: argv.index("--budget")]
    assert main([*unbudgeted, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is None and data["fitting_policies"] is None
    assert [e["fits"] for e in data["estimates"]] == [None, None]
    below = [
        "estimate",
        d,
        "--policy",
        "fp32,fp32+ckpt",
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--budget",
        str(peaks["fp32+ckpt"] - 1),
    ]
    assert main(below) == 1
    assert "none does, exit 1" in capsys.readouterr().out


def test_plot_without_matplotlib_fails_before_estimating(pretrained_dirs, tmp_path):
    """Without matplotlib, --plot is refused at once with the extra that installs it: no table, no verdict first."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # what an environment without matplotlib sees
        "from hf_memstack.cli.main import main\n"
        f"sys.exit(main(['estimate', {str(pretrained_dirs['llama'])!r}, '--batch-size', '2', '--seq-len', '16', "
        f"'--budget', '1GiB', '--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--plot needs matplotlib" in done.stderr and "pip install 'hf_memstack[plot]'" in done.stderr
    assert "| policy |" not in done.stdout and "fits" not in done.stdout, done.stdout
    assert not (tmp_path / "x.png").exists()


def test_the_recipes_minilm_alias_is_an_encoder_estimated_as_a_classifier(minilm_dir, capsys, caplog):
    """`hf-memstack estimate minilm` is the recipe's model (one alias table, hf_memstack.models), and
    that BertModel checkpoint is estimated with a classification head, as the recipe trains it -
    not as a BertLMHeadModel (one is_decoder warning per layer)."""
    import logging

    from hf_memstack import estimate_memory

    caplog.set_level(logging.WARNING)
    assert main(["estimate", "minilm", "--batch-size", "2", "--seq-len", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["estimates"][0]
    reference = estimate_memory(minilm_dir, "fp32", batch_size=2, seq_len=16, task="classification")
    assert (data["parameters"], data["peak_bytes"]) == (reference.parameters, reference.peak_bytes)
    assert any("task: classification" in n for n in data["notes"])
    assert "is_decoder" not in caplog.text


def test_an_alias_whose_package_is_missing_says_what_to_install(monkeypatch, capsys):
    from hf_memstack import models

    monkeypatch.setitem(models.MODEL_ALIASES, "tinyzoo", ("no_such_package_xyz", "model", "no-such-package-xyz"))
    assert main(["estimate", "tinyzoo", "--batch-size", "1", "--seq-len", "8"]) == 2
    assert "pip install no-such-package-xyz" in capsys.readouterr().err


def test_estimate_and_find_batch_size_with_4bit_base_weights(pretrained_dirs, capsys):
    pytest.importorskip("torchao")
    d = str(pretrained_dirs["llama"])
    assert (
        main(
            [
                "estimate",
                d,
                "--policy",
                "bf16+ckpt,bf16+ckpt+quant:nf4",
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--lora-r",
                "4",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    lora, qlora = data["estimates"]
    assert qlora["policy"] == "bf16+ckpt+quant:nf4" and qlora["parameters"] < 0.5 * lora["parameters"]
    assert qlora["trainable_parameters"] == lora["trainable_parameters"] and any(
        "4-bit base weights: 14 linear" in n for n in qlora["notes"]
    )
    assert (
        main(
            [
                "find-batch-size",
                d,
                "--policy",
                "bf16+ckpt+quant:nf4",
                "--lora-r",
                "4",
                "--seq-len",
                "16",
                "--budget",
                "24MiB",
                "--no-cache",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["batch_size"] >= 1


def test_full_trace_gives_the_extrapolated_bytes(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ).save_pretrained(tmp_path)
    runs = {}
    for flag in ([], ["--full-trace"]):
        assert (
            main(
                [
                    "estimate",
                    str(tmp_path),
                    "--policy",
                    "bf16+ckpt",
                    "--batch-size",
                    "2",
                    "--seq-len",
                    "32",
                    "--json",
                    *flag,
                ]
            )
            == 0
        )
        runs[bool(flag)] = json.loads(capsys.readouterr().out)["estimates"][0]
    notes = {k: [n for n in v.pop("notes") if "extrapolated" in n] for k, v in runs.items()}
    for run in runs.values():  # the verdict, and the depth extrapolation's per-block reading (no full trace takes it)
        for key in ("fits", "activations_per_block", "blocks"):
            run.pop(key, None)
    assert notes[False] and not notes[True] and runs[False] == runs[True]


def test_estimate_eval_mode_counts_the_kept_logits_against_the_budget(pretrained_dirs, capsys):
    """--mode eval: the forward's peak and the logits Trainer keeps for --eval-samples; the budget
    verdict needs both (the logits stay on the device until evaluation ends)."""
    from hf_memstack import estimate_memory

    d = str(pretrained_dirs["llama"])
    lib = estimate_memory(d, "bf16", batch_size=2, seq_len=16, mode="eval", eval_samples=500)
    argv = [
        "estimate",
        d,
        "--policy",
        "bf16",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--mode",
        "eval",
        "--eval-samples",
        "500",
    ]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["estimates"][0]
    assert (data["mode"], data["peak_bytes"], data["eval_logits_bytes"]) == (
        "eval",
        lib.peak_bytes,
        lib.eval_logits_bytes,
    )
    assert lib.eval_logits_bytes > lib.peak_bytes  # 500 samples of logits outweigh the tiny model
    assert main([*argv, "--budget", str(lib.peak_bytes + lib.eval_logits_bytes - 1)]) == 1
    out = capsys.readouterr().out
    assert "| kept logits |" in out and f"+ kept logits {format_bytes(lib.eval_logits_bytes)}" in out
    assert main([*argv, "--budget", str(lib.peak_bytes + lib.eval_logits_bytes)]) == 0
    capsys.readouterr()
    assert main(["estimate", d, "--batch-size", "2", "--seq-len", "16", "--eval-samples", "500"]) == 2
    assert "eval_samples=500 is only used with mode='eval'" in capsys.readouterr().err


def _tiny_moe_dir(path):
    from transformers import MixtralConfig

    MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_local_experts=4,
        architectures=["MixtralForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def test_estimate_with_a_refused_policy_prints_it_as_refused_and_the_others(tmp_path, capsys):
    # Issue 39: quant:nf4 over a mixture-of-experts router is refused; with another policy beside it
    # the command exited 2 with no table for the other.
    from hf_memstack import estimate_memory

    d = _tiny_moe_dir(tmp_path)
    job = {"batch_size": 1, "seq_len": 16, "trainable": {"r": 4}}
    answered = estimate_memory(d, "bf16+ckpt", **job)
    with pytest.raises((ValueError, ImportError)) as caught:  # ImportError: no torchao here
        estimate_memory(d, "bf16+ckpt+quant:nf4", **job)
    reason = str(caught.value)
    args = ["estimate", d, "--policy", "bf16+ckpt,bf16+ckpt+quant:nf4", "--batch-size", "1", "--seq-len", "16"]
    args += ["--lora-r", "4"]

    assert main([*args, "--budget", "1GiB"]) == 0  # the answered policy fits: it is usable
    out = capsys.readouterr().out
    assert f"| {answered.policy} |" in out and f"| {format_bytes(answered.peak_bytes)} |" in out
    assert "| bf16+ckpt+quant:nf4 | refused |" in out and f"bf16+ckpt+quant:nf4: refused: {reason}" in out
    assert "1 of 2 policies fit (1 refused): exit 0" in out

    assert main([*args, "--budget", "1GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ok, refused = data["estimates"]
    assert ok["peak_bytes"] == answered.peak_bytes and ok["refused"] is None and ok["fits"] is True
    assert refused == {"policy": "bf16+ckpt+quant:nf4", "refused": reason, "fits": False}
    assert data["refused_policies"] == ["bf16+ckpt+quant:nf4"] and data["fitting_policies"] == [answered.policy]

    # Without a budget no verdict; with one the answered policy misses: 1, as for any row that misses.
    assert main(args) == 0 and "refused: " in capsys.readouterr().out
    assert main([*args, "--budget", "1KiB"]) == 1
    assert "0 of 2 policies fit (1 refused): none does, exit 1" in capsys.readouterr().out


def test_estimate_where_every_policy_is_refused_or_one_does_not_parse_exits_2(tmp_path, capsys):
    d = _tiny_moe_dir(tmp_path)
    common = ["--batch-size", "1", "--seq-len", "16", "--lora-r", "4"]
    assert main(["estimate", d, "--policy", "bf16+quant:nf4,bf16+ckpt+quant:nf4", *common]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("hf-memstack estimate: error:") >= 1
    # A typo is refused for the whole command, before any estimate.
    assert main(["estimate", d, "--policy", "bf16+ckpt,bf16+ckppt", *common]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown token 'ckppt'" in captured.err


def _received(tmp_path, kind):
    """A model folder (and a policy file) as someone else could have made them."""
    import os

    from tiny import LLAMA

    folder = tmp_path / kind
    folder.mkdir()
    config = folder / "config.json"
    fields = {"model_type": "llama", **LLAMA}
    if kind == "nested":
        config.write_text("[" * 100_000)
    elif kind == "fifo":
        os.mkfifo(config)
    elif kind == "deep":
        config.write_text(json.dumps({**fields, "num_hidden_layers": 10**9}))
    elif kind == "model_type":
        config.write_text(json.dumps({**fields, "model_type": "lla\u202ema\x00"}))
    else:  # a valid model, with a FIFO for its policy file
        config.write_text(json.dumps(fields))
        os.mkfifo(tmp_path / "policy.yaml")
    return folder


@pytest.mark.parametrize(
    "command, kind, said",
    [
        ("estimate", "nested", "config.json is nested too deeply to read"),
        ("estimate", "fifo", "config.json is a FIFO (named pipe), not a regular file"),
        ("estimate", "deep", "num_hidden_layers=1000000000: a stack of more than"),
        ("plan", "deep", "num_hidden_layers=1000000000: a stack of more than"),
        ("estimate", "model_type", "model_type='lla\\u202ema\\x00', which Transformers"),
        ("estimate", "policy_fifo", "policy.yaml is a FIFO (named pipe), not a regular file"),
    ],
)
def test_a_received_config_or_policy_file_is_one_clear_error_through_the_installed_command(
    tmp_path, command, kind, said
):
    """Each was a hang (a FIFO; 10^9 blocks built on meta), an internal error (RecursionError: exit 3),
    "missing" for a file that is there, or a model_type echoed raw (U+202E turns the terminal's line
    around). Now exit 2, one line naming the file and what it is, nothing raw."""
    import shutil
    import subprocess
    import sys

    folder = _received(tmp_path, kind)
    policy = ["--policy", str(tmp_path / "policy.yaml")] if kind == "policy_fifo" else []
    sizes = ["--batch-size", "1", "--seq-len", "16"] + (["--budget", "1GiB"] if command == "plan" else [])
    script = shutil.which("hf-memstack") or f"{sys.executable} -m hf_memstack.cli.main"
    done = subprocess.run(
        [*script.split(), command, str(folder), *sizes, *policy], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not any(c in done.stdout + done.stderr for c in "\u202e\x00"), done.stderr[-3000:]


def test_an_encoders_architecture_name_is_escaped_in_the_note(pretrained_dirs, tmp_path, capsys):
    import shutil

    folder = tmp_path / "bert"
    shutil.copytree(pretrained_dirs["bert"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Bert\u202eModel\x1b[2J"]}))
    assert main(["estimate", str(folder), "--batch-size", "1", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "(Bert\\u202eModel\\x1b[2J is an encoder" in out and not any(c in out for c in "\u202e\x1b"), out


@pytest.mark.parametrize(
    ("command", "seq_len", "batch", "named"),
    [
        ("estimate", 10**12, "2", "use seq_len="),
        ("plan", 10**12, None, "use seq_len="),
        ("plan", 100_000, str(10**12), "or batch_size="),
        ("estimate", 100_000, str(10**12), "or batch_size="),
    ],
)
def test_absurd_token_counts_are_refused_before_tracing(tmp_path, capsys, command, seq_len, batch, named):
    """A config allowing 10**12 positions and ``--seq-len 10**12`` (or a batch of 10**12) is exit 2
    naming the flags and the largest size that would do, not torch's storage overflow (exit 3)."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=10**12,
    ).save_pretrained(tmp_path)
    argv = [command, str(tmp_path), "--seq-len", str(seq_len)]
    argv += ["--budget", "20GiB"] if command == "plan" else ["--policy", "fp32"]
    argv += ["--batch-size", batch] if batch else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"seq_len={seq_len} (--seq-len)" in err and "(--batch-size)" in err and named in err, err
    assert "internal error" not in err


def test_find_batch_size_on_a_vlm_folder_feeds_pixels_and_seq2seq_is_a_task(pretrained_dirs, tmp_path, capsys):
    # A composite config (Gemma-3: the vocabulary in text_config): the finder's batches carry the images.
    from tiny_vlm import tiny_vlm

    folder = tmp_path / "gemma3"
    tiny_vlm("gemma3").save_pretrained(folder)
    argv = ["find-batch-size", str(folder), "--policy", "bf16", "--seq-len", "24", "--budget", "64MiB", "--json"]
    code = main([*argv, "--no-cache"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["batch_size"] >= 1
    # Images that do not fit the sequence are refused as a usage error, naming the flag.
    assert main([*argv, "--no-cache", "--images-per-sample", "9"]) == 2
    assert "seq_len" in capsys.readouterr().err
    # An encoder-decoder's task is accepted by --task and inferred alike.
    t5 = str(pretrained_dirs["t5"])
    for task in (["--task", "seq2seq-lm"], []):
        assert main(["estimate", t5, "--batch-size", "1", "--seq-len", "16", "--json", *task]) == 0
        assert "task: seq2seq-lm" in capsys.readouterr().out
