import json

import pytest

from hf_memstack.cli import main


def test_estimate_table_and_exit_codes(pretrained_dirs, capsys):
    d = str(pretrained_dirs["llama"])
    assert main(["estimate", d, "--policy", "fp32,bf16+ckpt", "--batch-size", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "| bf16+ckpt |" in out and "| fp32 |" in out and "KiB" in out
    assert main(["estimate", d, "--batch-size", "2", "--seq-len", "16", "--budget", "64KiB"]) == 1
    assert "does not fit in 64.00 KiB" in capsys.readouterr().out


def test_estimate_json_and_plot(pretrained_dirs, capsys, tmp_path):
    png = tmp_path / "breakdown.png"
    code = main(["estimate", str(pretrained_dirs["gpt2"]), "--policy", "bf16,bf16+ckpt", "--batch-size", "2", "--seq-len", "16",
                 "--json", "--plot", str(png)])
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


def test_find_batch_size_command(pretrained_dirs, capsys):
    code = main(["find-batch-size", str(pretrained_dirs["llama"]), "--policy", "bf16", "--seq-len", "16", "--budget", "24MiB",
                 "--global-batch-size", "32", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["batch_size"] >= 1 and data["steps_run"] <= 4 and data["global_batch_size"] == 32


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", "{d}", "--budget", "lots", "--seq-len", "16"], "--budget='lots' is not a size"),
        (["estimate", "{d}", "--batch-size", "-3", "--seq-len", "16"], "--batch-size='-3' must be a positive integer"),
        (["plan", "{d}", "--budget", "1GiB", "--seq-len", "16", "--batch-size", "many"], "--batch-size='many'"),
        (["estimate", "no-such-org/no-such-model", "--batch-size", "1", "--seq-len", "16"], "not in the local Hugging Face cache"),
        (["estimate", "{d}", "--policy", "bf16+warp", "--batch-size", "1", "--seq-len", "16"], "unknown token 'warp'"),
    ],
)
def test_usage_errors_exit_2(pretrained_dirs, capsys, argv, fragment):
    argv = [a.replace("{d}", str(pretrained_dirs["llama"])) for a in argv]
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_missing_arguments_exit_2(capsys):
    assert main(["estimate"]) == 2
    assert "the following arguments are required: model, --seq-len, --batch-size" in capsys.readouterr().err


def test_estimate_and_find_batch_size_with_4bit_base_weights(pretrained_dirs, capsys):
    pytest.importorskip("torchao")
    d = str(pretrained_dirs["llama"])
    assert main(["estimate", d, "--policy", "bf16+ckpt,bf16+ckpt+quant:nf4", "--batch-size", "2", "--seq-len", "16",
                 "--lora-r", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lora, qlora = data["estimates"]
    assert qlora["policy"] == "bf16+ckpt+quant:nf4" and qlora["parameters"] < 0.5 * lora["parameters"]
    assert qlora["trainable_parameters"] == lora["trainable_parameters"] and any("4-bit base weights: 14 linear" in n for n in qlora["notes"])
    assert main(["find-batch-size", d, "--policy", "bf16+ckpt+quant:nf4", "--lora-r", "4", "--seq-len", "16", "--budget", "24MiB",
                 "--no-cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] >= 1
