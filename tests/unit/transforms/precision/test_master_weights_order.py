"""Master weights follow what trains, whichever comes first: PEFT's get_peft_model (or TRL's
peft_config=, or a 4-bit load with bitsandbytes) before or after prepare_model. References: the
other order, and the dtypes the checkpoint was saved in."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memstack import describe, make_optimizer, prepare_model

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:policy.precision='bf16' on a CPU without:UserWarning")


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _batch():
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _load(path, four_bit=False):
    kwargs = {}
    if four_bit:
        pytest.importorskip("bitsandbytes")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).train()


def _in_order(path, order, four_bit=False, policy="bf16+ckpt"):
    model = _load(path, four_bit)
    if order == "prepare-peft":
        return peft.get_peft_model(prepare_model(model, policy), _lora())
    model = peft.get_peft_model(model, _lora())
    prepare_model(model, policy)
    return model


def _dtypes(model):
    names = {}
    for n, p in model.named_parameters():
        names[n.removeprefix("base_model.model.")] = (p.dtype, p.requires_grad)
    return names


def _step(model, opt):
    model(**_batch()).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("four_bit", [False, True], ids=["bf16", "qlora"])
def test_both_orders_train_with_the_same_dtypes_and_a_frozen_base_is_never_upcast(bf16_dir, four_bit):
    """PEFT after prepare_model: at the first training forward the base PEFT froze goes back to the
    bf16 it was loaded in (the 4-bit load's embeddings, norms and head too), as in the other order."""
    after = _in_order(bf16_dir, "prepare-peft", four_bit)
    before = _in_order(bf16_dir, "peft-prepare", four_bit)
    loaded = {n: p.dtype for n, p in _load(bf16_dir, four_bit).named_parameters()}
    for model in (after, before):
        _step(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    assert _dtypes(after) == _dtypes(before)
    frozen = {n: d for n, (d, trains) in _dtypes(after).items() if not trains}
    assert frozen and all(d == loaded[n.replace(".base_layer", "")] for n, d in frozen.items()), frozen
    assert {d for d, trains in _dtypes(after).values() if trains} == {torch.float32}  # the adapters: PEFT's fp32
    assert "frozen after prepare_model kept in bf16" in describe(after)
    assert "kept in bf16" not in describe(before)


def test_an_optimizer_built_before_the_reconcile_holds_the_same_parameters_and_ties_hold(bf16_dir):
    """The reconcile casts in place: the optimizer built right after get_peft_model steps the same
    Parameter objects, the tied head and embeddings stay one tensor, and the base does not move."""
    model = _in_order(bf16_dir, "prepare-peft")
    params = {id(p): p for p in model.parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inner = model.get_base_model()
    base = inner.model.layers[0].mlp.up_proj.weight
    start = base.detach().clone()
    for _ in range(2):
        _step(model, opt)
    assert {id(p) for p in model.parameters()} == set(params)
    assert inner.lm_head.weight is inner.model.embed_tokens.weight
    assert inner.lm_head.weight.dtype == torch.bfloat16
    assert all(id(p) in params for g in opt.param_groups for p in g["params"])
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values()) and opt.state
    assert base.dtype == torch.bfloat16 and torch.equal(base, start.to(torch.bfloat16))


def test_make_optimizer_reconciles_before_building(bf16_dir):
    model = _in_order(bf16_dir, "prepare-peft")
    assert any(p.dtype == torch.float32 and not p.requires_grad for p in model.parameters())  # not yet
    make_optimizer(model, lr=1e-3)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)


def test_a_parameter_made_trainable_after_prepare_model_gets_fp32_master_weights(bf16_dir):
    """The other direction: PEFT before prepare_model, then a norm unfrozen by hand (a 16-bit
    trainable weight would lose AdamW's small updates): cast to fp32 when training starts."""
    model = _in_order(bf16_dir, "peft-prepare")
    norm = model.get_base_model().model.norm.weight
    norm.requires_grad_(True)
    _step(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    assert norm.dtype == torch.float32
    assert "1 parameter(s) made trainable after prepare_model cast to fp32" in describe(model)
    norm.requires_grad_(False)  # frozen again: back to its loaded dtype
    make_optimizer(model, lr=1e-3)
    assert norm.dtype == torch.bfloat16 and norm.grad is None


def test_an_eval_forward_changes_nothing(bf16_dir):
    model = _in_order(bf16_dir, "prepare-peft")
    model.eval()
    with torch.no_grad():
        model(**_batch())
    assert any(p.dtype == torch.float32 and not p.requires_grad for p in model.parameters())


def test_trl_peft_config_on_a_prepared_model_keeps_the_base_in_its_dtype(bf16_dir, word_tokenizer, tmp_path):
    """TRL's SFTTrainer(model=prepared, peft_config=...) wraps the model in PEFT after prepare_model."""
    trl = pytest.importorskip("trl")
    import datasets

    from hf_memstack.integrations.trainer import MemstackCallback

    words = "the cat sat on a mat dog ran to park".split()
    data = datasets.Dataset.from_list(
        [{"text": " ".join(words[(i + j) % len(words)] for j in range(5))} for i in range(8)]
    )
    model = prepare_model(_load(bf16_dir), "bf16")
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        per_device_train_batch_size=4,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=word_tokenizer,
            peft_config=_lora(),
            callbacks=[MemstackCallback(verify=False, measure=False)],
        )
        trainer.train()
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}


def test_pure_bf16_trains_the_same_dtypes_in_either_peft_order(bf16_dir):
    """weights:bf16 keeps what trains in bf16: PEFT's fp32 adapters added after prepare_model are cast
    to bf16 at make_optimizer, as prepare_model casts them when PEFT comes first; both orders then
    build BF16AdamW over the same dtypes."""
    from hf_memstack.transforms.optim.bf16_adamw import BF16AdamW

    policy = "bf16+ckpt+weights:bf16"
    first = prepare_model(peft.get_peft_model(_load(bf16_dir), _lora()), policy)
    after = peft.get_peft_model(prepare_model(_load(bf16_dir), policy), _lora())
    optimizers = [make_optimizer(m, lr=1e-3) for m in (first, after)]
    assert all(isinstance(o, BF16AdamW) for o in optimizers)
    dtypes = [{n.removeprefix("base_model.model."): p.dtype for n, p in m.named_parameters()} for m in (first, after)]
    assert dtypes[0] == dtypes[1]
    assert {p.dtype for p in after.parameters() if p.requires_grad} == {torch.bfloat16}
    for model, opt in zip((first, after), optimizers):
        model(**_batch()).loss.backward()
        opt.step()
