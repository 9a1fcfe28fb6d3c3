"""TRL's preference and RL trainers (DPO, KTO, reward, GRPO) with MemstackCallback on: each trains
3 steps to the losses of the unprepared trainer, the callback's first-batch pass runs the
trainer's own loss (or steps aside, saying why), and what the trainer runs outside the policy is
reported. Tiny Llama, datasets built here, no Hub."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_memstack import prepare_model
from hf_memstack.integrations.trainer import MemstackCallback

trl = pytest.importorskip("trl")

WORDS = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
# bf16 noise over 3 steps at lr 1e-2: the prepared model autocasts where Accelerate does, but
# the two paths round a few ops differently (the issue saw 1.2e-4 on DPO).
BF16_NOISE = 2e-3


def _text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(n))


def _datasets():
    import datasets

    n = 8
    return {
        "dpo": datasets.Dataset.from_dict(
            {
                "prompt": [_text(i, 3) for i in range(n)],
                "chosen": [_text(i + 1, 3) for i in range(n)],
                "rejected": [_text(i + 5, 2) for i in range(n)],
            }
        ),
        "kto": datasets.Dataset.from_dict(
            {
                "prompt": [_text(i, 3) for i in range(n)],
                "completion": [_text(i + 1, 2 + i % 3) for i in range(n)],
                "label": [i % 2 == 0 for i in range(n)],
            }
        ),
        "reward": datasets.Dataset.from_dict(
            {"chosen": [_text(i, 4) for i in range(n)], "rejected": [_text(i + 5, 3) for i in range(n)]}
        ),
        "grpo": datasets.Dataset.from_dict({"prompt": [_text(i, 3) for i in range(n)]}),
    }


def _reward_words(completions, **kwargs):
    """GRPO's reward: the words sampled before the end (it varies between the completions of a prompt)."""
    return [float(len(c.split())) for c in completions]


def _config(kind: str, tmp_path, **overrides):
    fields = {
        "output_dir": str(tmp_path / kind),
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "report_to": [],
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
        "gradient_checkpointing": False,
        **overrides,
    }
    if kind == "grpo":
        fields.update(per_device_train_batch_size=4, num_generations=2, max_completion_length=4)
    config = {"dpo": trl.DPOConfig, "kto": trl.KTOConfig, "reward": trl.RewardConfig, "grpo": trl.GRPOConfig}[kind]
    return config(**fields)


def _model(kind: str):
    from tiny import llama_config, tiny_llama

    if kind == "reward":
        from transformers import LlamaForSequenceClassification

        torch.manual_seed(0)
        return LlamaForSequenceClassification(llama_config(num_labels=1, pad_token_id=0)).train()
    return tiny_llama(seed=0)


def _lora(kind: str):
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="SEQ_CLS" if kind == "reward" else "CAUSAL_LM",
    )


def _trainer(kind, model, tokenizer, config, *, callbacks=None, peft=False):
    data = _datasets()[kind]
    common = {"model": model, "args": config, "train_dataset": data, "processing_class": tokenizer}
    common |= {"callbacks": callbacks, "peft_config": _lora(kind) if peft else None}
    if kind in ("dpo", "kto") and not peft:
        common["ref_model"] = _model(kind)  # a tiny model has no Hub path TRL could load the reference from
    cls = {"dpo": trl.DPOTrainer, "kto": trl.KTOTrainer, "reward": trl.RewardTrainer, "grpo": trl.GRPOTrainer}[kind]
    if kind == "grpo":
        common["reward_funcs"] = _reward_words
    return cls(**common)


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _train(kind, tokenizer, tmp_path, *, policy, callback=None, peft=False, **overrides):
    model = _model(kind)
    if policy is not None:
        model = prepare_model(model, policy)
    trainer = _trainer(
        kind,
        model,
        tokenizer,
        _config(kind, tmp_path, **overrides),
        callbacks=[callback] if callback else None,
        peft=peft,
    )
    trainer.train()
    return trainer


CASES = [
    pytest.param("dpo", False, True, id="dpo-full-bf16"),
    pytest.param("dpo", True, False, id="dpo-lora-bf16_false"),
    pytest.param("kto", False, True, id="kto-full-bf16"),
    pytest.param("reward", False, True, id="reward-full-bf16"),
    pytest.param("reward", True, False, id="reward-lora-bf16_false"),
]


@pytest.mark.parametrize("kind, peft, bf16", CASES)
def test_preference_trainers_train_with_the_callback_to_the_unprepared_losses(
    word_tokenizer, tmp_path, kind, peft, bf16
):
    """The callback's first-batch pass runs the trainer's own compute_loss on the trainer's own
    batch (it used to run the model on a batch without labels: TRL's fused head raised TypeError,
    the reward model returned no loss): verify passes there, the meter measures it, the metrics the
    trainer logs are not moved by the extra pass, and the 3 losses are the unprepared trainer's."""
    callback = MemstackCallback()
    ours = _train(kind, word_tokenizer, tmp_path, policy="bf16", callback=callback, peft=peft, bf16=bf16)
    reference = _train(kind, word_tokenizer, tmp_path, policy=None, peft=peft, bf16=True)
    losses, expected = _logged(ours, "loss"), _logged(reference, "loss")
    assert len(losses) == 3 and losses == pytest.approx(expected, abs=BF16_NOISE), (losses, expected)
    first = callback.first_step
    assert first.skipped is None and first.verify is not None and first.verify.ok, first
    assert "bfloat16" in first.verify.check("precision").detail
    assert first.memory is not None and first.memory.peak_bytes > 0
    # The pass's own compute_loss left no trace in the trainer's metrics (token counts add up per step).
    assert _logged(ours, "num_tokens") == _logged(reference, "num_tokens")
    assert [h["memstack/verify_ok"] for h in ours.state.log_history if "loss" in h] == [1.0] * 3


def test_a_reference_model_outside_the_policy_is_reported(word_tokenizer, tmp_path, caplog):
    """DPOTrainer's reference model runs its own forwards inside compute_loss: prepare_model never saw
    it, which the log says; with LoRA the reference is the policy model itself, and nothing is said."""
    with caplog.at_level(logging.INFO, logger="hf_memstack"):
        _train("dpo", word_tokenizer, tmp_path, policy="bf16", callback=MemstackCallback(), bf16=True)
    said = [r.getMessage() for r in caplog.records if "reference model" in r.getMessage()]
    assert len(said) == 1 and "DPOTrainer's reference model (LlamaForCausalLM" in said[0], said
    assert "outside the policy 'bf16'" in said[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_memstack"):
        _train("dpo", word_tokenizer, tmp_path, policy="bf16", callback=MemstackCallback(), peft=True, bf16=True)
    assert not [r for r in caplog.records if "reference model" in r.getMessage()]


def test_chunked_loss_under_dpo_is_reported_as_replaced_by_trl_head(word_tokenizer, tmp_path):
    """loss:chunked never runs under DPOTrainer (TRL's fused head computes the log-probabilities):
    a warning says so, and the run trains to the losses of the policy without loss:chunked."""
    with pytest.warns(UserWarning, match="TRL's trainer computes the training loss with its own chunked LM head"):
        ours = _train(
            "dpo", word_tokenizer, tmp_path, policy="bf16+loss:chunked", callback=MemstackCallback(), bf16=True
        )
    plain = _train("dpo", word_tokenizer, tmp_path, policy="bf16", bf16=True)
    assert _logged(ours, "loss") == pytest.approx(_logged(plain, "loss"), abs=1e-6)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_dpo_with_chunked_loss_runs_verify_and_the_meter_on_the_first_batch(word_tokenizer, tmp_path, peft):
    """verify's loss-head check ran DPOTrainer's compute_loss on one sample of its [chosen; rejected]
    batch (TRL's logps.chunk(2) raised ValueError) and the whole first-batch pass was skipped. The
    chunked head does not run under the trainer's own loss (TRL's head replaces it): the check now
    says so, the other checks and the meter run, and the run trains to the unprepared losses."""
    callback = MemstackCallback(raise_on_failure=True)
    with pytest.warns(UserWarning, match="TRL's trainer computes the training loss with its own chunked LM head"):
        ours = _train("dpo", word_tokenizer, tmp_path, policy="bf16+ckpt+loss:chunked", callback=callback, peft=peft)
    reference = _train("dpo", word_tokenizer, tmp_path, policy=None, peft=peft, bf16=True)
    losses, expected = _logged(ours, "loss"), _logged(reference, "loss")
    assert len(losses) == 3 and losses == pytest.approx(expected, abs=BF16_NOISE), (losses, expected)
    first = callback.first_step
    assert first.skipped is None and first.verify is not None and first.verify.ok, first
    names = [c.name for c in first.verify.checks]
    assert {"policy", "checkpointing", "precision", "gradients", "loss"} <= set(names), names
    loss = first.verify.check("loss").detail
    assert loss.startswith("skipped: DPOTrainer's compute_loss") and "TRL's own chunked LM head" in loss, loss
    assert first.memory is not None and first.memory.peak_bytes > 0


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_grpo_trains_with_the_callback_which_steps_aside_saying_why(word_tokenizer, tmp_path, caplog, peft):
    """GRPOTrainer generates its batches in _prepare_inputs (the loader yields raw prompts): the
    callback ran model(*batch) on a list of dicts (TypeError). Its pass is now skipped with one log
    line naming why, and the run is the unprepared trainer's (same seed: the same samples)."""
    callback = MemstackCallback()
    with caplog.at_level(logging.INFO, logger="hf_memstack"):
        ours = _train("grpo", word_tokenizer, tmp_path, policy="bf16", callback=callback, peft=peft, bf16=True)
    skipped = [r.getMessage() for r in caplog.records if "are skipped" in r.getMessage()]
    assert len(skipped) == 1 and "GRPOTrainer prepares each batch in its own _prepare_inputs" in skipped[0], skipped
    assert callback.first_step.verify is None and callback.first_step.memory is None
    assert "_prepare_inputs" in callback.first_step.skipped
    reference = _train("grpo", word_tokenizer, tmp_path, policy=None, peft=peft, bf16=True)
    # The samples (their rewards), the policy's entropy on them and the gradients they gave; GRPO's
    # loss itself is ~0 on-policy (its advantages sum to 0), so it is compared but tells little.
    for key in ("reward", "reward_std", "entropy", "grad_norm", "loss"):
        assert len(_logged(ours, key)) == 3
        assert _logged(ours, key) == pytest.approx(_logged(reference, key), abs=BF16_NOISE), key
    assert any(r > 0 for r in _logged(ours, "reward_std"))  # the rewards varied: the steps trained
