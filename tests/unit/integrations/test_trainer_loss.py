"""A Trainer whose own compute_loss makes the loss from a batch without labels: the callback's
first-batch pass runs that compute_loss (the model alone returns no loss), and when the pass
cannot run, it says why and the run trains. Tiny Llama, no Hub."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny import VOCAB, tiny_llama
from transformers import Trainer, TrainingArguments

from hf_memstack import prepare_model
from hf_memstack.integrations.trainer import MemstackCallback


class _Rows(torch.utils.data.Dataset):
    """Token rows without labels: the loss is the trainer's business."""

    def __init__(self) -> None:
        self.ids = torch.randint(3, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class _NextTokenTrainer(Trainer):
    """Its compute_loss predicts each next token itself (the batch has no labels)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"]).logits.float()
        targets = inputs["input_ids"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1))
        return loss * getattr(self, "weight", 1.0)


class _WeightedPerStep(_NextTokenTrainer):
    """Sets the loss weight in training_step (a curriculum): compute_loss cannot run before a step."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.weight = 1.0
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs) * self.weight


def _args(tmp_path):
    return TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _train(cls, tmp_path, callback=None):
    trainer = cls(
        model=prepare_model(tiny_llama(), "fp32+ckpt"),
        args=_args(tmp_path),
        train_dataset=_Rows(),
        callbacks=[callback] if callback else None,
    )
    trainer.train()
    return trainer


def test_the_pass_runs_the_trainers_own_compute_loss(tmp_path):
    """The batch holds no labels: the model alone returns no loss (the pass used to stop training with
    "returned no loss for this batch"). It now runs the trainer's compute_loss: verify passes on it,
    and the losses are those of the run without the callback."""
    callback = MemstackCallback()
    ours = _train(_NextTokenTrainer, tmp_path, callback)
    plain = _train(_NextTokenTrainer, tmp_path)
    assert _losses(ours) == pytest.approx(_losses(plain), abs=1e-6) and len(_losses(ours)) == 3
    report = callback.first_step.verify
    assert report.ok and report.recomputed_blocks == [0, 1], report
    assert callback.first_step.memory.peak_bytes > 0


def test_a_pass_that_cannot_run_is_skipped_saying_why_and_the_run_trains(tmp_path, caplog):
    """compute_loss needs what training_step sets: the pass raises AttributeError, which the callback
    logs once (naming it) before training on; raise_on_failure=True makes it stop the run instead."""
    callback = MemstackCallback()
    with caplog.at_level(logging.INFO, logger="hf_memstack"):
        ours = _train(_WeightedPerStep, tmp_path, callback)
    said = [r.getMessage() for r in caplog.records if "are skipped" in r.getMessage()]
    assert len(said) == 1 and "AttributeError" in said[0] and "'weight'" in said[0], said
    assert callback.first_step.verify is None and "AttributeError" in callback.first_step.skipped
    assert _losses(ours) == pytest.approx(_losses(_train(_WeightedPerStep, tmp_path)), abs=1e-6)
    with pytest.raises(AttributeError, match="weight"):
        _train(_WeightedPerStep, tmp_path, MemstackCallback(raise_on_failure=True))
