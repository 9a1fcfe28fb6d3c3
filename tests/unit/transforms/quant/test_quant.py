"""4-bit base weights (quant:nf4, and models loaded 4-bit with bitsandbytes): what the weights hold
against the NF4 format and torchao's own quantizer, LoRA gradients against plain layers holding the
dequantized weights, both PEFT orders, checkpointing, the bytes the meter and the estimator count
against the format's layout, adapters saved and reloaded, merging, and every refusal."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from tiny import assert_untouched, make_batch, snapshot
from torch import nn

from hf_memstack import (
    MemoryPolicy,
    PolicyError,
    dequantize,
    estimate_memory,
    measure_step,
    merge_adapters,
    prepare_model,
    record_of,
    verify,
)
from hf_memstack.measure import train_step

pytest.importorskip("torchao")
pytest.importorskip("peft")

# The NF4 levels of the QLoRA paper (appendix E), the format's definition.
NF4_LEVELS = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora(r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")):
    from peft import LoraConfig

    # Non-zero B (init_lora_weights=False): the adapters change the output from the first step.
    return LoraConfig(r=r, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False)


def _qlora(load_model, policy: str = "bf16+ckpt+quant:nf4", order: str = "peft-first", arch: str = "llama"):
    from peft import get_peft_model

    torch.manual_seed(1)
    if order == "peft-first":
        return prepare_model(get_peft_model(load_model(arch), _lora()), policy)
    return get_peft_model(prepare_model(load_model(arch), policy), _lora())


def _block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The blocks' nn.Linear layers by their name in the plain model (PEFT's prefixes and base_layer removed)."""
    out = {}
    for name, m in model.named_modules():
        if type(m) is nn.Linear and ".layers." in name and "lora_" not in name:
            out[name.removeprefix("base_model.model.").removesuffix(".base_layer")] = m
    return out


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------------------------------ the weights


def test_four_bit_weights_are_torchaos_nf4_of_the_weights_and_within_the_formats_error(load_model):
    from torchao.quantization import NF4Tensor, to_nf4

    original = {n: m.weight.detach().clone() for n, m in _block_linears(load_model("llama")).items()}
    model = prepare_model(load_model("llama"), "bf16+quant:nf4")
    layers = _block_linears(model)
    assert sorted(layers) == sorted(original) and len(layers) == 2 * len(LINEARS)
    for name, layer in layers.items():
        w = original[name]
        assert isinstance(layer.weight, NF4Tensor) and not layer.weight.requires_grad, name
        got = layer.weight.get_original_weight()
        assert got.dtype == torch.bfloat16  # dequantized in the compute dtype
        n_blocks = w.numel() // 64
        reference = to_nf4(w.to(torch.bfloat16), 64, min(256, n_blocks)).get_original_weight()
        assert torch.equal(got, reference), name
        # The format's error: each weight is one of the 16 levels times its block's scale (the
        # block's absolute maximum, itself rounded by the int8 double quantization), so it lies
        # within half the widest gap between levels (-1 to -0.696) of the block's maximum, plus
        # the scale's own rounding.
        blocks_w, blocks_q = w.reshape(-1, 64), got.float().reshape(-1, 64)
        absmax = blocks_w.abs().amax(dim=1, keepdim=True)
        half_gap = 0.5 * NF4_LEVELS.diff().max()
        assert ((blocks_q - blocks_w).abs() <= (half_gap + 0.01) * absmax).all(), name
        assert (blocks_q - blocks_w).abs().mean() < 0.05 * absmax.mean()  # most weights land far closer
        scale = blocks_q.abs().amax(dim=1, keepdim=True)
        codes = blocks_q / scale
        assert ((codes.unsqueeze(-1) - NF4_LEVELS.to(codes.dtype)).abs().amin(-1) < 1e-2).all(), name
        assert (scale / absmax - 1).abs().max() < 0.02, name  # the double-quantized scales stay within 2%
    # Never the head or the embeddings (unless asked): they keep their fp32 weights.
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32


def test_lora_gradients_equal_plain_layers_holding_the_dequantized_weights(load_model):
    """fp32 end to end: the same adapters on (a) the NF4 base and (b) ordinary nn.Linear layers
    holding that base dequantized must give the same loss and adapter gradients."""
    from peft import get_peft_model

    torch.manual_seed(3)
    quantized = get_peft_model(prepare_model(load_model("llama"), "fp32+quant:nf4"), _lora())
    reference = get_peft_model(load_model("llama"), _lora())
    with torch.no_grad():
        for name, p in _adapters(reference).items():
            p.copy_(_adapters(quantized)[name])  # the same adapters
        ref_layers = _block_linears(reference)
        for name, layer in _block_linears(quantized).items():
            ref_layers[name].weight.copy_(layer.weight.get_original_weight())  # fp32 policy: dequantized in fp32
    batch = make_batch("llama")
    losses = []
    for model in (quantized, reference):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    ref_grads = {n: p.grad for n, p in _adapters(reference).items()}
    for name, p in _adapters(quantized).items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("order", ["peft-first", "prepare-first"])
@pytest.mark.parametrize(
    "policy",
    [
        "bf16+ckpt+quant:nf4",
        "bf16+ckpt:selective+quant:nf4",
        MemoryPolicy(precision="bf16", checkpointing={"mode": "full", "use_reentrant": True}, quant="nf4"),
    ],
    ids=["ckpt", "selective", "reentrant"],
)
def test_qlora_trains_in_either_order_with_checkpointing_and_verify_reports_the_widths(load_model, order, policy):
    model = _qlora(load_model, policy, order)
    report = verify(model, make_batch("llama"))
    assert report.ok, str(report)
    quant = report.check("quant").detail
    assert (
        "4-bit: 14 tensor(s)" in quant
        and "32-bit:" in quant
        and "adapters on the 4-bit layers: 12/12 got gradients" in quant
    ), quant
    assert report.recomputed_blocks == [0, 1]
    frozen = {n: m.weight.quantized_data.clone() for n, m in _block_linears(model).items()}
    adapters = _adapters(model)
    before = {n: p.detach().clone() for n, p in adapters.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = make_batch("llama")
    losses = [train_step(model, batch, opt) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert all(not torch.equal(before[n], p) for n, p in adapters.items()), "every adapter trains"
    assert all(torch.equal(frozen[n], m.weight.quantized_data) for n, m in _block_linears(model).items()), (
        "the 4-bit base stays"
    )
    assert {p.dtype for p in adapters.values()} == {torch.float32}


def test_regional_compile_traces_the_4bit_layers(load_model):
    policy = MemoryPolicy.from_string("bf16+ckpt+compile:regional+quant:nf4")
    policy.compile.backend = (
        "aot_eager"  # the graph is what is tested; one real inductor compile lives in test_compile.py
    )
    compiled, eager = _qlora(load_model, policy), _qlora(load_model, "bf16+ckpt+quant:nf4")
    report = verify(compiled, make_batch("llama"))
    assert report.ok and "graph breaks" not in report.check("compile").detail, str(report)
    batch = make_batch("llama")
    torch.testing.assert_close(compiled(**batch).loss, eager(**batch).loss, rtol=1e-3, atol=1e-3)


def test_bf16_loaded_base_stays_16_bit_and_upcast_is_what_it_says(pretrained_dirs):
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    def load():
        return LlamaForCausalLM.from_pretrained(pretrained_dirs["llama"], dtype=torch.bfloat16).train()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = get_peft_model(prepare_model(load(), "bf16+ckpt+quant:nf4"), _lora())
    assert not [w for w in caught if "trainable parameter" in str(w.message)]  # QLoRA's usual bf16 load: no fp32 advice
    widths = {
        n: p.dtype
        for n, p in plain.named_parameters()
        if ("lora_" not in n and p.dim() == 1) or "embed" in n or "lm_head" in n
    }
    assert set(widths.values()) == {torch.bfloat16}, widths  # no upcast: norms, embeddings and head stay as loaded
    upcast = get_peft_model(prepare_model(load(), "bf16+ckpt+quant:nf4:upcast"), _lora())
    assert record_of(upcast).quant.upcast == len(widths)
    assert {p.dtype for n, p in upcast.named_parameters() if n in widths} == {torch.float32}
    for model in (plain, upcast):
        assert verify(model, make_batch("llama")).ok


def test_verify_shows_what_peft_upcasts_and_fails_on_a_base_no_longer_4bit(pretrained_dirs):
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaForCausalLM

    def load():
        return LlamaForCausalLM.from_pretrained(pretrained_dirs["llama"], dtype=torch.bfloat16).train()

    ours = get_peft_model(prepare_model(load(), "bf16+ckpt+quant:nf4"), _lora())
    theirs = prepare_model(load(), "bf16+ckpt+quant:nf4")
    theirs = get_peft_model(prepare_model_for_kbit_training(theirs, use_gradient_checkpointing=False), _lora())
    details = [verify(m, make_batch("llama")).check("quant").detail for m in (ours, theirs)]
    assert "16-bit: 7 tensor(s)" in details[0] and "embed_tokens" in details[0].split("16-bit")[1], details[0]
    assert "16-bit" not in details[1] and "4-bit: 14 tensor(s)" in details[1], details[1]  # PEFT upcast all 7 to fp32
    dequantize(ours)  # e.g. to merge, then training went on
    check = verify(ours, make_batch("llama")).check("quant")
    assert not check.ok and "14 of the 14 4-bit layers are no longer 4-bit" in check.detail, check.detail


# ----------------------------------------------------------------------------------------- the bytes


def _nf4_layer_bytes(numel: int, size: int = 2) -> int:
    """One NF4 weight of ``numel`` values (<= 256 blocks of 64: one second-level factor), by the
    format: two codes a byte, an int8 scale per block, the factor, the scales' mean and the 16-level
    table in the compute dtype (``size`` bytes each)."""
    assert numel // 64 <= 256
    return numel // 2 + numel // 64 + size + size + 16 * size


def test_meter_and_estimator_count_the_four_bit_bytes_exactly(load_model, pretrained_dirs):
    model = _qlora(load_model)
    dense = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if "layers." not in n or "lora_" in n or "layernorm" in n
    )
    quantized = sum(_nf4_layer_bytes(m.in_features * m.out_features) for m in _block_linears(model).values())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    measured = measure_step(model, make_batch("llama", batch_size=4, seq=32), opt, timed=False)
    assert measured.parameters == dense + quantized + buffers
    assert record_of(model).quant.bytes_4bit == quantized
    est = estimate_memory(pretrained_dirs["llama"], "bf16+ckpt+quant:nf4", batch_size=4, seq_len=32, trainable=_lora())
    assert est.parameters == measured.parameters
    assert abs(est.peak_bytes / measured.peak_bytes - 1) <= 0.10, (est.peak_bytes, measured.peak_bytes)
    full = estimate_memory(pretrained_dirs["llama"], "bf16+ckpt", batch_size=4, seq_len=32, trainable=_lora())
    block_fp32 = sum(m.in_features * m.out_features * 4 for m in _block_linears(model).values())
    assert full.parameters - est.parameters == block_fp32 - quantized


def test_the_estimator_counts_the_upcast(pretrained_dirs):
    # The estimator builds the model from its config in fp32, where the upcast has nothing to cast;
    # on a bf16 load, quant:nf4:upcast casts everything that is not 4-bit to fp32: the same bytes.
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(pretrained_dirs["llama"], dtype=torch.bfloat16).train()
    model = prepare_model(get_peft_model(model, _lora()), "bf16+ckpt+quant:nf4:upcast")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    measured = measure_step(model, make_batch("llama", batch_size=4, seq=32), opt, timed=False)
    est = estimate_memory(
        pretrained_dirs["llama"], "bf16+ckpt+quant:nf4:upcast", batch_size=4, seq_len=32, trainable=_lora()
    )
    assert est.parameters == measured.parameters
    assert abs(est.peak_bytes / measured.peak_bytes - 1) <= 0.10, (est.peak_bytes, measured.peak_bytes)


# ------------------------------------------------------------------------------------ bitsandbytes


def _bnb_model(pretrained_dirs):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return AutoModelForCausalLM.from_pretrained(
        pretrained_dirs["llama"], quantization_config=config, dtype=torch.bfloat16
    ).train()


def test_a_model_loaded_4bit_with_bitsandbytes_is_accepted_measured_and_trains(pretrained_dirs):
    from peft import get_peft_model

    model = prepare_model(get_peft_model(_bnb_model(pretrained_dirs), _lora()), "bf16+ckpt")
    record = record_of(model)
    assert record.quant.backend == "bitsandbytes" and len(record.quant.layers) == 14 and record.quant.quantized == 0
    report = verify(model, make_batch("llama"))
    assert report.ok, str(report)
    assert "4-bit: 14 tensor(s)" in report.check("quant").detail
    # The meter counts each 4-bit weight's codes and its quantization state (bitsandbytes' own list of it).
    state = 0
    for m in record.quant.layers:
        state += m.weight.numel() * m.weight.element_size()
        qs = m.weight.quant_state
        state += sum(v.numel() * v.element_size() for v in qs.as_dict(packed=False).values() if torch.is_tensor(v))
        state += qs.offset.numel() * qs.offset.element_size()  # as_dict gives the offset as a number; it is a tensor
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dtype != torch.uint8)
    rest += sum(b.numel() * b.element_size() for b in model.buffers())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = make_batch("llama")
    assert measure_step(model, batch, opt, timed=False).parameters == state + rest
    losses = [train_step(model, batch, opt) for _ in range(4)]
    assert losses[-1] < losses[0], losses


def test_evaluating_a_bitsandbytes_base_does_not_cut_its_gradients(pretrained_dirs):
    # On a CPU with AVX512-BF16, bitsandbytes repacks its codes at the first eval no-grad forward
    # into a layout whose kernel has no backward: afterwards no gradient reached the adapters. The
    # reference is the same model never evaluated (elsewhere bitsandbytes never repacks and both agree).
    from peft import get_peft_model

    batch = make_batch("llama")

    def adapter_grads(evaluate: bool) -> dict[str, torch.Tensor | None]:
        model = _bnb_model(pretrained_dirs)
        if evaluate:  # before prepare_model: a generation
            with torch.no_grad():
                model.eval()(input_ids=batch["input_ids"])
        torch.manual_seed(0)
        model = prepare_model(get_peft_model(model, _lora()), "bf16+ckpt")
        if evaluate:  # after: the Trainer's evaluate(), which must leave the 4-bit weights as they are
            codes = [m.weight.detach().clone() for m in record_of(model).quant.layers]
            with torch.no_grad():
                model.eval()(input_ids=batch["input_ids"])
            for before, layer in zip(codes, record_of(model).quant.layers, strict=True):
                assert torch.equal(layer.weight, before)
        model.train()(**batch).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    fresh, evaluated = adapter_grads(False), adapter_grads(True)
    assert [n for n, g in evaluated.items() if g is None] == []
    for name, grad in fresh.items():
        # Undoing the first repack re-quantizes the scales (bitsandbytes' own inverse): bf16-ulp changes.
        torch.testing.assert_close(evaluated[name], grad, rtol=2e-2, atol=2e-2 * grad.abs().max().item(), msg=name)


# ------------------------------------------------------------------------------ save, reload, merge


@pytest.mark.parametrize("order", ["peft-first", "prepare-first"])
def test_adapters_save_alone_and_reload_onto_a_fresh_4bit_base(load_model, tmp_path, order):
    from peft import PeftModel
    from safetensors.torch import load_file

    model = _qlora(load_model, "bf16+quant:nf4", order)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, make_batch("llama"), opt)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == len(_adapters(model)) and all(v.dtype == torch.float32 for v in saved.values())
    if order == "peft-first":
        reloaded = prepare_model(PeftModel.from_pretrained(load_model("llama"), tmp_path), "bf16+quant:nf4")
    else:
        reloaded = PeftModel.from_pretrained(prepare_model(load_model("llama"), "bf16+quant:nf4"), tmp_path)
    model.eval(), reloaded.eval()
    batch = make_batch("llama")
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reloaded(**batch).logits)  # the same quantization, the same adapters


def test_merge_gives_a_16bit_model_with_the_qlora_models_outputs(load_model, tmp_path):
    from transformers import LlamaForCausalLM

    batch = {"input_ids": make_batch("llama")["input_ids"]}
    with torch.no_grad():
        original = load_model("llama").eval()(**batch).logits
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _qlora(load_model, "fp32+quant:nf4").eval()
        with torch.no_grad():
            qlora = model(**batch).logits
        merged = merge_adapters(model, dtype=dtype)
        assert type(merged) is LlamaForCausalLM and not any("lora_" in n for n, _ in merged.named_parameters())
        assert {p.dtype for p in merged.parameters()} == {dtype} and merged.config.use_cache is True
        merged.save_pretrained(tmp_path / str(dtype))
        reloaded = LlamaForCausalLM.from_pretrained(tmp_path / str(dtype), dtype=dtype).eval()
        with torch.no_grad():
            outputs[dtype] = reloaded(**batch).logits.float()
    # fp32: the merge is the same arithmetic as the 4-bit model with its adapters.
    torch.testing.assert_close(outputs[torch.float32], qlora, rtol=1e-4, atol=1e-5)
    # bf16: within the noise of one bf16 rounding, far below what the quantization itself moved.
    quantization = (qlora - original).abs().mean()
    assert quantization > 0 and (outputs[torch.bfloat16] - qlora).abs().mean() < 0.25 * quantization


def test_merge_and_dequantize_a_bitsandbytes_base(pretrained_dirs):
    from peft import get_peft_model

    model = get_peft_model(_bnb_model(pretrained_dirs), _lora()).eval()
    batch = {"input_ids": make_batch("llama")["input_ids"]}
    with torch.no_grad():
        qlora = model(**batch).logits.float()
        merged = merge_adapters(model, dtype=torch.float32)
        assert all(type(m) is nn.Linear for n, m in merged.named_modules() if n.endswith(LINEARS))
        out = merged(**batch).logits
    torch.testing.assert_close(
        out, qlora, rtol=2e-2, atol=2e-2
    )  # bitsandbytes computed in bf16; the merged model in fp32
    plain = dequantize(_bnb_model(pretrained_dirs), dtype=torch.bfloat16)
    assert not any(p.dtype == torch.uint8 for p in plain.parameters())


# ------------------------------------------------------------------------------------------ refusals


def _frozen_embeddings(c):
    model = c("llama")
    model.model.embed_tokens.weight.requires_grad_(False)  # what trains was decided: the blocks do
    return model


REFUSALS = [
    (
        "trainable-weights",
        _frozen_embeddings,
        "bf16+quant:nf4",
        ValueError,
        ("would quantize weights that train", "model.layers.0.self_attn.q_proj", "peft.get_peft_model"),
    ),
    (
        "conv1d",
        lambda c: c("gpt2"),
        "bf16+quant:nf4",
        ValueError,
        ("not nn.Linear", "transformer.h.0.attn.c_attn (Conv1D)", "BitsAndBytesConfig(load_in_4bit=True)"),
    ),
    (
        "embedding",
        lambda c: c("llama"),
        MemoryPolicy(quant={"mode": "nf4", "targets": ["embed_tokens"]}),
        ValueError,
        ("not nn.Linear", "model.embed_tokens (Embedding)", "policy.quant.targets"),
    ),
    (
        "no-match",
        lambda c: c("llama"),
        MemoryPolicy(quant={"mode": "nf4", "targets": ["qkv"]}),
        ValueError,
        ("'qkv' matches no module", "q_proj"),
    ),
    (
        "block-size",
        lambda c: c("llama"),
        MemoryPolicy(quant={"mode": "nf4", "block_size": 4096}),
        ValueError,
        ("block_size=4096", "not a multiple of the block size", "policy.quant.targets"),
    ),
    (
        "no-blocks",
        lambda c: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)),
        "quant:nf4",
        ValueError,
        ("no blocks", "policy.quant.targets"),
    ),
]


@pytest.mark.parametrize("build, policy, error, fragments", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_name_the_fix_and_leave_the_model_untouched(load_model, build, policy, error, fragments):
    model = build(load_model)
    before = snapshot(model)
    with pytest.raises(error) as info:
        prepare_model(model, policy)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_untouched(model, before)


def test_trainable_4bit_weights_are_refused_naming_the_fix(load_model):
    from torchao.quantization import NF4Tensor, to_nf4

    model = load_model("llama")
    layer = model.model.layers[0].self_attn.q_proj
    layer.weight = nn.Parameter(to_nf4(layer.weight.detach().to(torch.bfloat16), 64, 64), requires_grad=True)
    with pytest.raises(
        ValueError,
        match=r"4-bit weights require grad \(model.layers.0.self_attn.q_proj\).*requires_grad_\(False\).*get_peft_model",
    ):
        prepare_model(model, "bf16+ckpt")
    assert getattr(model, "memstack", None) is None and isinstance(layer.weight, NF4Tensor)
    assert not model.model.layers[0].gradient_checkpointing


def test_sharding_checks_the_shapes_and_refuses_bitsandbytes(load_model, pretrained_dirs):
    from hf_memstack.policy import QuantConfig
    from hf_memstack.transforms.blocks import find_blocks
    from hf_memstack.transforms.quant.apply import check_quant

    model = load_model("llama")
    plan = check_quant(
        model, QuantConfig(mode="nf4"), dtype=torch.bfloat16, blocks=find_blocks(model), shards=2, fsdp=True
    )
    assert len(plan.targets) == 14 and {t.scaler_block_size for t in plan.targets} == {
        16,
        32,
        64,
    }  # per shard: 16-64 blocks
    with pytest.raises(
        ValueError, match=r"FSDP over 3 ranks: 'model.layers.0.self_attn.q_proj' \(\(64, 64\)\) does not split into 3"
    ):
        check_quant(
            model, QuantConfig(mode="nf4"), dtype=torch.bfloat16, blocks=find_blocks(model), shards=3, fsdp=True
        )
    bnb = _bnb_model(pretrained_dirs)
    with pytest.raises(ValueError, match="bitsandbytes 4-bit weights and the policy shards with FSDP2.*add quant:nf4"):
        check_quant(bnb, QuantConfig(), dtype=torch.bfloat16, blocks=find_blocks(bnb), fsdp=True)


def test_policy_tokens_and_validation():
    policy = MemoryPolicy.from_string("bf16+ckpt+quant:nf4")
    assert policy.quant.mode == "nf4" and not policy.quant.upcast and policy.to_string() == "bf16+ckpt+quant:nf4"
    assert MemoryPolicy.from_string("quant:nf4:upcast+bf16").to_string() == "bf16+quant:nf4:upcast"
    assert MemoryPolicy.from_dict(
        MemoryPolicy(quant={"mode": "nf4", "targets": ["q_proj"]}).to_dict()
    ).quant.targets == ("q_proj",)
    with pytest.raises(PolicyError) as info:
        MemoryPolicy(quant={"mode": "nf8", "block_size": 48, "targets": []})
    text = str(info.value)
    assert (
        "policy.quant.mode='nf8' is not one of 'none', 'nf4'" in text and "block_size=48 must be a power of two" in text
    )
    assert "policy.quant.targets=() must be a non-empty list" in text
    with pytest.raises(PolicyError, match="'quant:int4' is not one of 'quant:nf4', 'quant:nf4:upcast'"):
        MemoryPolicy.from_string("bf16+quant:int4")
    with pytest.raises(PolicyError, match="upcast / targets are set but policy.quant.mode='none'"):
        MemoryPolicy(quant={"upcast": True})


def test_without_torchao_quant_is_a_clear_error_and_the_library_imports_without_torchao_or_bitsandbytes(
    load_model, monkeypatch
):
    code = (
        "import sys; sys.modules.update({'torchao': None, 'bitsandbytes': None}); import hf_memstack; "
        "from hf_memstack import MemoryPolicy; print(MemoryPolicy.from_string('bf16+quant:nf4').to_string())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "bf16+quant:nf4", done.stderr
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    model = load_model("llama")
    before = snapshot(model)
    with pytest.raises(
        RuntimeError, match=r"policy.quant.mode='nf4' needs torchao.*pip install 'hf_memstack\[quant\]'"
    ):
        prepare_model(model, "bf16+quant:nf4")
    assert_untouched(model, before)


# ------------------------------------------------------------------------------- new-user trial findings


def test_quantizing_a_model_with_no_adapters_warns_and_verify_fails_until_adapters_are_added(load_model):
    """A full fine-tune given quant:nf4 (no PEFT yet) is QLoRA's order - adapters come next - but left
    alone it would train only the embeddings, norms and head: prepare_model says so, and verify fails
    until adapters are on; with them it passes."""
    from peft import get_peft_model

    model = load_model("llama")
    with pytest.warns(UserWarning, match="add LoRA adapters next"):
        model = prepare_model(model, "fp32+quant:nf4")
    batch = make_batch("llama")
    report = verify(model, batch)
    quant = next(c for c in report.checks if c.name == "quant")
    assert not quant.ok and "the model has no adapters" in quant.detail, report
    peft = get_peft_model(model, _lora())
    assert next(c for c in verify(peft, batch).checks if c.name == "quant").ok


def test_a_peft_wrapper_around_an_eval_mode_model_is_named_as_eval_mode(load_model):
    """from_pretrained returns eval mode; get_peft_model's wrapper trains while the model inside does
    not. verify names eval mode (not a broken checkpointing) and the first training forward warns."""
    from peft import get_peft_model

    model = get_peft_model(load_model("llama").eval(), _lora())
    assert model.training and not model.base_model.model.training
    model = prepare_model(model, "fp32+ckpt+quant:nf4")
    batch = make_batch("llama")
    with pytest.warns(UserWarning, match="in eval mode"):
        model(**batch).loss.backward()
    check = next(c for c in verify(model, batch).checks if c.name == "checkpointing")
    assert not check.ok and "is in eval mode" in check.detail and "call model.train()" in check.detail
    model.train()
    assert next(c for c in verify(model, batch).checks if c.name == "checkpointing").ok
