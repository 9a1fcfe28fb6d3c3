"""The callback's warning about the logits ``Trainer.evaluate()`` keeps: it fires before training for a
budget smaller than them - the bytes it names are what a real ``Trainer.predict()`` kept - and is
silent when Trainer keeps none (``prediction_loss_only``), keeps less (``preprocess_logits_for_metrics``,
``eval_accumulation_steps``), or never evaluates."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny import VOCAB

from hf_memstack import prepare_model
from hf_memstack.integrations.trainer import MemstackCallback, check_eval_logits
from hf_memstack.sizes import format_bytes

SEQ, SAMPLES = 16, 20


def _dataset(n: int = SAMPLES):
    import datasets

    ids = torch.randint(3, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def _trainer(load_model, tmp_path, callback=None, **overrides):
    from transformers import Trainer, TrainingArguments

    trainer_kwargs = {k: overrides.pop(k) for k in ("preprocess_logits_for_metrics",) if k in overrides}
    fields = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 1,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "eval_strategy": "steps",
        "eval_steps": 100,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        **overrides,
    }
    model = prepare_model(load_model("llama"), "fp32")
    return Trainer(
        model=model,
        args=TrainingArguments(**fields),
        train_dataset=_dataset(8),
        eval_dataset=_dataset(),
        compute_metrics=lambda p: {},
        callbacks=[callback] if callback else None,
        **trainer_kwargs,
    )


def _train_and_hear(trainer) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in caught if "Trainer.evaluate() will keep" in str(w.message)]


def _predicted_bytes(trainer) -> int:
    return trainer.predict(trainer.eval_dataset).predictions.nbytes


def test_the_warning_fires_for_a_budget_below_the_kept_logits_naming_them(load_model, tmp_path):
    reference = _trainer(load_model, tmp_path)
    real = _predicted_bytes(reference)
    assert (
        real == SAMPLES * SEQ * VOCAB * 4
    )  # fp32 logits, every sample, every position (a sanity check of the reference)
    # The device holds the model too (as the CLI's eval budget counts the forward's peak with the logits).
    model = sum(p.nbytes for p in reference.model.parameters()) + sum(b.nbytes for b in reference.model.buffers())
    budget = real + model
    heard = _train_and_hear(
        _trainer(load_model, tmp_path, MemstackCallback(verify=False, measure=False, eval_budget=budget - 1))
    )
    assert len(heard) == 1
    assert (
        f"keep {format_bytes(real)} of model outputs" in heard[0]
        and f"budget of {format_bytes(budget - 1)}" in heard[0]
    )
    assert f"model's {format_bytes(model)} of parameters" in heard[0]
    assert "prediction_loss_only=True" in heard[0] and "eval_accumulation_steps" in heard[0] and "argmax" in heard[0]
    # At the budget exactly, they fit: silent.
    assert not _train_and_hear(
        _trainer(load_model, tmp_path, MemstackCallback(verify=False, measure=False, eval_budget=budget))
    )


@pytest.mark.parametrize("overrides", [{"prediction_loss_only": True}, {"eval_strategy": "no"}])
def test_silent_when_trainer_keeps_no_logits_or_never_evaluates(load_model, tmp_path, overrides):
    callback = MemstackCallback(verify=False, measure=False, eval_budget=1)
    assert not _train_and_hear(_trainer(load_model, tmp_path, callback, **overrides))


def test_what_preprocess_logits_and_accumulation_keep_is_what_is_checked(load_model, tmp_path):
    argmax = _trainer(load_model, tmp_path, preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    ids = _predicted_bytes(argmax)  # int64 ids: one a token
    model = sum(p.nbytes for p in argmax.model.parameters()) + sum(b.nbytes for b in argmax.model.buffers())
    assert check_eval_logits(argmax, ids + model) is None
    problem = check_eval_logits(argmax, ids + model - 1)
    assert problem is not None and f"keep {format_bytes(ids)}" in problem and "torch.int64" in problem
    # Every 2 batches of 4 the logits leave the device: it holds 8 samples' at most.
    accumulating = _trainer(load_model, tmp_path, eval_accumulation_steps=2)
    per_sample = _predicted_bytes(accumulating) // SAMPLES
    assert check_eval_logits(accumulating, 8 * per_sample + model) is None
    assert f"for 8 of the {SAMPLES} samples" in check_eval_logits(accumulating, 8 * per_sample + model - 1)
    # evaluate() without compute_metrics keeps no logits (it passes prediction_loss_only=True itself).
    accumulating.compute_metrics = None
    assert check_eval_logits(accumulating, 1) is None


@pytest.mark.parametrize(("budget", "error"), [("lots", ValueError), (-5, ValueError), ([1], TypeError)])
def test_a_bad_eval_budget_is_refused_at_construction_naming_it(budget, error):
    with pytest.raises(error, match="eval_budget="):
        MemstackCallback(eval_budget=budget)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on CUDA an eval log's memory/peak_mib is the allocator's peak of the evaluation"
)
def test_on_the_cpu_eval_logs_do_not_repeat_the_training_steps_memory_figure(load_model, tmp_path):
    """On the CPU, memory/peak_mib is the meter's first training batch plus the optimizer state: it
    belongs in training logs, not in the metrics evaluate() logs."""
    trainer = _trainer(load_model, tmp_path, MemstackCallback(verify=False), eval_steps=1, logging_steps=1, max_steps=2)
    trainer.train()
    training = [h for h in trainer.state.log_history if "loss" in h]
    evaluation = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(training) == 2 and len(evaluation) == 2
    assert all(h["memory/peak_mib"] > 0 for h in training)
    assert not any("memory/peak_mib" in h for h in evaluation)
