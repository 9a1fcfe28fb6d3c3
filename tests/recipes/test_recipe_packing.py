"""The recipe with --packing on: whole samples packed into --seq-len rows (position_ids restarting,
no attention mask), plain text and prompt/response, less padding than padded batches, and the loss
of each packed row equal to its samples run alone (what verify checks on the first batch)."""

from __future__ import annotations

import json

import torch
from recipe_utils import fails, lm_args, run, snapshot


def _varied(tiny_lm, tmp_path):
    """The tiny LM's words in samples of 1 to 8 words (the fixture's are all 8: nothing to pack)."""
    words = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
    path = tmp_path / "varied.jsonl"
    rows = []
    for i in range(160):
        n = 1 + (i * 5) % 8
        text = " ".join(words[(i + j) % len(words)] for j in range(n))
        rows.append({"text": text, "prompt": words[i % len(words)], "response": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {**tiny_lm, "data": path}


def test_packed_rows_hold_whole_samples_with_restarting_positions(recipe, tiny_lm, tmp_path):
    data = _varied(tiny_lm, tmp_path)
    cfg = recipe.parse_config(lm_args(data, tmp_path / "o", "--packing"))  # bare --packing: on
    assert cfg.data.packing == "on"
    train, val, task, _ = recipe.load_raw_data(cfg)
    tokenizer = recipe.load_tokenizer(cfg, str(tiny_lm["model"]))
    packed, _, _ = recipe.tokenize(train, val, task, tokenizer, cfg)
    plain, _, _ = recipe.tokenize(train, val, task, tokenizer, recipe.parse_config(lm_args(data, tmp_path / "o")))
    # Every sample is in exactly one row, whole and in one piece; no row is over --seq-len.
    samples = sorted(tuple(s["input_ids"]) for s in plain)
    pieces = []
    for row in packed:
        assert sum(row["seq_lengths"]) == len(row["input_ids"]) <= cfg.data.seq_len
        start = 0
        for n in row["seq_lengths"]:
            pieces.append(tuple(row["input_ids"][start : start + n]))
            start += n
    assert sorted(pieces) == samples and len(packed) < len(plain) / 2
    batch = recipe.collate(tokenizer, packed=True)([packed[i] for i in range(4)])
    assert "attention_mask" not in batch and batch["position_ids"].shape == batch["input_ids"].shape
    first = packed[0]["seq_lengths"]
    assert batch["position_ids"][0, first[0]].item() == 0  # positions restart at the second sample
    assert recipe.real_tokens(batch) == sum(sum(packed[i]["seq_lengths"]) for i in range(4))
    assert "padding" in recipe.packing_summary(packed, cfg)


def test_packed_loss_equals_each_sample_alone(recipe, tiny_lm, tmp_path):
    """Independent reference: the unprepared model on each sample by itself, summed over the row's tokens."""
    from transformers import AutoModelForCausalLM

    data = _varied(tiny_lm, tmp_path)
    cfg = recipe.parse_config(
        lm_args(data, tmp_path / "o", "--packing", "on", "--prompt-field", "prompt", "--response-field", "response")
    )
    train, val, task, _ = recipe.load_raw_data(cfg)
    tokenizer = recipe.load_tokenizer(cfg, str(tiny_lm["model"]))
    packed, _, _ = recipe.tokenize(train, val, task, tokenizer, cfg)
    row = next(r for r in packed if len(r["seq_lengths"]) >= 2)
    assert any(t == -100 for t in row["labels"][1:])  # the prompts stay masked inside the row
    batch = recipe.collate(tokenizer, packed=True)([row])
    model = AutoModelForCausalLM.from_pretrained(tiny_lm["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        start = 0
        for n in row["seq_lengths"]:
            ids = torch.tensor([row["input_ids"][start : start + n]])
            alone = model(input_ids=ids, use_cache=False).logits[0]
            assert torch.allclose(logits[start : start + n], alone, atol=1e-5), n
            start += n


def test_the_recipe_trains_packed_and_reports_it(recipe, tiny_lm, tmp_path, capsys):
    data = _varied(tiny_lm, tmp_path)
    report = run(recipe, lm_args(data, tmp_path / "run", "--packing", "on", "--max-steps", "6"))
    assert report["steps"] == 6 and report["last_logged_loss"] < report["first_logged_loss"]
    out = capsys.readouterr().out
    assert "packing: 160 training samples" not in out or "padding" in out
    assert "padding, against" in out


def test_bf16_packed_rows_run_their_first_step_under_the_meter(recipe, tiny_lm, tmp_path, capsys):
    """Found by a helper: under bf16 Accelerate wraps the forward in autocast, the packed-batch guard's
    one-time probe was not found under it and ran inside the metered first step, where PyTorch's
    MemTracker refused the model called twice ("multiple iterative calls")."""
    data = _varied(tiny_lm, tmp_path)
    report = run(recipe, lm_args(data, tmp_path / "run", "--packing", "on", "--max-steps", "2", "--policy", "bf16"))
    assert report["steps"] == 2
    assert "memory meter, first step" in capsys.readouterr().out


def test_packing_labelled_rows_is_refused_when_task_auto_picks_classification(recipe, tiny_lm, tmp_path, capsys):
    """Trial finding (issue 22): --packing on a file with labels (--task auto) crashed with
    "Column 'seq_lengths' doesn't exist"; check_config only knew an explicit --task classification."""
    data = tmp_path / "labelled.jsonl"
    data.write_text(
        "".join(json.dumps({"text": line, "label": i % 2}) + "\n" for i, line in enumerate(tiny_lm["lines"]))
    )
    before = snapshot(data)
    argv = [
        "--model",
        tiny_lm["model"],
        "--dataset",
        data,
        "--output-dir",
        tmp_path / "out",
        "--seq-len",
        "16",
        "--packing",
    ]
    fails(
        recipe,
        argv,
        capsys,
        "packing='on'",
        "--task auto trains a classifier",
        "drop --packing, or pass --task causal-lm",
    )
    assert snapshot(data) == before and not (tmp_path / "out").exists()


def test_policy_auto_plans_packed_rows_as_packed(recipe, tiny_lm, tmp_path, capsys, monkeypatch):
    """--packing on with --policy auto: the planner is told the rows are packed (their dense attention
    mask counted), and the plan the recipe logs is that one, not the unpacked plan it logged before."""
    import hf_memstack

    calls: list[tuple[tuple, dict]] = []
    real = hf_memstack.plan_policy

    def spy(*args, **kwargs):  # the real planner plans; what it was asked is kept
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_memstack, "plan_policy", spy)
    data = _varied(tiny_lm, tmp_path)
    args = lm_args(data, tmp_path / "run", "--packing", "on", "--max-steps", "1", "--memory-budget", "1GiB")
    args = [str(a) for a in args]
    args[args.index("--policy") + 1] = "auto"
    job = recipe.setup(recipe.parse_config(args))  # the plan is made and logged here; no step needed
    job.accelerator.end_training()
    logged = capsys.readouterr().out
    ((given, asked),) = calls
    assert asked.get("packed") is True
    packed, unpacked = (real(*given, **{**asked, "packed": p}).table() for p in (True, False))
    assert packed != unpacked  # the mask is counted: the peaks differ
    assert f"memory plan for 1GiB per device:\n{packed}" in logged
