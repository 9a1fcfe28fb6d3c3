"""Full fine-tuning against LoRA, both through transformers.Trainer on a prepared model: the real
MiniLM-L6 classifying the topics data (recipes/data/topics.jsonl), same batch, same steps, same
policy; samples/s from Trainer, the step's peak memory by category from the meter (forward +
backward measured by MemstackCallback on the first batch, plus the optimizer state).

    python bench/trainer_lora.py                      # policies auto and auto+ckpt, 60 steps each
    python bench/trainer_lora.py --steps 100 --policies bf16,bf16+ckpt
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from _common import machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))


def run(policy: str, lora_r: int, steps: int, batch: int) -> dict:
    import datasets
    from trainer import _resolve  # recipes/trainer.py: the shipped MiniLM's folder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer

    from hf_memstack import prepare_model
    from hf_memstack.integrations.trainer import MemstackCallback, training_arguments
    from hf_memstack.measure.accounting import optimizer_state_bytes

    path = _resolve("minilm")
    tok = AutoTokenizer.from_pretrained(path)
    data = datasets.load_dataset("json", data_files=str(ROOT / "recipes" / "data" / "topics.jsonl"))["train"]
    data = data.map(lambda r: tok(r["text"], truncation=True, max_length=64), batched=True, remove_columns=["text"])
    data = data.rename_column("label", "labels")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=4, dtype=torch.float32)
    if lora_r:
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                task_type=TaskType.SEQ_CLS,
                r=lora_r,
                lora_alpha=2 * lora_r,
                target_modules=["query", "key", "value", "dense"],
            ),
        )
    model = prepare_model(model.train(), policy)
    callback = MemstackCallback()
    with tempfile.TemporaryDirectory() as out:
        args = training_arguments(
            model,
            output_dir=out,
            per_device_train_batch_size=batch,
            max_steps=steps,
            learning_rate=1e-3 if lora_r else 2e-4,
            logging_steps=max(1, steps // 6),
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=data, data_collator=DataCollatorWithPadding(tok), callbacks=[callback]
        )
        result = trainer.train()
        optimizer_bytes = optimizer_state_bytes(trainer.optimizer)
    memory = callback.first_step.memory
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "policy": f"{model.memstack.policy.to_string()} ({model.memstack.precision.name})",
        "lora_r": lora_r,
        "trainable": trainable,
        "samples_per_s": result.metrics["train_samples_per_second"],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "parameters": memory.parameters,
        "gradients": memory.gradients,
        "optimizer": optimizer_bytes,
        "activations": memory.activations,
        "peak": memory.forward_backward_peak + optimizer_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="auto,auto+ckpt")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trainer_lora.json"))
    args = ap.parse_args()
    from hf_memstack.transforms.precision.apply import cpu_has_native_bf16

    print(f"machine: {machine()}; native bf16: {cpu_has_native_bf16()}")
    rows = [run(policy, r, args.steps, args.batch) for policy in args.policies.split(",") for r in (0, args.lora_r)]
    mib = 2**20
    print(f"\nMiniLM-L6 (22.7M parameters) on topics, Trainer, batch {args.batch}, {args.steps} steps\n")
    print(
        "| policy | trains | trainable params | samples/s | loss first -> last log | parameters MiB | gradients MiB | optimizer MiB | activations MiB | peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['policy']} | {'LoRA r=' + str(r['lora_r']) if r['lora_r'] else 'all'} | {r['trainable']:,} | {r['samples_per_s']:.0f} | "
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['parameters'] / mib:.0f} | {r['gradients'] / mib:.1f} | "
            f"{r['optimizer'] / mib:.1f} | {r['activations'] / mib:.0f} | {r['peak'] / mib:.0f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
