"""A model's config.json is a received file: read before Transformers reads it, bounded, never
waited on, its sizes checked before a block is built. Each case here once hung, ran for minutes,
raised RecursionError (exit 3 from the CLI) or said "missing" about a file that was there."""

import json
import os
import threading

import pytest
from tiny import LLAMA

from hf_memstack import estimate_memory
from hf_memstack.planning.model.config import load_config
from hf_memstack.planning.model.config_file import MAX_LAYERS


def _folder(tmp_path, name, config=None, **fields):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(
        config if config is not None else json.dumps({"model_type": "llama", **LLAMA, **fields})
    )
    return folder


def _raises_in_time(call, fifo=None, timeout=30):
    """The exception ``call()`` raised, run in a thread: a read blocked on a FIFO fails the test after
    ``timeout`` seconds (the FIFO is then opened for writing once, so the reader ends)."""
    out = {}

    def run():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"blocked for {timeout} s")
    assert "error" in out, "no error raised"
    return out["error"]


@pytest.mark.parametrize("kind", ["FIFO", "directory"])
def test_a_config_json_that_is_not_a_file_is_named_not_missing(tmp_path, kind):
    folder = tmp_path / "model"
    folder.mkdir()
    config = folder / "config.json"
    os.mkfifo(config) if kind == "FIFO" else config.mkdir()
    error = _raises_in_time(lambda: load_config(folder), fifo=config if kind == "FIFO" else None)
    assert isinstance(error, ValueError), repr(error)
    named = "a FIFO (named pipe)" if kind == "FIFO" else "a directory"
    assert f"{config} is {named}, not a regular file" in str(error) and "without a config.json" not in str(error)


def test_a_model_path_that_is_a_fifo_is_named(tmp_path):
    fifo = tmp_path / "model"
    os.mkfifo(fifo)
    error = _raises_in_time(lambda: load_config(str(fifo)), fifo=fifo)
    assert isinstance(error, ValueError), repr(error)
    assert f"model={str(fifo)!r} is a FIFO (named pipe), not a directory" in str(error)


def test_a_model_path_that_is_a_config_file_is_still_read(tmp_path):
    # Transformers reads a config file given by its path; checked as a folder's is, not refused.
    folder = _folder(tmp_path, "model")
    assert load_config(str(folder / "config.json")).num_hidden_layers == LLAMA["num_hidden_layers"]
    deep = _folder(tmp_path, "deep", num_hidden_layers=MAX_LAYERS + 1)
    with pytest.raises(ValueError, match=f"num_hidden_layers={MAX_LAYERS + 1}"):
        load_config(str(deep / "config.json"))


def test_json_nested_too_deeply_is_a_value_error(tmp_path):
    folder = _folder(tmp_path, "nested", config="[" * 100_000)
    with pytest.raises(ValueError, match=r"config.json is nested too deeply to read"):
        load_config(folder)


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", **LLAMA, "num_hidden_layers": MAX_LAYERS + 1},
        {"model_type": "llama", **LLAMA, "num_hidden_layers": 10**12},
        # Qwen2's config builds a list of one layer type per block: 10^7 of them before any model.
        {"model_type": "qwen2", **LLAMA, "num_hidden_layers": 10**7},
        {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 20_000},
        {"model_type": "llava", "text_config": {"model_type": "llama", **LLAMA, "num_hidden_layers": 10**9}},
    ],
    ids=["limit+1", "1e12", "qwen2-1e7", "gpt2-n_layer", "llava-text_config"],
)
def test_a_stack_deeper_than_any_model_is_refused_before_it_is_built(tmp_path, config):
    """20,000 blocks took 83 s to estimate, 10^9 never ended (every block is built on meta)."""
    folder = _folder(tmp_path, "deep", config=json.dumps(config))
    field, value = next(
        (k, v)
        for d in (config, config.get("text_config", {}))
        for k, v in d.items()
        if k in ("num_hidden_layers", "n_layer")
    )
    with pytest.raises(ValueError, match=f"{field}={value}: a stack of more than {MAX_LAYERS:,} blocks"):
        load_config(folder)


def test_the_depth_limit_holds_for_dicts_and_config_objects():
    from transformers import LlamaConfig

    at_limit = {"model_type": "llama", **LLAMA, "num_hidden_layers": MAX_LAYERS}
    assert load_config(at_limit).num_hidden_layers == MAX_LAYERS
    for model in (
        {**at_limit, "num_hidden_layers": MAX_LAYERS + 1},
        LlamaConfig(**{**LLAMA, "num_hidden_layers": MAX_LAYERS + 1}),
    ):
        with pytest.raises(ValueError, match=f"num_hidden_layers={MAX_LAYERS + 1}: a stack of more than"):
            load_config(model)


def test_key_value_heads_that_do_not_divide_the_heads_are_named(tmp_path):
    # Was torch's "The size of tensor a (4) must match the size of tensor b (3)" from inside the trace.
    folder = _folder(tmp_path, "gqa", num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3, which does not divide num_attention_heads=4"):
        estimate_memory(folder, "bf16", batch_size=1, seq_len=16)


def test_a_model_type_with_control_characters_is_escaped(tmp_path):
    folder = _folder(tmp_path, "rlo", config=json.dumps({"model_type": "lla\u202ema\x00", **LLAMA}))
    with pytest.raises(ValueError) as raised:
        load_config(folder)
    assert "model_type='lla\\u202ema\\x00', which Transformers" in str(raised.value)
    assert "\u202e" not in str(raised.value) and "\x00" not in str(raised.value)


def test_a_sharded_index_nested_too_deeply_is_not_a_recursion_error(tmp_path):
    """The weights' dtype is read from model.safetensors.index.json when the config names none."""
    from hf_memstack.planning.estimate.weights_dtype import resolve_weights_dtype

    folder = _folder(tmp_path, "sharded")
    (folder / "model.safetensors.index.json").write_text("[" * 100_000)
    found = resolve_weights_dtype(str(folder), load_config(folder), "auto")  # an unreadable index is skipped
    assert found.source == "fp32: the config names no dtype and no weights file was found"
