""" "Any pretrained model": every architecture of the zoo (decoder LMs, MoE, vision-language,
encoders, encoder-decoders) x the main policies, each loaded the real way (a bf16 checkpoint saved
with ``save_pretrained``, loaded with Transformers' default ``dtype="auto"``): prepare, verify, one
optimizer step, and the estimate against the meter. What is refused is listed in ``REFUSED``, the one
table of expected refusals (the matrix of docs/models.md is printed from it and this file's results)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zoo import SEQ, ZOO, Arch, build, image_size, make_batch, peft_lora

from hf_memstack import estimate_memory, make_optimizer, measure_step, prepare_model, verify

# (arch, policy) -> a fragment of the refusal prepare_model gives (the estimator refuses the same).
POLICIES = ("bf16+ckpt", "bf16+ckpt+loss:chunked", "bf16+ckpt+lora", "bf16+ckpt+quant:nf4+lora")
_NOT_CAUSAL = "needs a causal language model"
REFUSED: dict[tuple[str, str], str] = {
    **{(name, "bf16+ckpt+loss:chunked"): _NOT_CAUSAL for name in ("bert", "roberta", "t5", "bart")},
    # torchao's NF4 runs through F.linear only: GPT-2's Conv1D and the MoE routers are not nn.Linear.
    **{(name, "bf16+ckpt+quant:nf4"): "not nn.Linear" for name in ("gpt2", "mixtral", "qwen2_moe", "olmoe")},
}

# The estimate equals the meter within this (per cent of the peak); parameters to the byte.
TOLERANCE = {"vlm": 0.10}
DEFAULT_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {a.name: root / a.name for a in ZOO}


def _folder(saved: dict[str, Path], arch: Arch) -> Path:
    folder = saved[arch.name]
    if not folder.exists():
        build(arch).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arch", ZOO, ids=[a.name for a in ZOO])
def test_any_model(saved, arch: Arch, policy: str) -> None:
    folder = _folder(saved, arch)
    model = build(arch, folder=folder)
    assert next(model.parameters()).dtype == torch.bfloat16  # loaded as a real checkpoint is
    base, lora = policy.removesuffix("+lora"), policy.endswith("+lora")
    refusal = REFUSED.get((arch.name, base))
    if refusal is not None:
        # Refused before anything changes, and the estimator refuses the same run.
        with pytest.raises(ValueError, match=refusal):
            prepare_model(model, base)
        with pytest.raises(ValueError, match=refusal):
            estimate_memory(folder, base, batch_size=2, seq_len=SEQ)
        return
    model = prepare_model(model, base)
    if lora:
        model = peft_lora(model, arch)
    batch = make_batch(arch, batch_size=2)
    verify(model, batch, raise_on_failure=True)
    real = measure_step(model, batch, make_optimizer(model, lr=1e-4), timed=False)
    assert all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad)
    images = {"image_size": image_size(arch), "images_per_sample": 1} if arch.kind == "vlm" else {}
    trainable = peft_lora.config(arch) if lora else "all"
    est = estimate_memory(folder, base, batch_size=2, seq_len=SEQ, trainable=trainable, **images)
    tolerance = TOLERANCE.get(arch.kind, DEFAULT_TOLERANCE)
    assert est.parameters == real.parameters, (est, real)
    assert abs(est.peak_bytes / real.peak_bytes - 1) <= tolerance, (est.peak_bytes, real.peak_bytes)
