"""transformers.Trainer on a prepared model under torchrun with 2 CPU processes (DDP through
Trainer's Accelerator): TrainingArguments filled by hf_memstack count both processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = """
import json, sys, torch
from transformers import DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer
from tokenizers import Tokenizer, models, pre_tokenizers
import datasets
from hf_memstack import prepare_model
from hf_memstack.integrations.trainer import MemstackCallback, training_arguments

words = "the cat sat on a mat dog ran to park".split()
vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *words])}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]")); tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
texts = [" ".join(words[(i + j) % len(words)] for j in range(6)) for i in range(64)]
train = datasets.Dataset.from_dict({"text": texts}).map(lambda r: tokenizer(r["text"]), remove_columns=["text"])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=len(vocab), pad_token_id=0))
model = prepare_model(model.train(), "bf16+ckpt")
args = training_arguments(model, output_dir=sys.argv[1], per_device_train_batch_size=4, global_batch_size=16, max_steps=3,
                          learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, ddp_timeout=120)
trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                  callbacks=[MemstackCallback(raise_on_failure=True)])
trainer.train()
if trainer.is_world_process_zero():
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("RESULT " + json.dumps({"world": args.world_size, "accum": args.gradient_accumulation_steps, "losses": losses}))
# Release what holds the process group, then destroy it. The DDP wrapper inside the Trainer keeps
# gloo's worker threads (pt_gloo_runloop) alive even after destroy_process_group(); left for the
# interpreter's finalization they can abort the process ("terminate called without an active
# exception", no Python frame, SIGABRT; pytorch/pytorch#179291). Seen in CI on a loaded 2-core
# machine, and here 1 run in 12 under load with destroy_process_group() alone.
import gc
del trainer, model
gc.collect()
torch.distributed.destroy_process_group()
"""


def test_trainer_ddp_under_torchrun_counts_both_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(tmp_path / "out"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # 4 per device x 2 processes x 2 accumulation steps = the global batch of 16.
    assert result["world"] == 2 and result["accum"] == 2
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]
