"""loss:chunked on mixture-of-experts models: with ``output_router_logits`` (per call or in the
config) the chunked loss adds the routers' load-balancing loss exactly as the model's own forward
does - loss, ``aux_loss`` and every gradient (the routers' in particular) equal the unprepared
model's - and a model whose router loss hf_memstack cannot reproduce is refused, never trained
without it. Tiny Mixtral and Qwen2-MoE saved with save_pretrained and loaded with from_pretrained."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny import VOCAB, assert_untouched, snapshot

from hf_memstack import MemoryPolicy, prepare_model, verify


def _configs() -> dict:
    import transformers

    common = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "router_aux_loss_coef": 0.3,
    }
    return {
        "mixtral": (
            transformers.MixtralForCausalLM,
            transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        ),
        "qwen2_moe": (
            transformers.Qwen2MoeForCausalLM,
            transformers.Qwen2MoeConfig(
                **common,
                intermediate_size=64,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        ),
    }


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    for arch, (cls, config) in _configs().items():
        torch.manual_seed(0)
        cls(config).save_pretrained(root / arch)
    return {arch: root / arch for arch in _configs()}


@pytest.fixture
def load_moe(moe_dirs):
    def load(arch: str, **config_overrides) -> torch.nn.Module:
        cls, _ = _configs()[arch]
        return cls.from_pretrained(moe_dirs[arch], dtype=torch.float32, **config_overrides).train()

    return load


def _chunked(**extra) -> MemoryPolicy:
    return MemoryPolicy(precision="fp32", loss={"mode": "chunked", "chunk_tokens": 5}, **extra)


def _batch(batch_size: int = 3, seq: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: the router loss counts only attended tokens
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 4:6] = -100  # prompt masking
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _run(
    model: torch.nn.Module, batch: dict, **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), None if out.aux_loss is None else out.aux_loss.detach(), grads


def _routers(grads: dict) -> list[str]:
    return [n for n in grads if n.endswith("mlp.gate.weight")]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("flag", ["config", "call"])
def test_router_loss_and_every_gradient_equal_the_models_own(load_moe, arch, flag):
    reference = load_moe(arch, output_router_logits=True) if flag == "config" else load_moe(arch)
    model = prepare_model(copy.deepcopy(reference), _chunked())
    assert model.memstack.loss.router_aux_loss and "router load-balancing loss" in model.memstack.loss.describe()
    call = {"output_router_logits": True} if flag == "call" else {}
    batch = _batch()
    for extra in ({}, {"num_items_in_batch": torch.tensor(23)}):  # Trainer's gradient-accumulation scaling
        want_loss, want_aux, want = _run(reference, batch, **call, **extra)
        got_loss, got_aux, got = _run(model, batch, **call, **extra)
        assert want_aux is not None and got_aux is not None
        assert float(got_aux) == pytest.approx(float(want_aux), rel=1e-5)
        assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)
        assert got.keys() == want.keys() and len(_routers(want)) == 2
        for name, g in want.items():
            assert (got[name] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-12, name
    assert model(**batch, **call).logits is None


def test_the_router_loss_reaches_the_routers(load_moe):
    """The load-balancing term has its own, nonzero gradient on every router, and adding it changes
    the routers' gradient by the coefficient times that gradient (what the old head silently dropped)."""
    model = prepare_model(load_moe("mixtral"), _chunked())
    batch = _batch()
    out = model(**batch, output_router_logits=True)
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    aux_grads = torch.autograd.grad(out.aux_loss, routers, retain_graph=True)
    assert all(g.abs().max() > 0 for g in aux_grads)
    with_aux = torch.autograd.grad(out.loss, routers)
    without = torch.autograd.grad(model(**batch, output_router_logits=False).loss, routers)
    coefficient = model.config.router_aux_loss_coef
    for w, wo, a in zip(with_aux, without, aux_grads):
        torch.testing.assert_close(w - wo, coefficient * a, rtol=1e-4, atol=1e-7)


def test_without_the_flag_no_router_loss_as_the_model_does(load_moe):
    reference = load_moe("mixtral")
    model = prepare_model(copy.deepcopy(reference), _chunked())
    batch = _batch()
    want_loss, want_aux, _ = _run(reference, batch)
    got_loss, got_aux, _ = _run(model, batch)
    assert want_aux is None and got_aux is None
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5)


def test_return_dict_false_keeps_the_models_tuple_positions(load_moe):
    """The model's tuple is (loss, aux_loss, logits, router_logits): the logits' slot stays (None),
    so out[1] is still aux_loss and out[-1] the router logits."""
    reference = load_moe("mixtral", output_router_logits=True)
    model = prepare_model(copy.deepcopy(reference), _chunked())
    own = reference(**_batch(), use_cache=False, return_dict=False)
    ours = model(**_batch(), use_cache=False, return_dict=False)
    assert isinstance(own, tuple) and isinstance(ours, tuple) and len(ours) == len(own) == 4
    assert ours[2] is None and own[2].shape[-1] == VOCAB
    for i in (0, 1):
        assert float(ours[i]) == pytest.approx(float(own[i]), rel=1e-5)
    assert len(ours[3]) == len(own[3]) == 2 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours[3], own[3]))


@pytest.mark.parametrize("use_cache", [None, True, False], ids=["config-default", "true", "false"])
def test_the_tuple_positions_follow_the_unprepared_model_for_any_use_cache(load_moe, use_cache):
    """New-user trial: with use_cache left at the config's default (True) the unprepared model's tuple
    is (loss, aux_loss, logits, cache, router_logits), but prepare_model turns the config's use_cache
    off for training, so the chunked loss returned (loss, aux_loss, router_logits): the router logits
    moved to index 2. The cache's slot now stays (None unless the call asks for the cache)."""
    reference = load_moe("mixtral", output_router_logits=True)
    model = prepare_model(copy.deepcopy(reference), "fp32+loss:chunked")
    batch = {**_batch(), **({} if use_cache is None else {"use_cache": use_cache})}
    own = reference(**batch, return_dict=False)
    ours = model(**batch, return_dict=False)
    assert len(ours) == len(own) == (4 if use_cache is False else 5)
    # Per position: the same type, except the fields the prepared model does not build (logits,
    # and the cache unless the call passes use_cache=True), whose slots hold None.
    never_built = {2} | ({3} if use_cache is None else set())
    for i, (a, b) in enumerate(zip(own, ours)):
        assert (b is None) if i in never_built else (type(a) is type(b)), (i, type(a), type(b))
    assert float(ours[1]) == pytest.approx(float(own[1]), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours[-1], own[-1]))


@pytest.mark.parametrize("spec", ["fp32+loss:chunked", "bf16+ckpt+loss:chunked"])
def test_prepare_verify_and_a_real_step(load_moe, spec):
    model = prepare_model(load_moe("mixtral", output_router_logits=True), spec)
    batch = _batch()
    report = verify(model, batch)
    assert report.ok and report.check("loss").ok, str(report)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    out = model(**batch)
    assert out.aux_loss is not None
    out.loss.backward()
    optimizer.step()
    assert all(not torch.equal(p, routers[n]) for n, p in model.named_parameters() if n in routers)


def test_the_prepare_time_check_leaves_no_hooks_behind(load_moe):
    """prepare_model compares the router loss with the model's own, a forward that makes Transformers
    install its output-capturing hooks (local functions: no pickling). They are removed afterwards,
    and the router loss still works, in the model and in its pickled copy."""
    import pickle

    model = prepare_model(load_moe("mixtral"), _chunked())
    assert not any(m._forward_hooks for m in model.modules())
    copied = pickle.loads(pickle.dumps(model))
    batch = _batch()
    ours, theirs = model(**batch, output_router_logits=True), copied(**batch, output_router_logits=True)
    assert ours.aux_loss is not None and float(theirs.aux_loss) == pytest.approx(float(ours.aux_loss), rel=1e-6)
    assert float(theirs.loss) == pytest.approx(float(ours.loss), rel=1e-6)


def _doge() -> torch.nn.Module:
    import transformers

    config = transformers.DogeConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        num_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.DogeForCausalLM(config).train()


def _doubled_router_loss(load_moe) -> torch.nn.Module:
    """A Mixtral whose forward weighs its router loss in a way the chunked loss does not know."""
    import transformers

    class DoubledRouterMixtralForCausalLM(transformers.MixtralForCausalLM):
        def forward(self, *args, output_router_logits=None, **kwargs):
            out = super().forward(*args, output_router_logits=output_router_logits, **kwargs)
            if out.aux_loss is not None:
                out.aux_loss = 2 * out.aux_loss
            return out

    reference = load_moe("mixtral")
    model = DoubledRouterMixtralForCausalLM(reference.config).train()
    model.load_state_dict(reference.state_dict())
    return model


@pytest.mark.parametrize(
    "build, fragments",
    [
        (lambda load: _doge(), ("DogeForCausalLM", "load_balancing_loss_func", "num_keys", "drop loss:chunked")),
        (_doubled_router_loss, ("chunked aux_loss", "differs from the model's own", "Drop loss:chunked")),
    ],
)
def test_a_router_loss_it_cannot_reproduce_is_refused_with_the_model_untouched(load_moe, build, fragments):
    model = build(load_moe)
    before = snapshot(model)
    with pytest.raises(ValueError) as e:
        prepare_model(model, "fp32+loss:chunked")
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert_untouched(model, before)
