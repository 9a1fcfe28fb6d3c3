"""The recipe with the policy's optimizer rungs (optim:in_backward, optim:8bit): it trains with the
library's make_optimizer, resumes exactly, and refuses, before writing anything, the settings an
optimizer stepping inside the backward cannot honour."""

from __future__ import annotations

import pytest
import torch
from recipe_utils import assert_same_weights, fails, lm_args, read_report, run, snapshot

RESUMABLE = ["--max-steps", "8", "--save-every", "4", "--grad-clip", "0"]  # checkpoints on log lines (--log-every 2)


@pytest.mark.parametrize("policy", ["fp32+optim:in_backward", "fp32+optim:8bit+optim:in_backward"])
def test_optimizer_rung_trains_and_resumes_exactly(recipe, tiny_lm, tmp_path, policy):
    if "8bit" in policy:
        pytest.importorskip("torchao")
    common = ["--policy", policy, *RESUMABLE]
    full = run(recipe, lm_args(tiny_lm, tmp_path / "full", *common))
    assert full["policy"] == policy and full["last_logged_loss"] < full["first_logged_loss"]
    assert run(recipe, lm_args(tiny_lm, tmp_path / "cut", *common, "--stop-after", "4"))["stopped_at"] == 4
    run(recipe, lm_args(tiny_lm, tmp_path / "cut", *common, "--resume-from", "latest"))
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
    history = [[(h["step"], h["loss"], h["lr"]) for h in read_report(tmp_path / d)["history"]] for d in ("full", "cut")]
    assert history[0] == history[1] and all(isinstance(lr, float) for _, _, lr in history[0])


def test_in_backward_frees_gradients_during_the_backward(recipe, tiny_lm, tmp_path):
    """The memory meter's first step: with AdamW every gradient is alive at the step; stepped in the
    backward, each is freed after its update, so the gradient category's peak is smaller."""
    reports = {
        p: run(
            recipe,
            lm_args(
                tiny_lm,
                tmp_path / p.replace(":", "_").replace("+", "_"),
                "--policy",
                p,
                "--max-steps",
                "1",
                "--grad-clip",
                "0",
            ),
        )
        for p in ("fp32", "fp32+optim:in_backward")
    }
    plain, in_backward = (reports[p]["first_step_memory"] for p in ("fp32", "fp32+optim:in_backward"))
    assert in_backward["gradients"] < plain["gradients"], (plain, in_backward)


@pytest.mark.parametrize(
    "extra, env, fragments",
    [
        (["--grad-clip", "1.0"], {}, ("grad_clip=1.0 with policy='fp32+optim:in_backward'", "--grad-clip 0")),
        (
            ["--grad-clip", "0", "--global-batch-size", "32"],
            {},
            ("global_batch_size=32", "cannot be accumulated", "drop --global-batch-size"),
        ),
        (["--grad-clip", "0"], {"WORLD_SIZE": "2"}, ("on 2 processes without fsdp", "add fsdp to the policy")),
    ],
    ids=["clipping", "accumulation", "ddp"],
)
def test_in_backward_refuses_what_it_cannot_do(recipe, tiny_lm, tmp_path, capsys, monkeypatch, extra, env, fragments):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    before = snapshot(out)
    fails(
        recipe,
        lm_args(tiny_lm, out, "--max-steps", "2", "--policy", "fp32+optim:in_backward", *extra),
        capsys,
        *fragments,
    )
    assert snapshot(out) == before


def test_a_global_batch_of_one_step_is_allowed(recipe, tiny_lm, tmp_path):
    """--global-batch-size equal to batch x processes needs no accumulation: in_backward accepts it."""
    report = run(
        recipe,
        lm_args(
            tiny_lm,
            tmp_path / "ok",
            "--policy",
            "fp32+optim:in_backward",
            "--grad-clip",
            "0",
            "--global-batch-size",
            "8",
            "--max-steps",
            "2",
        ),
    )
    assert report["grad_accum"] == 1 and report["steps"] == 2
    assert torch.isfinite(torch.tensor(report["last_logged_loss"]))
