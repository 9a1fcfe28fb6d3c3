"""The sequence-parallel estimate (sp:2) against the meter on each of 2 gloo ranks: a tiny Llama (4 blocks,
vocabulary 1,000), each rank's real step on its half of every row (``shard_batch``, Ulysses attention)
measured by ``measure_step``, and ``estimate_memory`` of the whole rows under the same policy - full
fine-tune and LoRA, with and without checkpointing and the chunked loss, GQA and MQA (kv heads repeated),
in one group launch."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# (policy, what trains, kv heads, tokens per row)
CELLS = [
    ("fp32+sp:2", "all", 2, 256),
    ("fp32+ckpt+sp:2", "all", 1, 512),
    ("fp32+loss:chunked+sp:2", "lora", 4, 384),
    ("fp32+ckpt+loss:chunked+sp:2", "lora", 2, 512),
]
FIELDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "peak_bytes", "forward_backward_peak")
ROWS = 2


def _cells(rank, world):
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model
    from hf_memstack.planning.estimate.trainable import peft_config_from
    from hf_memstack.transforms.sequence_parallel import shard_batch

    out = []
    for policy, trainable, kv, seq in CELLS:
        config = LlamaConfig(**SHAPE, num_key_value_heads=kv)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).train()
        if trainable == "lora":
            model = get_peft_model(model, peft_config_from("lora"))
        model = prepare_model(model, policy)
        ids = torch.randint(3, SHAPE["vocab_size"], (ROWS, seq), generator=torch.Generator().manual_seed(1))
        mine = shard_batch({"input_ids": ids, "labels": ids.clone()}, sp_rank=rank, sp_size=world)
        real = measure_step(model, mine, make_optimizer(model, lr=1e-4), timed=False)
        est = None
        if rank == 0:  # the estimate traces on one process, of the whole rows
            est = estimate_memory(
                LlamaConfig(**SHAPE, num_key_value_heads=kv),
                policy,
                batch_size=ROWS,
                seq_len=seq,
                world_size=world,
                trainable=trainable,
                device="cpu",
            )
        out.append(({k: getattr(real, k) for k in FIELDS}, est and {k: getattr(est, k) for k in FIELDS}))
    return out


def test_sp_estimate_equals_the_meter_on_each_of_2_ranks():
    ranks = run_ranks(_cells, timeout=900)
    estimates = [est for _, est in ranks[0]]
    for rank, rows in enumerate(ranks):
        for (policy, trainable, kv, seq), (real, _), est in zip(CELLS, rows, estimates, strict=True):
            cell = (rank, policy, trainable, kv, seq, real, est)
            print(cell)
            for key in ("peak_bytes", "forward_backward_peak", "gradients", "optimizer"):
                assert est[key] == pytest.approx(real[key], rel=0.03, abs=64 * 1024), (key, cell)
            # The chunked head's weight is an activation to the meter, a parameter to the estimate: their sum alike.
            keys = ("parameters", "activations", "temporaries")
            assert sum(est[k] for k in keys) == pytest.approx(sum(real[k] for k in keys), rel=0.03), cell
