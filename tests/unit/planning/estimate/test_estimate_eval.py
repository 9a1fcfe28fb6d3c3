"""The evaluation phase of the estimate (``mode="eval"``) against what really runs: the forward's peak
against the meter on the loaded model's ``model.eval()`` + ``torch.no_grad()`` forward (a tiny Llama
saved in bf16 and in fp32), and the logits it says Trainer keeps against what a real
``Trainer.predict()`` / ``evaluate()`` kept (the predictions' bytes, and the tensors the evaluation
loop received batch by batch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from hf_memstack import estimate_memory, prepare_model
from hf_memstack.measure.memory import measure_eval_forward

SEQ, BATCH, SAMPLES = 32, 2, 10
LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **LLAMA)).to(dtype).save_pretrained(root / name)
        out[name] = root / name
    torch.manual_seed(0)
    BertForSequenceClassification(
        BertConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=256,
            max_position_embeddings=64,
            num_labels=3,
        )
    ).save_pretrained(root / "bert")
    out["bert"] = root / "bert"
    return out


def _ids(n: int) -> torch.Tensor:
    return torch.randint(3, 256, (n, SEQ), generator=torch.Generator().manual_seed(n))


@pytest.mark.filterwarnings(
    "ignore:.*trainable.*:UserWarning"
)  # prepare_model on bf16 weights says they train in place
@pytest.mark.parametrize("weights", ["bf16", "fp32"])
@pytest.mark.parametrize("policy", ["bf16", "bf16+ckpt", "fp32"])
def test_the_eval_forward_estimate_is_the_meters(saved, weights, policy):
    model = prepare_model(AutoModelForCausalLM.from_pretrained(saved[weights]).eval(), policy)
    ids = _ids(BATCH)
    real = measure_eval_forward(model, {"input_ids": ids, "labels": ids.clone()})
    est = estimate_memory(saved[weights], policy, batch_size=BATCH, seq_len=SEQ, mode="eval")
    assert (est.mode, est.peak_phase, est.weights_dtype) == ("eval", "forward", weights)
    assert est.peak_bytes == real.peak_bytes and est.parameters == real.parameters
    assert est.gradients == real.gradients == 0 and est.optimizer == real.optimizer == 0
    # Nothing is saved for a backward under no_grad: the rest of the peak is the forward's temporaries.
    assert est.activations == 0 and est.temporaries == real.peak_bytes - real.parameters
    # Far below the training step's peak, which holds gradients and saved activations too.
    assert est.peak_bytes < estimate_memory(saved[weights], policy, batch_size=BATCH, seq_len=SEQ).peak_bytes


def _trainer(model, tmp_path, dataset, **kwargs):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True
    )
    return Trainer(model=model, args=args, eval_dataset=dataset, **kwargs)


def _dataset(task: str):
    import datasets

    ids = _ids(SAMPLES)
    rows = {"input_ids": ids.tolist()}
    rows["labels"] = ids.tolist() if task == "causal-lm" else [i % 3 for i in range(SAMPLES)]
    return datasets.Dataset.from_dict(rows)


@pytest.mark.filterwarnings("ignore:.*trainable.*:UserWarning")
@pytest.mark.parametrize(
    ("weights", "policy", "task"),
    [("bf16", "fp32", "causal-lm"), ("bf16", "bf16", "causal-lm"), ("fp32", "fp32", "classification")],
)
def test_the_kept_logits_are_what_trainer_kept(saved, tmp_path, weights, policy, task):
    """bf16 weights under an fp32 policy return bf16 logits (numpy makes them fp32 on the host: twice the
    bytes); a bf16 policy returns fp32 ones; a classifier keeps num_labels a sample."""
    path = saved["bert"] if task == "classification" else saved[weights]
    est = estimate_memory(path, policy, batch_size=4, seq_len=SEQ, mode="eval", eval_samples=SAMPLES, task=task)
    load = BertForSequenceClassification if task == "classification" else AutoModelForCausalLM
    model = prepare_model(load.from_pretrained(path).eval(), policy)
    received: list[int] = []

    def keep(logits, labels):  # what the evaluation loop is about to add to its container, batch by batch
        received.append(logits.nbytes)
        return logits

    trainer = _trainer(
        model, tmp_path, _dataset(task), preprocess_logits_for_metrics=keep, compute_metrics=lambda p: {}
    )
    predictions = trainer.predict(_dataset(task)).predictions
    assert est.eval_logits_host_bytes == predictions.nbytes
    assert est.eval_logits_bytes == sum(received)
    received.clear()
    trainer.evaluate()  # evaluate() with compute_metrics keeps the same
    assert est.eval_logits_bytes == sum(received)


def test_eval_mode_extrapolates_across_depth_as_the_full_trace():
    config = LlamaConfig(num_hidden_layers=12, **LLAMA)
    fast = estimate_memory(config, "bf16+ckpt", batch_size=BATCH, seq_len=SEQ, mode="eval", eval_samples=100)
    full = estimate_memory(
        config, "bf16+ckpt", batch_size=BATCH, seq_len=SEQ, mode="eval", eval_samples=100, extrapolate=False
    )
    assert any("extrapolated" in n for n in fast.notes) and not any("extrapolated" in n for n in full.notes)
    # The depth extrapolation's per-block reading aside (a full trace does not take it): every field equal.
    apart = {"notes": (), "activations_per_block": 0, "blocks": 0}
    assert dataclasses.replace(fast, **apart) == dataclasses.replace(full, **apart)
    assert fast.eval_logits_bytes == 100 * SEQ * 256 * 4  # fp32 logits under autocast: samples x seq x vocab x 4


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"mode": "inference"}, "mode='inference' is not one of 'train'"),
        ({"mode": "eval", "eval_samples": 0}, "eval_samples=0 must be a positive integer"),
        ({"mode": "eval", "eval_samples": True}, "eval_samples=True must be a positive integer"),
        ({"eval_samples": 100}, "eval_samples=100 is only used with mode='eval'"),
    ],
)
def test_bad_eval_arguments_are_refused_naming_them(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        estimate_memory(LlamaConfig(num_hidden_layers=2, **LLAMA), "bf16", batch_size=BATCH, seq_len=SEQ, **kwargs)
