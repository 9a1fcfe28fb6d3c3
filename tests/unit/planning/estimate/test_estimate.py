import pytest
import torch
from tiny import make_batch

from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model

POLICIES = ["fp32", "bf16", "bf16+ckpt", "bf16+ckpt:2"]
# The smallest batch and one 4x larger: the estimate traces each at its own batch (one code path), so a
# batch between them checks nothing these two do not (it was [1, 2, 4]: a third of the time for no branch).
BATCHES = [1, 4]


def _measured(load_model, arch, policy, batch, seq=16):
    model = prepare_model(load_model(arch), policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return measure_step(model, make_batch(arch, batch_size=batch, seq=seq), opt, timed=False)


@pytest.mark.parametrize("arch, task", [("llama", "causal-lm"), ("gpt2", "causal-lm"), ("bert", "classification")])
def test_estimate_within_ten_percent_of_the_meter(load_model, pretrained_dirs, arch, task):
    errors = {}
    for policy in POLICIES:
        for batch in BATCHES:
            est = estimate_memory(pretrained_dirs[arch], policy, batch_size=batch, seq_len=16, task=task)
            real = _measured(load_model, arch, policy, batch)
            errors[(policy, batch)] = est.peak_bytes / real.peak_bytes - 1
            assert est.parameters == real.parameters
    assert all(abs(e) <= 0.10 for e in errors.values()), errors


@pytest.mark.parametrize(
    "arch, policy",
    [
        ("llama", "bf16+loss:chunked"),
        ("gpt2", "bf16+ckpt+loss:chunked"),
        ("llama", "bf16+ckpt:selective"),
        ("gpt2", "bf16+ckpt:selective:alternate"),
        ("llama", "bf16+ckpt+optim:in_backward"),
        ("llama", "bf16+ckpt+optim:8bit"),
        ("llama", "bf16+ckpt:selective+loss:chunked+optim:8bit+optim:in_backward"),
    ],
)
def test_new_rungs_estimated_within_ten_percent_of_the_meter(load_model, pretrained_dirs, arch, policy):
    est = estimate_memory(pretrained_dirs[arch], policy, batch_size=4, seq_len=16)
    model = prepare_model(load_model(arch), policy)
    real = measure_step(model, make_batch(arch, batch_size=4), make_optimizer(model, lr=1e-4), timed=False)
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= 0.10, (est, real)
    # The optimizer rungs' state is traced through the same optimizer: its bytes agree exactly.
    assert (est.parameters, est.optimizer) == (real.parameters, real.optimizer)


def test_breakdown_counts_frozen_parameters_and_shards(pretrained_dirs):
    full = estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=2, seq_len=16)
    assert full.trainable_parameters == full.total_parameters
    assert full.optimizer >= 2 * 4 * full.trainable_parameters  # two fp32 AdamW moments
    lora = estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=2, seq_len=16, trainable="lora")
    assert lora.total_parameters > full.total_parameters > lora.trainable_parameters
    # Frozen weights: parameters, but no gradient and no optimizer state.
    assert 2 * 4 * lora.trainable_parameters <= lora.optimizer < 2 * 4 * lora.trainable_parameters + 4096
    assert lora.gradients <= 4 * lora.trainable_parameters and lora.parameters >= full.parameters
    sharded = estimate_memory(pretrained_dirs["llama"], "bf16+ckpt+fsdp", batch_size=2, seq_len=16, world_size=4)
    unsharded = estimate_memory(pretrained_dirs["llama"], "bf16+ckpt", batch_size=2, seq_len=16)
    assert sharded.optimizer <= unsharded.optimizer / 4 + 1 and sharded.gradients <= unsharded.gradients / 4 + 1
    sgd = estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=2, seq_len=16, optimizer="sgd")
    assert sgd.optimizer == 0


def test_checkpointing_shrinks_the_estimated_activations(pretrained_dirs):
    plain = estimate_memory(pretrained_dirs["llama"], "bf16", batch_size=8, seq_len=64)
    ckpt = estimate_memory(pretrained_dirs["llama"], "bf16+ckpt", batch_size=8, seq_len=64)
    assert ckpt.activations < 0.5 * plain.activations and ckpt.peak_bytes < plain.peak_bytes


def test_the_task_comes_from_the_saved_model(pretrained_dirs, load_model):
    """A saved BertForSequenceClassification is estimated as one (not as a BERT language model), and
    loss:chunked is refused for it as prepare_model refuses it."""
    from hf_memstack.planning.estimate import infer_task

    saved = pretrained_dirs["bert"]
    from hf_memstack.planning.estimate import load_config

    assert infer_task(str(saved), load_config(saved)) == infer_task(load_model("bert"), None) == "classification"
    assert infer_task(str(pretrained_dirs["llama"]), load_config(pretrained_dirs["llama"])) == "causal-lm"
    inferred = estimate_memory(saved, "fp32", batch_size=2, seq_len=16)
    explicit = estimate_memory(saved, "fp32", batch_size=2, seq_len=16, task="classification")
    from hf_memstack.measure import model_state_bytes

    # Parameters and buffers, as the real classifier holds them (a BERT language model's differ).
    assert inferred.parameters == explicit.parameters == model_state_bytes(load_model("bert")).parameters
    with pytest.raises(ValueError, match="needs a causal language model"):
        estimate_memory(saved, "fp32+loss:chunked", batch_size=2, seq_len=16)


@pytest.mark.parametrize(
    "head, task",
    [
        ("BertModel", "classification"),
        ("BertForMaskedLM", "classification"),
        ("BertLMHeadModel", "causal-lm"),
        ("LlamaModel", "causal-lm"),
    ],
)
def test_a_base_or_masked_lm_encoder_is_estimated_as_a_classifier(tmp_path, head, task):
    """A BertModel checkpoint (the recipe's MiniLM) is an encoder, not a causal LM: estimated with a
    classification head (as the recipe fine-tunes it), said in the notes; a BERT saved as a decoder
    (BertLMHeadModel, is_decoder=True) and a base Llama stay causal LMs."""
    import transformers
    from tiny import configs

    from hf_memstack.planning.estimate import infer_task, load_config

    config = configs()["llama" if head.startswith("Llama") else "bert"]
    config.is_decoder = head == "BertLMHeadModel"
    getattr(transformers, head)(config).save_pretrained(tmp_path)
    assert infer_task(str(tmp_path), load_config(tmp_path)) == task
    inferred = estimate_memory(tmp_path, "fp32", batch_size=2, seq_len=16)
    explicit = estimate_memory(tmp_path, "fp32", batch_size=2, seq_len=16, task=task)
    assert (inferred.parameters, inferred.peak_bytes) == (explicit.parameters, explicit.peak_bytes)
    assert any("task: classification" in n for n in inferred.notes) == (
        task == "classification" and head != "BertLMHeadModel"
    )


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"batch_size": -1}, "batch_size=-1 must be a positive integer"),
        ({"seq_len": 4096}, "seq_len=4096 is above the model's limit of 64"),
        ({"optimizer": "lion"}, "optimizer='lion' is not one of"),
    ],
)
def test_estimate_bad_input(pretrained_dirs, kwargs, fragment):
    args = {"batch_size": 1, "seq_len": 16, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        estimate_memory(pretrained_dirs["llama"], "bf16", **args)


def test_unknown_model_offline_is_a_clear_error():
    with pytest.raises(
        ValueError, match="not a local directory with a config.json and not in the local Hugging Face cache"
    ):
        estimate_memory("no-such-org/no-such-model", "bf16", batch_size=1, seq_len=16)


def test_a_typo_of_a_local_folder_names_the_folder_not_the_hub(pretrained_dirs, tmp_path, monkeypatch):
    import shutil

    shutil.copytree(pretrained_dirs["llama"], tmp_path / "llama-7b-config")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="did you mean the folder 'llama-7b-config'") as e:
        estimate_memory("llama-7b-confg", "bf16", batch_size=1, seq_len=16)
    assert "hf download" not in str(e.value)
    assert estimate_memory("llama-7b-config", "bf16", batch_size=1, seq_len=16).peak_bytes > 0  # the folder itself


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_the_estimator_refuses_loss_chunked_exactly_where_prepare_model_does(arch):
    """BERT's LM head (dense + activation + LayerNorm before the output layer) is not what the chunked
    loss computes: prepare_model refuses it on real weights; the estimator, on fake ones, used to return a number."""
    import transformers
    from tiny import configs

    config = configs()[arch]
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "gpt2": transformers.GPT2LMHeadModel,
        "bert": transformers.BertLMHeadModel,
    }[arch]
    torch.manual_seed(0)
    try:
        prepare_model(cls(config).train(), "fp32+loss:chunked")
        refused = None
    except ValueError as e:
        refused = str(e)
    assert (refused is not None) == (arch == "bert")
    if refused is None:
        estimate = estimate_memory(config, "fp32+loss:chunked", batch_size=2, seq_len=16, task="causal-lm")
        # Accepted, and checked (no "not compared" note).
        assert estimate.peak_bytes > 0 and not any("not compared" in n for n in estimate.notes)
    else:
        with pytest.raises(
            ValueError, match="on BertLMHeadModel the chunked loss .* differs from the model's own"
        ) as e:
            estimate_memory(config, "fp32+loss:chunked", batch_size=2, seq_len=16, task="causal-lm")
        assert "Drop loss:chunked" in str(e.value) and "Drop loss:chunked" in refused


def test_a_config_dict_is_estimated_as_its_config(pretrained_dirs):
    """config.to_dict() used to fail with OSError: File name too long (it was read as a path)."""
    from hf_memstack.planning.estimate import load_config

    config = load_config(pretrained_dirs["llama"])
    as_dict = estimate_memory(config.to_dict(), "bf16+ckpt", batch_size=2, seq_len=16)
    as_config = estimate_memory(config, "bf16+ckpt", batch_size=2, seq_len=16)
    assert as_dict.peak_bytes == as_config.peak_bytes and as_dict.total_parameters == as_config.total_parameters


def _copy_with_config(src, dst, edit):
    import json
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    edit(data)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_a_misspelled_field_in_a_directorys_config_is_refused(pretrained_dirs, tmp_path):
    # Found by a new-user trial: the dict was checked, the directory was not (a 4096-wide model was estimated).
    folder = _copy_with_config(
        pretrained_dirs["llama"], tmp_path / "typo", lambda d: d.update(hiden_size=d.pop("hidden_size"))
    )
    before = (folder / "config.json").read_bytes()
    with pytest.raises(ValueError, match=r"config.json with 'hiden_size'.*did you mean 'hidden_size'\?"):
        estimate_memory(folder, "bf16", batch_size=1, seq_len=16)
    assert (folder / "config.json").read_bytes() == before


def test_a_config_of_custom_code_is_refused_as_such(pretrained_dirs, tmp_path):
    def custom(d):
        d.update(model_type="mine", auto_map={"AutoConfig": "configuration_mine.MineConfig"})

    folder = _copy_with_config(pretrained_dirs["llama"], tmp_path / "custom", custom)
    (folder / "configuration_mine.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    with pytest.raises(ValueError, match=r"custom code in its folder, which hf_memstack does not run"):
        estimate_memory(folder, "bf16", batch_size=1, seq_len=16)
    assert not (tmp_path / "ran").exists()


def test_a_peft_model_is_estimated_with_its_own_adapters(load_model):
    # Found by a new-user trial: trainable='lora' replaced the model's r=4 q/v adapters by the default ones.
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    own = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for trainable in ("all", "lora"):
        est = estimate_memory(model, "bf16", batch_size=1, seq_len=16, trainable=trainable)
        assert est.trainable_parameters == own
    with pytest.raises(ValueError, match=r"trainable=\{'r': 16\} with a PEFT model .* adapters of its own"):
        estimate_memory(model, "bf16", batch_size=1, seq_len=16, trainable={"r": 16})


def test_a_prepared_model_is_estimated_under_its_own_policy(load_model):
    """No policy given: a prepared model's own (model.memstack), not plain fp32 - which counted a
    bf16+ckpt model 57% over MemTracker as a run without checkpointing; an unprepared model: fp32."""
    model = prepare_model(load_model("llama"), "bf16+ckpt")
    own = estimate_memory(model, batch_size=2, seq_len=16)
    given = estimate_memory(model, "bf16+ckpt", batch_size=2, seq_len=16)
    assert (own.policy, own.peak_bytes) == (given.policy, given.peak_bytes)
    plain = estimate_memory(load_model("llama"), batch_size=2, seq_len=16)
    assert plain.policy == estimate_memory(load_model("llama"), "fp32", batch_size=2, seq_len=16).policy
    assert plain.policy != own.policy
