"""Fine-tune with transformers.Trainer on a model prepared by hf_memstack (optionally with LoRA).

    python recipes/trainer.py                                  # offline default: MiniLM-L6 on recipes/data/topics.jsonl
    python recipes/trainer.py --policy bf16+ckpt --lora_r 8 --memory_budget 2GiB --global_batch_size 64
    accelerate launch recipes/trainer.py --max_steps 100       # several processes: Trainer's own launch

The three hf_memstack lines are marked (1), (2), (3): prepare the model before the Trainer sees it,
let the policy and the batch-size finder fill TrainingArguments, and watch training with the callback.
Everything else is a plain Trainer script. Flags are the fields of ScriptArguments (HfArgumentParser).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    model: str = field(default="minilm", metadata={"help": "local directory or cached hub id; 'minilm' is the pretrained MiniLM-L6 shipped offline"})
    dataset: str = field(default=str(HERE / "data" / "topics.jsonl"), metadata={"help": "a local .jsonl/.json/.csv file with text and label columns"})
    text_field: str = field(default="text", metadata={"help": "the text column"})
    label_field: str = field(default="label", metadata={"help": "the label column (integer classes)"})
    policy: str = field(default="auto", metadata={"help": "hf_memstack policy, e.g. bf16+ckpt; auto: this device's mixed precision"})
    memory_budget: str | None = field(default=None, metadata={"help": "per-device budget for the batch-size finder, e.g. 8GiB"})
    global_batch_size: int | None = field(default=None, metadata={"help": "samples per optimizer step (sets gradient accumulation)"})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "used when no --memory_budget is given"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (0: full fine-tuning)"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps (-1: from --num_train_epochs)"})
    num_train_epochs: float = field(default=3.0, metadata={"help": "passes over the data"})
    learning_rate: float | None = field(default=None, metadata={"help": "peak learning rate (default 2e-4; 1e-3 with LoRA)"})
    output_dir: str = field(default="outputs/trainer", metadata={"help": "checkpoints, final model and metrics"})
    seed: int = field(default=0, metadata={"help": "seed"})


def main(argv: list[str] | None = None) -> dict[str, float]:
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, HfArgumentParser, Trainer

    from hf_memstack import describe, prepare_model
    from hf_memstack.files import weights_follow_umask
    from hf_memstack.integrations.trainer import MemstackCallback, training_arguments

    (script,) = HfArgumentParser(ScriptArguments).parse_args_into_dataclasses(args=argv)
    model_path = _resolve(script.model)
    data = datasets.load_dataset("json" if script.dataset.endswith((".json", ".jsonl")) else "csv", data_files=script.dataset)["train"]
    split = data.train_test_split(test_size=0.1, seed=script.seed)
    labels = sorted(set(data[script.label_field]))
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def encode(rows: dict) -> dict:
        out = tokenizer(rows[script.text_field], truncation=True, max_length=64)
        out["labels"] = [labels.index(v) for v in rows[script.label_field]]
        return out

    train, val = (split[s].map(encode, batched=True, remove_columns=data.column_names) for s in ("train", "test"))
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=len(labels), dtype=torch.float32)
    if script.lora_r:
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=script.lora_r, lora_alpha=script.lora_alpha,
                                                 target_modules=["query", "key", "value", "dense"]))
    model = prepare_model(model.train(), script.policy)                                                      # (1)
    print(describe(model))
    collator = DataCollatorWithPadding(tokenizer)
    batch = {} if script.memory_budget else {"per_device_train_batch_size": script.per_device_train_batch_size}
    args = training_arguments(model, output_dir=script.output_dir, train_dataset=train, data_collator=collator,   # (2)
                              budget=script.memory_budget, global_batch_size=script.global_batch_size, **batch,
                              max_steps=script.max_steps, num_train_epochs=script.num_train_epochs,
                              learning_rate=script.learning_rate or (1e-3 if script.lora_r else 2e-4), seed=script.seed, logging_steps=10, eval_strategy="epoch",
                              save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val, data_collator=collator,
                      compute_metrics=_accuracy, callbacks=[MemstackCallback()])                             # (3)
    trainer.train()
    metrics = trainer.evaluate()
    with weights_follow_umask(script.output_dir):  # safetensors writes 0600: readable like the other files
        trainer.save_model(script.output_dir)  # a LoRA model saves its adapter; a full fine-tune the whole model
    tokenizer.save_pretrained(script.output_dir)
    print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
    return metrics


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
