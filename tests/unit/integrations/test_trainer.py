"""transformers.Trainer on prepared models: default TrainingArguments train them, saved models
reload to the same logits, contradicting arguments are refused, and the helper and callback work."""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from tiny import make_batch

from hf_memstack import MemoryPolicy, prepare_model, record_of, verify
from hf_memstack.integrations.trainer import (
    MemstackCallback,
    add_memstack_callback,
    check_training_arguments,
    training_arguments,
)

ROOT = Path(__file__).resolve().parents[3]
POLICIES = ["fp32", "bf16", "bf16+ckpt", "bf16+ckpt:2", "bf16+compile:regional+ckpt", "bf16+compile+ckpt"]


def _policy(spec: str) -> MemoryPolicy:
    policy = MemoryPolicy.from_string(spec)
    policy.compile.backend = "aot_eager"  # cheap compiles; one real inductor compile lives in test_compile.py
    return policy


# ----------------------------------------------------------------------------- a drop-in forward


@pytest.mark.parametrize("spec", POLICIES)
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_prepared_forward_is_a_drop_in(load_model, arch, spec):
    plain = load_model(arch)
    model = prepare_model(load_model(arch), _policy(spec))
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    assert model.forward.__doc__ == plain.forward.__doc__ and model.forward.__name__ == "forward"
    batch = make_batch(arch)
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits
    # Pickling works where it works for the same model checkpointed by hand (Transformers' own
    # checkpointing registers a local-function hook that pickle cannot serialise).
    hand = load_model(arch)
    if model.memstack.checkpointing.method == "transformers":
        hand.activation_checkpointing_enable()
    clones = [copy.deepcopy(model)]
    try:
        pickle.dumps(hand)
    except AttributeError:
        with pytest.raises(AttributeError, match="Can't pickle local object"):
            pickle.dumps(model)
    else:
        clones.append(pickle.loads(pickle.dumps(model)))
    for clone in clones:
        assert record_of(clone).policy.to_string() == model.memstack.policy.to_string()
        assert inspect.signature(clone.forward) == inspect.signature(plain.forward)
        with torch.no_grad():
            assert torch.equal(clone(**batch).logits, expected)  # same autocast, same arithmetic


@pytest.mark.parametrize("spec", ["bf16", "bf16+ckpt"])
def test_save_pretrained_round_trip(load_model, tmp_path, spec):
    model = prepare_model(load_model("llama"), spec)
    model.save_pretrained(tmp_path)
    reloaded = prepare_model(type(model).from_pretrained(tmp_path, dtype=torch.float32).train(), spec)
    batch = make_batch("llama")
    model.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reloaded(**batch).logits)


# ----------------------------------------------------------------------------- Trainer trains it


def _lm_dataset(tokenizer):
    import datasets
    from tiny import VOCAB  # noqa: F401 - the tiny Llama's vocabulary is larger than the tokenizer's

    words = "the cat sat on a mat dog ran to park bird flew over tree fish swam in pond".split()
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(4 + i % 5)) for i in range(64)]
    return datasets.Dataset.from_dict({"text": texts}).map(lambda r: tokenizer(r["text"]), remove_columns=["text"])


def _topics(tokenizer, n=96):
    import datasets

    ds = datasets.load_dataset("json", data_files=str(ROOT / "recipes" / "data" / "topics.jsonl"))["train"].select(
        range(n)
    )
    return ds.map(lambda r: tokenizer(r["text"], truncation=True, max_length=32), batched=True, remove_columns=["text"])


def _train(model, args, dataset, collator, callbacks=None):
    from transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=callbacks)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _args(tmp_path, **overrides):
    from transformers import TrainingArguments

    fields = {
        "output_dir": str(tmp_path / "out"),
        "max_steps": 8,
        "logging_steps": 1,
        "learning_rate": 3e-3,
        "per_device_train_batch_size": 8,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        **overrides,
    }
    return TrainingArguments(**fields)


@pytest.mark.parametrize("spec", ["bf16", "bf16+ckpt", "bf16+compile:regional+ckpt"])
def test_trainer_default_arguments_train_llama(load_model, word_tokenizer, tmp_path, spec):
    from transformers import DataCollatorForLanguageModeling

    model = prepare_model(load_model("llama"), _policy(spec))
    collator = DataCollatorForLanguageModeling(word_tokenizer, mlm=False)
    trainer, losses = _train(model, _args(tmp_path), _lm_dataset(word_tokenizer), collator)
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses  # input_ids reached the model: it learned
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = prepare_model(type(model).from_pretrained(tmp_path / "saved", dtype=torch.float32), _policy(spec))
    batch = make_batch("llama")
    model.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(model(**batch).logits, reloaded(**batch).logits, atol=1e-5)


@pytest.mark.parametrize("spec", ["bf16", "bf16+ckpt"])
def test_trainer_trains_the_real_minilm_with_padding_collator(minilm_dir, tmp_path, spec):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir, num_labels=4, dtype=torch.float32)
    model = prepare_model(model.train(), spec)
    _, losses = _train(
        model,
        _args(tmp_path, learning_rate=2e-4, per_device_train_batch_size=16, max_steps=12),
        _topics(tokenizer),
        DataCollatorWithPadding(tokenizer),
    )
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses


# ----------------------------------------------------------------------------- conflicts


@pytest.mark.parametrize(
    "spec, overrides, fragment",
    [
        (
            "bf16+ckpt:2",
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"every_n_layers": 3}},
            "TrainingArguments\\(activation_checkpointing=True\\) asks for.*every_n_layers=3.*policy 'bf16\\+ckpt:2'.*"
            "set TrainingArguments\\(activation_checkpointing=False\\)",
        ),
        (
            "bf16+ckpt",
            {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
            "use_reentrant': True.*activation_checkpointing=False",
        ),
        ("bf16", {"gradient_checkpointing": True}, "no checkpointing"),
        ("fp32", {"bf16": True}, "bf16=True autocasts a model whose policy is fp32"),
        ("bf16", {"fp16": True}, "fp16=True contradicts the policy's precision 'bf16'"),
        ("bf16+compile:regional", {"torch_compile": True}, "compile the model a second time"),
    ],
)
def test_contradicting_training_arguments_are_refused_at_construction(
    load_model, word_tokenizer, tmp_path, spec, overrides, fragment
):
    from transformers import DataCollatorForLanguageModeling, Trainer

    model = prepare_model(load_model("llama"), _policy(spec))
    flags_before = [getattr(m, "gradient_checkpointing", None) for m in model.modules()]
    with pytest.raises(ValueError, match=fragment):
        Trainer(
            model=model,
            args=_args(tmp_path, **overrides),
            train_dataset=_lm_dataset(word_tokenizer),
            data_collator=DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
            callbacks=[MemstackCallback()],
        )
    assert [getattr(m, "gradient_checkpointing", None) for m in model.modules()] == flags_before


def test_without_the_callback_trainer_cannot_silently_replace_checkpointing(load_model, word_tokenizer, tmp_path):
    from transformers import DataCollatorForLanguageModeling, Trainer

    model = prepare_model(load_model("llama"), "bf16+ckpt:2")
    args = _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 3})
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_lm_dataset(word_tokenizer),
        data_collator=DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
    )
    with pytest.raises(
        RuntimeError, match="would replace the checkpointing of this model's hf_memstack policy 'bf16\\+ckpt:2'"
    ):
        trainer.train()
    assert trainer.state.global_step == 0
    assert verify(model, make_batch("llama")).recomputed_blocks == [0]  # still every 2nd block


@pytest.mark.parametrize("callbacks", [False, True], ids=["alone", "with-callback"])
def test_default_checkpointing_flag_over_the_policy_keeps_it_and_warns_once(
    load_model, word_tokenizer, tmp_path, callbacks
):
    """gradient_checkpointing=True without kwargs over a policy that checkpoints its own way
    (every 2nd block): the policy's is kept, one warning says so, the same block recomputes."""
    from transformers import DataCollatorForLanguageModeling

    model = prepare_model(load_model("llama"), "bf16+ckpt:2")
    assert check_training_arguments(model, _args(tmp_path, gradient_checkpointing=True, bf16=True)) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, losses = _train(
            model,
            _args(tmp_path, gradient_checkpointing=True, max_steps=2),
            _lm_dataset(word_tokenizer),
            DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
            callbacks=[MemstackCallback()] if callbacks else None,
        )
    assert len(losses) == 2
    assert len([w for w in caught if "the policy's checkpointing is kept" in str(w.message)]) == 1
    report = verify(model, make_batch("llama"))
    assert report.ok and report.recomputed_blocks == [0]


# ----------------------------------------------------------------------------- memory rungs in Trainer


def test_trainer_with_the_chunked_loss_and_an_optimizer_stepping_in_the_backward(load_model, word_tokenizer, tmp_path):
    """loss:chunked + optim:in_backward through Trainer, the optimizer from make_optimizer: the same
    losses as Trainer's own AdamW on the unchunked model (in-backward AdamW is the same arithmetic),
    and the callback's first-step checks update nothing."""
    from transformers import DataCollatorForLanguageModeling

    from hf_memstack import make_optimizer

    collator = DataCollatorForLanguageModeling(word_tokenizer, mlm=False)
    args = _args(tmp_path, max_steps=4, max_grad_norm=0.0, optim="adamw_torch", weight_decay=0.0)
    plain = prepare_model(load_model("llama"), "fp32")
    _, expected = _train(plain, args, _lm_dataset(word_tokenizer), collator)
    model = prepare_model(load_model("llama"), "fp32+loss:chunked+optim:in_backward")
    from transformers import Trainer

    optimizer = make_optimizer(model, lr=args.learning_rate, weight_decay=0.0)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_lm_dataset(word_tokenizer),
        data_collator=collator,
        optimizers=(optimizer, None),
        callbacks=[MemstackCallback()],
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == pytest.approx(expected, rel=1e-4), (losses, expected)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({}, "max_grad_norm=1.0.*set max_grad_norm=0"),
        (
            {"max_grad_norm": 0.0, "gradient_accumulation_steps": 2},
            "gradient_accumulation_steps=2.*cannot be accumulated",
        ),
    ],
    ids=["clipping", "accumulation"],
)
def test_in_backward_refuses_trainer_settings_it_cannot_honour(
    load_model, word_tokenizer, tmp_path, overrides, fragment
):
    from transformers import DataCollatorForLanguageModeling, Trainer

    model = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    with pytest.raises(ValueError, match=fragment):
        Trainer(
            model=model,
            args=_args(tmp_path, **overrides),
            train_dataset=_lm_dataset(word_tokenizer),
            data_collator=DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
            callbacks=[MemstackCallback()],
        )


def test_trainer_own_optimizer_is_refused_for_an_optimizer_rung(load_model, word_tokenizer, tmp_path):
    """Without optimizers=(make_optimizer(...), None) Trainer builds plain AdamW: the policy's rung
    would silently not apply. The callback stops before the first step."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    model = prepare_model(load_model("llama"), "fp32+optim:in_backward")
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, max_grad_norm=0.0),
        train_dataset=_lm_dataset(word_tokenizer),
        data_collator=DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
        callbacks=[MemstackCallback()],
    )
    with pytest.raises(ValueError, match="optimizers=\\(hf_memstack.make_optimizer"):
        trainer.train()
    assert trainer.state.global_step == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_unprepared_model_is_a_clear_error(load_model, tmp_path):
    with pytest.raises(ValueError, match="was not prepared by hf_memstack: call hf_memstack.prepare_model"):
        check_training_arguments(load_model("llama"), _args(tmp_path))


# ----------------------------------------------------------------------------- helper and callback


def test_training_arguments_from_the_finder(load_model, word_tokenizer, tmp_path):
    from transformers import DataCollatorForLanguageModeling

    model = prepare_model(load_model("llama"), "bf16+ckpt")
    collator = DataCollatorForLanguageModeling(word_tokenizer, mlm=False)
    args = training_arguments(
        model,
        output_dir=str(tmp_path / "out"),
        train_dataset=_lm_dataset(word_tokenizer),
        data_collator=collator,
        budget="24MiB",
        global_batch_size=64,
        report_to=[],
        use_cpu=True,
    )
    bs = args.per_device_train_batch_size
    assert bs != 8 and args.gradient_accumulation_steps == -(-64 // bs)  # found, not Trainer's default; ceil
    # Precision as the policy's (Trainer's autocast around the model's own: the same dtype twice).
    assert (args.bf16, args.fp16, args.torch_compile, args.gradient_checkpointing) == (True, False, False, False)
    with pytest.raises(ValueError, match="fp32 autocasts|contradicts the policy"):
        training_arguments(
            model, output_dir=str(tmp_path / "o2"), per_device_train_batch_size=4, fp16=True, report_to=[]
        )
    with pytest.raises(ValueError, match="budget= needs train_dataset"):
        training_arguments(model, output_dir=str(tmp_path / "o3"), budget="24MiB")
    # The deprecated field name most scripts still pass is checked like the current one.
    with pytest.raises(ValueError, match="use_reentrant': True"):
        training_arguments(
            model,
            output_dir=str(tmp_path / "o4"),
            per_device_train_batch_size=4,
            report_to=[],
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": True},
        )


def test_finder_and_callback_measure_a_model_loaded_in_eval_mode_as_it_trains(load_model, word_tokenizer, tmp_path):
    from transformers import DataCollatorForLanguageModeling

    model = prepare_model(load_model("llama").eval(), "bf16+ckpt")  # what from_pretrained hands back
    callback = MemstackCallback(raise_on_failure=True)
    trainer, _ = _train(
        model,
        _args(tmp_path, max_steps=2),
        _lm_dataset(word_tokenizer),
        DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
        callbacks=[callback],
    )
    assert callback.first_step.verify.ok and callback.first_step.verify.recomputed_blocks == [0, 1]
    assert any("memory/peak_mib" in entry for entry in trainer.state.log_history)  # in trainer_state.json too


def test_verify_sees_trainer_autocast_added_to_an_fp32_policy(load_model, word_tokenizer, tmp_path):
    from transformers import DataCollatorForLanguageModeling

    model = prepare_model(load_model("llama"), "fp32")
    trainer, _ = _train(
        model,
        _args(tmp_path, max_steps=1, bf16=True),
        _lm_dataset(word_tokenizer),
        DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
    )
    report = verify(trainer.model, make_batch("llama"))
    assert not report.check("policy").ok and "policy is fp32" in report.check("policy").detail


def test_callback_verifies_and_logs_memory(load_model, word_tokenizer, tmp_path):
    from transformers import DataCollatorForLanguageModeling, TrainerCallback

    class Recorder(TrainerCallback):
        logs: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    model = prepare_model(load_model("llama"), "bf16+ckpt")
    callback, recorder = MemstackCallback(), Recorder()
    before = [p.detach().clone() for p in model.parameters()]
    trainer, losses = _train(
        model,
        _args(tmp_path, max_steps=2),
        _lm_dataset(word_tokenizer),
        DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
        callbacks=[callback, recorder],
    )
    assert callback.first_step.verify.ok, str(callback.first_step.verify)
    assert callback.first_step.memory.peak_bytes > 0
    logged = [entry for entry in recorder.logs if "loss" in entry]
    assert logged and all(entry["memstack/verify_ok"] == 1.0 and entry["memory/peak_mib"] > 0 for entry in logged)
    # The callback's extra forward/backward changed no weight: a second run from the same weights,
    # without the callback, logs the same losses.
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
    _, again = _train(
        model,
        _args(tmp_path, max_steps=2),
        _lm_dataset(word_tokenizer),
        DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
    )
    assert again == losses
    third = add_memstack_callback(trainer)
    assert trainer.callback_handler.callbacks[0] is third


def test_reporting_callbacks_placed_before_the_callback_see_its_figures(load_model, word_tokenizer, tmp_path):
    """Trainer(callbacks=[...]) puts the user's callbacks after its reporting ones (TensorBoard,
    W&B); the callback moves itself first when the Trainer is built, so a reporter listed before
    it still logs memory/peak_mib."""
    from transformers import DataCollatorForLanguageModeling, TrainerCallback

    class Reporter(TrainerCallback):
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    model = prepare_model(load_model("llama"), "bf16")
    reporter, callback = Reporter(), MemstackCallback()
    trainer, _ = _train(
        model,
        _args(tmp_path, max_steps=2),
        _lm_dataset(word_tokenizer),
        DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
        callbacks=[reporter, callback],
    )
    assert trainer.callback_handler.callbacks[0] is callback
    logged = [entry for entry in reporter.logs if "loss" in entry]
    assert len(logged) == 2 and all(
        entry["memory/peak_mib"] > 0 and entry["memstack/verify_ok"] == 1.0 for entry in logged
    )
    assert add_memstack_callback(trainer) is callback and trainer.callback_handler.callbacks.count(callback) == 1


def test_verify_and_the_meter_share_one_extra_forward(load_model, word_tokenizer, tmp_path):
    """Before the first step the callback runs one extra forward + backward, for verify and the
    meter together (it ran two), and logs what it cost."""
    import logging

    from transformers import DataCollatorForLanguageModeling, TrainerCallback

    model = prepare_model(load_model("llama"), "bf16+ckpt")
    calls = []
    model.model.register_forward_pre_hook(
        lambda m, a: calls.append(1) if m.training and torch.is_grad_enabled() else None
    )

    class CountAtFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.calls = len(calls)

    callback, count = MemstackCallback(), CountAtFirstStep()
    logger = logging.getLogger("hf_memstack")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        _train(
            model,
            _args(tmp_path, max_steps=2, gradient_accumulation_steps=2),
            _lm_dataset(word_tokenizer),
            DataCollatorForLanguageModeling(word_tokenizer, mlm=False),
            callbacks=[callback, count],
        )
    finally:
        logger.removeHandler(handler)
    assert count.calls == 1 + 2  # the callback's pass, then the first step's two micro-batches
    assert (
        callback.first_step.verify.ok and callback.first_step.memory.peak_bytes > 0 and callback.first_step.seconds > 0
    )
    messages = [r.getMessage() for r in records]
    assert any("verify and the memory meter on the first batch: one extra forward + backward" in m for m in messages), (
        messages
    )
    assert any("the first training step took" in m for m in messages), messages


def test_fp16_through_trainer_on_cpu_is_refused(load_model, tmp_path):
    """On the CPU Accelerate creates no GradScaler for fp16 (nor an autocast): Trainer would run
    hf_memstack's fp16 autocast with unscaled gradients. Refused, naming what to do."""
    from transformers import Trainer, TrainingArguments

    plain = Trainer(
        model=load_model("llama"),
        args=TrainingArguments(output_dir=str(tmp_path / "p"), fp16=True, use_cpu=True, report_to=[]),
    )
    assert plain.accelerator.scaler is None  # what Accelerate does on the CPU: the reason for the refusal
    model = prepare_model(load_model("llama"), "fp16")
    with pytest.raises(ValueError, match="fp16 on the CPU, where Accelerate.*creates no loss scaler.*bf16 or fp32"):
        training_arguments(model, output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[])
    with pytest.raises(ValueError, match="creates no loss scaler"):
        Trainer(model=model, args=_args(tmp_path, fp16=True), callbacks=[MemstackCallback()])


def test_global_batch_size_and_an_explicit_accumulation_must_agree(load_model, word_tokenizer, tmp_path):
    """New-user trial: global_batch_size=8 with gradient_accumulation_steps=4 trained on 8 x 4 = 32
    samples per step, silently. They must agree exactly, or the call is refused naming both."""
    from transformers import DataCollatorForLanguageModeling

    model = prepare_model(load_model("llama"), "fp32")
    collator = DataCollatorForLanguageModeling(word_tokenizer, mlm=False)
    common = {"output_dir": str(tmp_path / "out"), "report_to": [], "use_cpu": True, "max_steps": 2}
    with pytest.raises(
        ValueError, match=r"global_batch_size=8 contradicts gradient_accumulation_steps=4: .*= 32 samples.*pass one"
    ):
        training_arguments(
            model,
            train_dataset=_lm_dataset(word_tokenizer),
            data_collator=collator,
            budget="200MiB",
            global_batch_size=8,
            gradient_accumulation_steps=4,
            **common,
        )
    with pytest.raises(
        ValueError, match=r"global_batch_size=8 contradicts gradient_accumulation_steps=3: .*does not divide"
    ):
        training_arguments(
            model, global_batch_size=8, gradient_accumulation_steps=3, per_device_train_batch_size=2, **common
        )
    agreed = training_arguments(
        model, global_batch_size=8, gradient_accumulation_steps=4, per_device_train_batch_size=2, **common
    )
    assert (agreed.per_device_train_batch_size, agreed.gradient_accumulation_steps) == (2, 4)


def test_trainer_trains_a_qlora_model_through_the_helper_and_the_callback(load_model, word_tokenizer, tmp_path):
    pytest.importorskip("torchao")
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, Trainer

    model = get_peft_model(
        prepare_model(load_model("llama"), "bf16+ckpt+quant:nf4"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    frozen = model.base_model.model.model.layers[0].mlp.down_proj.weight.quantized_data.clone()
    collator, dataset = DataCollatorForLanguageModeling(word_tokenizer, mlm=False), _lm_dataset(word_tokenizer)
    args = training_arguments(
        model,
        output_dir=str(tmp_path / "out"),
        train_dataset=dataset,
        data_collator=collator,
        budget="24MiB",
        max_steps=6,
        logging_steps=1,
        learning_rate=3e-3,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    assert args.bf16 and args.per_device_train_batch_size >= 1
    callback = MemstackCallback(raise_on_failure=True)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[callback])
    trainer.train()
    quant = callback.first_step.verify.check("quant")
    assert quant.ok and "4-bit: 14 tensor(s)" in quant.detail and "8/8 got gradients" in quant.detail, quant.detail
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses
    assert torch.equal(frozen, model.base_model.model.model.layers[0].mlp.down_proj.weight.quantized_data)
    trainer.save_model(str(tmp_path / "saved"))  # the adapters alone
    assert sorted(p.name for p in (tmp_path / "saved").glob("*.safetensors")) == ["adapter_model.safetensors"]
