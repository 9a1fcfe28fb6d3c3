"""Every field of the estimate against the meter on the real step, not only the peak: a tiny
Llama saved in bf16 (as real checkpoints are) and loaded the default way, and one saved in fp32,
full fine-tuning and LoRA, mixed precision with and without checkpointing. The estimate is read
from the saved directory (fake tensors); the meter runs the loaded model's real step with the
optimizer ``make_optimizer`` builds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model
from hf_memstack.planning.estimate import peft_config_from

SEQ, BATCH = 32, 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(dtype).save_pretrained(root / name)
        out[name] = root / name
    return out


def _measured(path, policy: str, trainable: str):
    model = AutoModelForCausalLM.from_pretrained(path)  # dtype="auto": a bf16 checkpoint comes back bf16
    peft_config = peft_config_from(trainable)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    model.train()
    model = prepare_model(model, policy)
    ids = torch.randint(3, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.compiler.set_stance("force_eager"):  # torchao's step (weights:bf16) compiles per shape: eager, as traced
        return measure_step(
            model, {"input_ids": ids, "labels": ids.clone()}, make_optimizer(model, lr=1e-4), timed=False
        )


@pytest.mark.filterwarnings(
    "ignore:.*trainable.*:UserWarning"
)  # prepare_model on bf16 weights trained in place says so
@pytest.mark.parametrize("weights", ["bf16", "fp32"])
@pytest.mark.parametrize(
    ("policy", "trainable"),
    [
        ("bf16", "all"),
        ("bf16+ckpt", "all"),
        ("bf16+ckpt", "lora"),
        ("bf16+ckpt+weights:bf16", "all"),
        ("bf16+weights:bf16", "lora"),
    ],
)
def test_every_field_of_the_estimate_is_the_meters(saved, weights, policy, trainable):
    real = _measured(saved[weights], policy, trainable)
    est = estimate_memory(saved[weights], policy, batch_size=BATCH, seq_len=SEQ, trainable=trainable)
    assert est.weights_dtype == weights
    assert (est.parameters, est.gradients, est.optimizer) == (real.parameters, real.gradients, real.optimizer)
    assert est.peak_bytes == real.peak_bytes and est.peak_phase == real.peak_phase
    # The forward+backward alone: the model states alive then, not the optimizer phase's bytes added.
    assert est.forward_backward_peak == real.forward_backward_peak
    rest = real.peak_bytes - real.parameters - real.gradients - real.optimizer
    assert est.activations == min(real.saved_activations, rest) and est.temporaries == rest - est.activations


@pytest.mark.parametrize("policy", ["bf16+ckpt", "bf16"])
def test_on_cuda_adamw_steps_with_foreach_and_is_estimated_so(saved, policy):
    # Found by a new-user trial: the fake tensors are on the CPU, where AdamW loops over the
    # parameters; on CUDA it defaults to foreach, whose step holds a copy of every second moment.
    # The meter runs that step here, with foreach asked for (the CPU has the kernels too).
    model = prepare_model(AutoModelForCausalLM.from_pretrained(saved["fp32"]).train(), policy)
    ids = torch.randint(3, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    opt = make_optimizer(model, lr=1e-4)
    for group in opt.param_groups:
        group["foreach"] = True
    real = measure_step(model, {"input_ids": ids, "labels": ids.clone()}, opt, timed=False)
    cuda = estimate_memory(saved["fp32"], policy, batch_size=BATCH, seq_len=SEQ, device="cuda")
    cpu = estimate_memory(saved["fp32"], policy, batch_size=BATCH, seq_len=SEQ, device="cpu")
    assert (cuda.peak_bytes, cuda.peak_phase) == (real.peak_bytes, real.peak_phase)
    assert cuda.peak_bytes > cpu.peak_bytes  # the CPU's loop holds no such copy
    with pytest.raises(ValueError, match=r"device='tpu' must be 'cuda' or 'cpu'"):
        estimate_memory(saved["fp32"], policy, batch_size=BATCH, seq_len=SEQ, device="tpu")
