"""Fine-tune with transformers.Trainer on a model prepared by hf_memstack (optionally with LoRA).

    python recipes/trainer.py                                  # offline default: MiniLM-L6 on recipes/data/topics.jsonl
    python recipes/trainer.py --policy bf16+ckpt --lora_r 8 --memory_budget 2GiB --global_batch_size 64
    python recipes/trainer.py --model ./my-llama --dataset texts.jsonl --packing --seq_len 1024   # a causal LM, packed
    accelerate launch recipes/trainer.py --max_steps 100       # several processes: Trainer's own launch

The three hf_memstack lines are marked (1), (2), (3): prepare the model before the Trainer sees it,
let the policy and the batch-size finder fill TrainingArguments, and watch training with the callback.
Everything else is a plain Trainer script. Flags are the fields of ScriptArguments (HfArgumentParser).

Rows with a --label_field train a classifier; rows without one (plain text, or --prompt_field /
--response_field with the loss on the response only) train a causal LM. --packing packs whole
samples into --seq_len rows (hf_memstack.data.pack_dataset, best-fit decreasing) collated by
PackedCollator: position_ids restart at every sample and there is no attention mask, so no sample
attends to another; training_arguments keeps the rows' seq_lengths column that Trainer would drop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: nothing here is imported at run time
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    model: str = field(
        default="minilm",
        metadata={"help": "local directory or cached hub id; 'minilm' is the pretrained MiniLM-L6 shipped offline"},
    )
    dataset: str = field(
        default=str(HERE / "data" / "topics.jsonl"),
        metadata={"help": "a local .jsonl/.json/.csv file with text and label columns"},
    )
    text_field: str = field(default="text", metadata={"help": "the text column"})
    label_field: str = field(default="label", metadata={"help": "the label column (integer classes)"})
    task: str = field(
        default="auto",
        metadata={"help": "classification, causal-lm, or auto: classification when the rows have --label_field"},
    )
    prompt_field: str | None = field(
        default=None, metadata={"help": "causal-lm: the prompt column (its tokens are not learnt)"}
    )
    response_field: str = field(
        default="response", metadata={"help": "causal-lm with --prompt_field: the response column"}
    )
    seq_len: int = field(
        default=64, metadata={"help": "tokens per sample (longer ones are cut); with --packing, tokens per packed row"}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "causal-lm: pack whole samples into --seq_len rows, no sample attending to another"},
    )
    policy: str = field(
        default="auto", metadata={"help": "hf_memstack policy, e.g. bf16+ckpt; auto: this device's mixed precision"}
    )
    memory_budget: str | None = field(
        default=None, metadata={"help": "per-device budget for the batch-size finder, e.g. 8GiB"}
    )
    global_batch_size: int | None = field(
        default=None, metadata={"help": "samples per optimizer step (sets gradient accumulation)"}
    )
    per_device_train_batch_size: int = field(default=32, metadata={"help": "used when no --memory_budget is given"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0: full fine-tuning)"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps (-1: from --num_train_epochs)"})
    num_train_epochs: float = field(default=3.0, metadata={"help": "passes over the data"})
    learning_rate: float | None = field(
        default=None, metadata={"help": "peak learning rate (default 2e-4; 1e-3 with LoRA)"}
    )
    output_dir: str = field(default="outputs/trainer", metadata={"help": "checkpoints, final model and metrics"})
    seed: int = field(default=0, metadata={"help": "seed"})


def main(argv: list[str] | None = None) -> dict[str, float]:
    import torch
    from transformers import AutoTokenizer, HfArgumentParser, Trainer

    from hf_memstack import describe, prepare_model
    from hf_memstack.files import weights_follow_umask
    from hf_memstack.integrations.trainer import MemstackCallback, training_arguments

    (script,) = HfArgumentParser(ScriptArguments).parse_args_into_dataclasses(args=argv)
    model_path = _resolve(script.model)
    data = _read(script.dataset)
    task = _task(script, data.column_names)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    labels = sorted(set(data[script.label_field])) if task == "classification" else []
    train, val = _encoded(script, data, task, tokenizer, labels)
    model = _load_model(script, model_path, task, labels)
    model = prepare_model(model.train(), script.policy)  # (1)
    print(describe(model))
    train, val, collator = _batches(script, task, tokenizer, train, val)
    batch = {} if script.memory_budget else {"per_device_train_batch_size": script.per_device_train_batch_size}
    args = training_arguments(
        model,
        output_dir=script.output_dir,
        train_dataset=train,
        data_collator=collator,  # (2)
        budget=script.memory_budget,
        global_batch_size=script.global_batch_size,
        **batch,
        max_steps=script.max_steps,
        num_train_epochs=script.num_train_epochs,
        learning_rate=script.learning_rate or (1e-3 if script.lora_r else 2e-4),
        seed=script.seed,
        logging_steps=10,
        eval_strategy="epoch",
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        include_num_input_tokens_seen="non_padding",
    )  # train_tokens_per_second counts real tokens
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=val,
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=_accuracy if task == "classification" else None,
        callbacks=[MemstackCallback()],  # (3)
        optimizers=(_optimizer(model, args), None),
    )
    trainer.train()
    metrics = trainer.evaluate()
    with weights_follow_umask(script.output_dir):  # safetensors writes 0600: readable like the other files
        trainer.save_model(script.output_dir)  # a LoRA model saves its adapter; a full fine-tune the whole model
    tokenizer.save_pretrained(script.output_dir)
    print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
    return metrics


def _encoded(
    script: ScriptArguments, data: Dataset, task: str, tokenizer: PreTrainedTokenizerBase, labels: list[object]
) -> tuple[Dataset, Dataset]:
    """The training and validation splits (90/10), tokenized for the task."""
    split = data.train_test_split(test_size=0.1, seed=script.seed)
    encode = (
        _classification_encoder(script, tokenizer, labels)
        if task == "classification"
        else _lm_encoder(script, tokenizer)
    )
    train, val = (split[s].map(encode, batched=True, remove_columns=data.column_names) for s in ("train", "test"))
    if script.prompt_field:
        _check_responses(train, script)
    return train, val


def _load_model(script: ScriptArguments, model_path: str, task: str, labels: list[object]) -> torch.nn.Module:
    """The model in fp32 (a classifier head for the labels, or a causal LM), with LoRA adapters under --lora_r."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task == "classification":
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=len(labels), dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if script.lora_r:
        from peft import LoraConfig, TaskType, get_peft_model

        targets = ["query", "key", "value", "dense"] if task == "classification" else "all-linear"
        model = get_peft_model(
            model,
            LoraConfig(
                task_type=TaskType.SEQ_CLS if task == "classification" else TaskType.CAUSAL_LM,
                r=script.lora_r,
                lora_alpha=script.lora_alpha,
                target_modules=targets,
            ),
        )
    return model


def _optimizer(model, args):
    """The policy's optimizer (8-bit moments, stepped in the backward, pure bf16's stochastic rounding)
    from make_optimizer; None for plain AdamW, which Trainer builds itself."""
    from hf_memstack import make_optimizer

    policy = model.memstack.policy
    if (policy.optimizer.state, policy.optimizer.step, policy.master_weights) == ("fp32", "after_backward", "fp32"):
        return None
    return make_optimizer(model, lr=args.learning_rate, weight_decay=args.weight_decay)


def _read(path: str):
    """The data file's rows (datasets.Dataset); an unreadable or empty file is named, with the fix."""
    import datasets

    try:
        data = datasets.load_dataset("json" if path.endswith((".json", ".jsonl")) else "csv", data_files=path)["train"]
    except (StopIteration, FileNotFoundError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        raise SystemExit(
            f"trainer.py: error: dataset={path!r} could not be read ({type(e).__name__}: {str(e)[:160]}); "
            "pass a .jsonl/.json/.csv file with one row per sample"
        ) from None
    if len(data) < 2:
        raise SystemExit(
            f"trainer.py: error: dataset={path!r} has {len(data)} row(s); it needs at least 2 (one is held out for evaluation)"
        )
    return data


def _check_responses(train, script: ScriptArguments) -> None:
    """Rows whose prompt fills all --seq_len tokens have nothing to learn (every label -100): a run
    on them trains on nothing and reports a zero loss."""
    empty = [i for i, labels in enumerate(train["labels"]) if all(t == -100 for t in labels[1:])]
    if empty:
        raise SystemExit(
            f"trainer.py: error: training row {empty[0] + 1}: the prompt fills all --seq_len={script.seq_len} tokens, "
            f"no response token is left to learn ({len(empty)} such row(s)); raise --seq_len or shorten the prompts"
        )


def _task(script: ScriptArguments, columns: list[str]) -> str:
    task = script.task
    if task == "auto":
        task = "classification" if script.label_field in columns and script.prompt_field is None else "causal-lm"
    if task not in ("classification", "causal-lm"):
        raise SystemExit(f"trainer.py: error: task={script.task!r}; use classification, causal-lm or auto")
    if script.packing and task == "classification":
        raise SystemExit(
            "trainer.py: error: packing=True only applies to causal-lm (a classification row is one sample with one "
            "label); drop --packing, or pass --task causal-lm with a causal LM --model"
        )
    if script.seq_len < 2:
        raise SystemExit(
            f"trainer.py: error: seq_len={script.seq_len}; use --seq_len 2 or more (a causal LM predicts from one token on)"
        )
    return task


def _classification_encoder(script: ScriptArguments, tokenizer, labels: list):
    def encode(rows: dict) -> dict:
        out = tokenizer(rows[script.text_field], truncation=True, max_length=script.seq_len)
        out["labels"] = [labels.index(v) for v in rows[script.label_field]]
        return out

    return encode


def _lm_encoder(script: ScriptArguments, tokenizer):
    """Causal-LM samples: labels are the input ids, with a prompt's tokens masked (-100) so that
    only the response is learnt."""
    eos = tokenizer.eos_token or ""

    def encode(rows: dict) -> dict:
        if script.prompt_field is None:
            ids = [
                tokenizer(t + eos, add_special_tokens=False)["input_ids"][: script.seq_len]
                for t in rows[script.text_field]
            ]
            return {"input_ids": ids, "labels": [list(x) for x in ids]}
        ids, labels = [], []
        for prompt, response in zip(rows[script.prompt_field], rows[script.response_field]):
            p = tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"]
            r = tokenizer(response + eos, add_special_tokens=False)["input_ids"]
            ids.append((p + r)[: script.seq_len])
            labels.append(([-100] * len(p) + r)[: script.seq_len])
        return {"input_ids": ids, "labels": labels}

    return encode


def _batches(script: ScriptArguments, task: str, tokenizer, train, val):
    """The splits and the collator: padded batches, or (--packing) packed rows with PackedCollator."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    if task == "classification":
        return train, val, DataCollatorWithPadding(tokenizer)
    if not script.packing:
        return train, val, DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)  # labels padded with -100
    from hf_memstack.data import PackedCollator, pack_dataset, padding_stats

    lengths = [len(ids) for ids in train["input_ids"]]
    train, val = pack_dataset(train, script.seq_len), pack_dataset(val, script.seq_len)
    padded = padding_stats(lengths, script.per_device_train_batch_size, seed=script.seed)
    print(
        f"packing: {len(lengths)} training samples ({sum(lengths)} tokens) in {len(train)} rows of {script.seq_len}: "
        f"{1 - sum(lengths) / (len(train) * script.seq_len):.1%} padding, against {padded.padding_fraction:.1%} "
        f"in padded batches of {script.per_device_train_batch_size}"
    )
    return train, val, PackedCollator(pad_token_id=tokenizer.pad_token_id)


def _accuracy(prediction) -> dict[str, float]:
    logits, labels = prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def _resolve(name: str) -> str:
    """'minilm' (hf-memstack's alias table) as its model folder; any other name as given."""
    from hf_memstack.models import resolve_model_alias

    try:
        return resolve_model_alias(name)
    except ValueError as e:
        raise SystemExit(f"trainer.py: error: {e}") from None


if __name__ == "__main__":
    main()
