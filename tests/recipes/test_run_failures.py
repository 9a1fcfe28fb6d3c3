"""The recipe when a run goes wrong, not its flags: weights holding NaN (in --model or in the
checkpoint resumed), a run that diverges, a damaged or foreign model folder (a broken
safetensors header, custom code, a chat template reaching for Python internals, control
characters in its config), a full disk during a save, and SIGINT/SIGTERM. Each ends with one
message saying what happened, where, and how to go on; nothing is saved from NaN weights and the
earlier checkpoints stay intact."""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from finetune_support.checkpoint_dirs import list_checkpoints
from recipe_utils import (
    RECIPE,
    ROOT,
    assert_same_weights,
    fails,
    lm_args,
    run,
    snapshot,
    torchrun,
)
from safetensors.torch import load_file, save_file

# lr 1e30 after a warmup from 0: the first steps are finite, then the weights and the loss blow up.
DIVERGING = ("--lr", "1e30", "--warmup-ratio", "0.5", "--max-steps", "8")


def _model_copy(tiny_lm, dest: Path) -> Path:
    shutil.copytree(tiny_lm["model"], dest)
    return dest


def _args(tiny_lm, out, *extra, model: Path | None = None) -> list[str]:
    args = [str(a) for a in lm_args(tiny_lm, out, *extra)]
    if model is not None:
        args[args.index("--model") + 1] = str(model)
    return args


def _poison(path: Path) -> str:
    """Write NaN into one element of the file's largest tensor (the file keeps its size); its name."""
    tensors = load_file(path)
    name = max(tensors, key=lambda k: tensors[k].numel())
    tensors[name].view(-1)[3] = float("nan")
    size = path.stat().st_size
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == size
    return name


def _all_finite(path: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(path).values() if t.is_floating_point())


# ----------------------------------------------------------------------------- NaN and divergence
def test_nan_weights_in_the_model_are_refused_naming_the_tensor_and_file(recipe, tiny_lm, tmp_path, capsys):
    model = _model_copy(tiny_lm, tmp_path / "model")
    name = _poison(model / "model.safetensors")
    before = snapshot(tmp_path)
    fails(
        recipe,
        _args(tiny_lm, tmp_path / "out", model=model),
        capsys,
        "the weights hold nan values",
        repr(name),
        str(model / "model.safetensors"),
        "use an intact copy of the weights",
    )
    assert snapshot(tmp_path) == before


def test_nan_weights_in_the_checkpoint_resumed_are_refused(recipe, tiny_lm, tmp_path, capsys):
    out = tmp_path / "out"
    common = ("--max-steps", "8", "--save-every", "2")
    run(recipe, _args(tiny_lm, out, *common, "--stop-after", "4"))
    newest = list_checkpoints(out)[-1].path
    name = _poison(newest / "model.safetensors")
    assert list_checkpoints(out)[-1].problem is None  # the sizes match: only the values tell
    before = snapshot(out)
    fails(
        recipe,
        _args(tiny_lm, out, *common, "--resume-from", "latest"),
        capsys,
        f"resume_from={str(newest)!r}: the checkpoint's weights hold nan values",
        repr(name),
        "Resume from an earlier checkpoint",
    )
    assert snapshot(out) == before


def test_a_diverging_run_stops_at_the_first_nan_loss_and_saves_nothing(recipe, tiny_lm, tmp_path, capsys):
    """Checked where the log line reads the loss anyway (every step here, no checkpoints)."""
    out = tmp_path / "out"
    err = fails(recipe, _args(tiny_lm, out, *DIVERGING, "--log-every", "1"), capsys, "training diverged")
    line = next(x for x in err.splitlines() if "training diverged" in x)
    assert "the loss is nan" in line or "the loss is inf" in line, line
    assert "No checkpoint was saved yet" in line and "--resume-from latest --allow-config-change --lr 1e+29" in line
    assert not (out / "model").exists() and not (out / "report.json").exists()


def test_a_diverging_run_keeps_its_last_good_checkpoint_as_the_newest(recipe, tiny_lm, tmp_path, capsys):
    """A checkpoint every step, a log line every 4, 2 micro-steps a step: the check before each save
    stops the run before NaN weights are saved; the newest checkpoint is the last finite one."""
    out = tmp_path / "out"
    extra = (*DIVERGING, "--log-every", "4", "--save-every", "1", "--keep-last", "8", "--global-batch-size", "16")
    err = fails(recipe, _args(tiny_lm, out, *extra), capsys, "training diverged")
    saved = list_checkpoints(out)
    assert saved and all(c.problem is None for c in saved)
    assert all(_all_finite(c.path / "model.safetensors") for c in saved)
    newest = saved[-1]
    assert f"step {newest.step + 1}: " in err and f"The newest checkpoint is {newest.path} (step {newest.step})" in err
    assert not (out / "model").exists()


def test_huge_finite_weights_are_not_taken_for_nan():
    """The fast screen sums each tensor; a sum past fp32's range from finite weights is confirmed
    element by element, not reported."""
    from finetune_support.stops import all_finite, nonfinite

    huge = torch.full((64,), 3e38)
    assert float(all_finite([huge])) == 0.0  # the screen's sum overflows ...
    assert nonfinite([("huge", huge)]) is None  # ... and the exact test finds nothing
    bad = huge.clone()
    bad[5] = float("-inf")
    assert nonfinite([("huge", huge), ("bad", bad)]) == ("bad", "inf")


@pytest.mark.slow
def test_every_rank_stops_on_a_nan_loss(tiny_lm, tmp_path):
    """2 gloo ranks with gradient accumulation: both stop with the message, neither waits out the timeout."""
    out = tmp_path / "out"
    extra = (*DIVERGING, "--log-every", "1", "--save-every", "1", "--keep-last", "8", "--global-batch-size", "32")
    started = time.perf_counter()
    proc = torchrun(tiny_lm, out, *extra, "--dist-timeout", "60", check=False, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("training diverged") == 2, proc.stderr[-3000:]  # one message per rank
    assert "Timed out" not in proc.stderr and time.perf_counter() - started < 60
    assert all(_all_finite(c.path / "model.safetensors") for c in list_checkpoints(out))


# ----------------------------------------------------------------------------- a damaged or foreign model folder
def _rewrite_header(path: Path, damage: str) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    if damage == "header length 2**63":
        path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])
        return
    if damage == "shape against length":
        header[a]["shape"] = [header[a]["shape"][0] * 2, *header[a]["shape"][1:]]
    else:  # two tensors over the same bytes
        start, end = header[b]["data_offsets"]
        header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + end - start]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


@pytest.mark.parametrize("damage", ["header length 2**63", "shape against length", "overlapping offsets"])
def test_a_damaged_safetensors_file_is_named(recipe, tiny_lm, tmp_path, capsys, damage):
    model = _model_copy(tiny_lm, tmp_path / "model")
    _rewrite_header(model / "model.safetensors", damage)
    before = snapshot(tmp_path)
    fails(
        recipe,
        _args(tiny_lm, tmp_path / "out", model=model),
        capsys,
        f"{model / 'model.safetensors'} is not a readable safetensors file (SafetensorError:",
        "nothing in it was loaded or run",
        "save the model again",
    )
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_chat_template_reaching_for_python_internals_is_refused(recipe, tiny_lm, tmp_path, capsys, where):
    model = _model_copy(tiny_lm, tmp_path / "model")
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    if where == "chat_template.jinja":
        (model / where).write_text(template)
        field = str(model / where)
    else:  # where older tokenizers keep it
        config = json.loads((model / where).read_text())
        (model / where).write_text(json.dumps({**config, "chat_template": template}))
        field = f"{model / where}'s chat_template"
    before = snapshot(tmp_path)
    fails(
        recipe,
        _args(tiny_lm, tmp_path / "out", "--prompt-field", "prompt", "--response-field", "response", model=model),
        capsys,
        f"the chat template in {field} was refused by Jinja's sandbox",
        "Python internals",
        "SecurityError",
    )
    assert snapshot(tmp_path) == before


def _with_auto_map(folder: Path, config_name: str, **changes) -> None:
    path = folder / config_name
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    (folder / "custom.py").write_text("open('/tmp/owned', 'w')  # must never run\n")


@pytest.mark.parametrize("part", ["model", "tokenizer"])
def test_a_local_folder_with_custom_code_says_trust_remote_code(recipe, tiny_lm, tmp_path, capsys, part):
    model = _model_copy(tiny_lm, tmp_path / "model")
    if part == "model":
        auto_map = {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"}
        _with_auto_map(model, "config.json", model_type="custom-llama", auto_map=auto_map)
        args = _args(tiny_lm, tmp_path / "out", model=model)
    else:
        auto_map = {"AutoTokenizer": ["custom.Tokenizer", None]}
        _with_auto_map(model, "tokenizer_config.json", tokenizer_class="CustomTokenizer", auto_map=auto_map)
        args = [*_args(tiny_lm, tmp_path / "out"), "--tokenizer", str(model)]
    before = snapshot(tmp_path)
    err = fails(
        recipe,
        args,
        capsys,
        f"{part}={str(model)!r} is a folder with its own code",
        "custom.",
        "Pass --trust-remote-code to run it, only if you trust the code",
    )
    assert "check the id and the network" not in err
    assert snapshot(tmp_path) == before


def test_control_characters_from_a_config_are_escaped(recipe, tiny_lm, tmp_path, capsys):
    model = _model_copy(tiny_lm, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "ll\u202eam\x00a"}))
    err = fails(recipe, _args(tiny_lm, tmp_path / "out", model=model), capsys, "ll\\u202eam\\x00a")
    assert "\u202e" not in err and "\x00" not in err


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a chosen size (root only: skipped where it cannot be mounted)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / "disk"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, timeout=30
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], timeout=30, check=False)


def _disk_bytes(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in [path, *path.rglob("*")])


def test_a_full_disk_during_a_save_is_one_message_and_the_run_resumes(recipe, tiny_lm, tmp_path, capsys, small_disk):
    """Room for the run with 2 checkpoints and half of a third: the third save fails for real
    (ENOSPC from safetensors or torch.save); the message names the disk and the bytes, the two
    checkpoints stay intact, and the run resumed elsewhere ends as an uninterrupted one."""
    common = ("--max-steps", "8", "--save-every", "2", "--keep-last", "3")
    reference = tmp_path / "reference"
    run(recipe, _args(tiny_lm, reference, *common))
    two = tmp_path / "two"
    run(recipe, _args(tiny_lm, two, *common, "--stop-after", "4"))
    one_checkpoint = _disk_bytes(list_checkpoints(two)[-1].path)
    disk = small_disk(_disk_bytes(two) + one_checkpoint // 2)
    out = disk / "out"
    err = fails(
        recipe,
        _args(tiny_lm, out, *common),
        capsys,
        f"no space left on the disk holding {out / 'checkpoints'} (mounted at {disk})",
        "step-0000006.tmp",
        "bytes) are free",
        "The earlier checkpoints are intact",
        f"The newest checkpoint is {out / 'checkpoints' / 'step-0000004'} (step 4)",
        "--resume-from latest",
    )
    assert "Traceback" not in err
    assert [(c.step, c.problem) for c in list_checkpoints(out)] == [(2, None), (4, None)]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]
    # Intact: resumed on a disk with room, the run ends bitwise equal to the uninterrupted one.
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    run(recipe, _args(tiny_lm, moved, *common, "--resume-from", "latest"))
    assert_same_weights(reference, moved)


def test_a_full_disk_during_the_final_models_save(recipe, tiny_lm, tmp_path, capsys, small_disk):
    """Room for the checkpoint of the last step, not for the final model: the message says so, no
    model.tmp is left, and resuming from that checkpoint on a disk with room writes the same model."""
    common = ("--max-steps", "4", "--save-every", "4")
    reference = tmp_path / "reference"
    run(recipe, _args(tiny_lm, reference, *common))
    disk = small_disk(_disk_bytes(reference) - _disk_bytes(reference / "model") // 2)
    out = disk / "out"
    fails(
        recipe,
        _args(tiny_lm, out, *common),
        capsys,
        f"no space left on the disk holding {out} (mounted at {disk}) while writing the final model",
        f"The newest checkpoint is {out / 'checkpoints' / 'step-0000004'} (step 4)",
    )
    assert not (out / "model").exists() and not (out / "model.tmp").exists()
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)
    run(recipe, _args(tiny_lm, moved, *common, "--resume-from", "latest"))
    assert_same_weights(reference, moved)


# ----------------------------------------------------------------------------- SIGINT, SIGTERM
def _signalled(args: list[str], sig: int, hang_at: str) -> tuple[int, str]:
    """The recipe in a subprocess, hung by the test hook at ``hang_at`` and sent ``sig`` there."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["HF_MEMSTACK_RECIPE_TEST_HOOK"] = f"hang@{hang_at}"
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any("test hook: hanging at" in x for x in seen):
            assert proc.poll() is None, "".join(seen)[-3000:]
            seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
        proc.send_signal(sig)
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    time.sleep(0.2)  # the reader thread's last lines
    while not lines.empty():
        seen.append(lines.get())
    return status, "".join(seen)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_says_where_it_stopped_and_how_to_resume(recipe, tiny_lm, tmp_path, sig):
    common = ("--max-steps", "8", "--save-every", "2")
    reference = tmp_path / "reference"
    run(recipe, _args(tiny_lm, reference, *common))
    out = tmp_path / "out"
    status, err = _signalled(_args(tiny_lm, out, *common), sig, hang_at="step-3")
    assert status == -sig, err[-3000:]  # ended by the signal: 130 / 143 in a shell
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    said = [x for x in err.splitlines() if x.startswith("finetune.py: stopped by")]
    assert len(said) == 1, err[-3000:]
    name = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"
    newest = list_checkpoints(out)[-1]
    assert f"stopped by {name} after step 3 of 8" in said[0]
    assert f"The newest checkpoint is {newest.path} (step {newest.step})" in said[0]
    # The command it printed resumes the run, which ends as the uninterrupted one.
    command = shlex.split(said[0].split("resume from it with: ", 1)[1])
    assert command[:2] == ["python", "recipes/finetune.py"] and command[-2:] == ["--resume-from", "latest"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_MEMSTACK_RECIPE_TEST_HOOK", None)
    subprocess.run([sys.executable, *command[1:]], cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    assert_same_weights(reference, out)
