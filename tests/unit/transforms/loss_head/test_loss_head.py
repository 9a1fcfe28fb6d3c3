"""The chunked loss head (policy token loss:chunked): the loss and every gradient equal the model's
own on Llama, GPT-2 (tied head), Qwen2 (untied) and Gemma-2 (final-logit soft-capping), with prompt
masking, gradient accumulation (num_items_in_batch), shift_labels, PEFT heads, checkpointing and
compile; without labels the model's own forward runs; bad input is refused with the model untouched."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from tiny import VOCAB, PlainStack, assert_untouched, make_batch, snapshot
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memstack import MemoryPolicy, measure_step, prepare_model, verify


def _causal_lm(arch: str, vocab: int = VOCAB) -> torch.nn.Module:
    import transformers

    common = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
    }
    configs = {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_embd=64,
                n_layer=2,
                n_head=4,
                vocab_size=vocab,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False)),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**common, head_dim=16, final_logit_softcapping=3.0, attn_logit_softcapping=None)
        ),
    }
    torch.manual_seed(0)
    return configs[arch]().train()


def _chunked(chunk_tokens: int = 5, precision: str = "fp32", **extra: str) -> MemoryPolicy:
    return MemoryPolicy(precision=precision, loss={"mode": "chunked", "chunk_tokens": chunk_tokens}, **extra)


def _masked_batch(batch_size: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    batch = make_batch("llama", batch_size=batch_size, seed=seed)
    batch["labels"][:, :5] = -100  # the prompt: no loss on it
    batch["labels"][0, -3:] = -100  # padding at the end of one sample
    return batch


def _step(model: torch.nn.Module, batch: dict, **kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        scale = g.abs().max().item()
        assert (got[name] - g).abs().max().item() <= rel * scale + 1e-12, name


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gemma2"])
def test_loss_and_every_gradient_equal_the_models_own(arch):
    reference = _causal_lm(arch)
    model = prepare_model(copy.deepcopy(reference), _chunked())
    assert model.memstack.loss.path == "fused"
    assert model.memstack.loss.softcap == (3.0 if arch == "gemma2" else None)
    batch = _masked_batch()
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(29)}):  # Trainer's gradient-accumulation scaling
        want_loss, want = _step(reference, batch, **kwargs)
        got_loss, got = _step(model, batch, **kwargs)
        assert got_loss == pytest.approx(want_loss, rel=1e-5)
        _assert_grads_close(got, want, rel=1e-5)
    assert model(**batch).logits is None  # training with labels: the full logits never exist


def test_gradient_accumulation_over_micro_batches_matches(load_model):
    reference = load_model("llama")
    model = prepare_model(copy.deepcopy(reference), _chunked())
    micro = [_masked_batch(2, seed=1), _masked_batch(3, seed=2)]
    micro[1]["labels"][:, :9] = -100  # a different number of counted tokens per micro-batch
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    for m in (reference, model):
        m.zero_grad(set_to_none=True)
        for b in micro:
            m(**b, num_items_in_batch=torch.tensor(total)).loss.backward()
    _assert_grads_close(
        {n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()}, rel=1e-5
    )


def test_shift_labels_are_used_as_given(load_model):
    reference = load_model("llama")
    model = prepare_model(copy.deepcopy(reference), _chunked(chunk_tokens=7))
    batch = make_batch("llama")
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    shifted[:, ::4] = -100
    # As Transformers' loss: with shift_labels (context/sequence parallelism), labels only switch the loss on.
    want_loss, want = _step(reference, batch, shift_labels=shifted)
    got_loss, got = _step(model, batch, shift_labels=shifted)
    assert got_loss != pytest.approx(_step(reference, batch)[0], rel=1e-3)  # the shifted labels were used
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(got, want, rel=1e-5)


def test_mixed_precision_within_bf16_noise(load_model):
    reference = prepare_model(load_model("llama"), "bf16")
    model = prepare_model(load_model("llama"), _chunked(precision="bf16"))
    batch = _masked_batch()
    want_loss, want = _step(reference, batch)
    got_loss, got = _step(model, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-2)
    for name, g in want.items():  # bf16 keeps ~3 significant digits: compare directions and sizes
        cosine = torch.nn.functional.cosine_similarity(got[name].flatten(), g.flatten(), dim=0)
        assert cosine > 0.999 and got[name].norm() == pytest.approx(g.norm().item(), rel=2e-2), name


class _HeadShapes(TorchDispatchMode):
    """Records the dtypes of matmuls against the head's weight, and of every new [vocab, hidden] tensor."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.shape, self.matmul_dtypes, self.weight_copies = (vocab, hidden), set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Every overload: the chunks write their matmuls into reused buffers (mm.out, addmm_).
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_) and any(
            torch.is_tensor(a) and self.shape[0] in a.shape and a.dim() == 2 for a in args
        ):
            self.matmul_dtypes.add(out.dtype)
        if torch.is_tensor(out) and tuple(out.shape) == self.shape and not func.overloadpacket.__name__.endswith("_"):
            self.weight_copies.append((func.__name__, out.dtype))  # made, not updated in place
        return out


def test_head_matmul_stays_in_the_compute_dtype():
    model = prepare_model(_causal_lm("llama", vocab=512), _chunked(chunk_tokens=8, precision="bf16"))
    batch = make_batch("llama")
    batch["input_ids"] %= 512
    batch["labels"] %= 512
    with _HeadShapes(512, 64) as seen:
        loss = model(**batch).loss
    loss.backward()
    assert seen.matmul_dtypes == {torch.bfloat16}
    # In the forward: one bf16 cast of the weight and its bf16 gradient; no fp32 copy, per chunk or at
    # all (trl#6863). (The backward then gives the fp32 weight its fp32 gradient.)
    assert [dtype for _, dtype in seen.weight_copies] == [torch.bfloat16] * 2, seen.weight_copies
    assert model.lm_head.weight.grad.dtype == torch.float32


def test_without_labels_or_gradients_the_models_own_forward_runs(load_model):
    reference = load_model("gpt2").eval()
    model = prepare_model(copy.deepcopy(reference), _chunked()).eval()
    batch = make_batch("gpt2")
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch["input_ids"]).logits, reference(input_ids=batch["input_ids"]).logits)
        evaluated = model(**batch)  # evaluation with labels: logits for metrics, and the loss
        assert evaluated.logits is not None and float(evaluated.loss) == pytest.approx(
            float(reference(**batch).loss), rel=1e-6
        )
    assert model(input_ids=batch["input_ids"]).logits.requires_grad  # generation-style calls, with gradients on too


def test_return_dict_false_keeps_the_tuple_positions():
    """The model's own tuple is (loss, logits, cache): out[1] stays the logits' slot (None: never
    made), out[2] the cache, so code that unpacks by position gets the same fields."""
    reference = _causal_lm("llama")
    model = prepare_model(copy.deepcopy(reference), _chunked())
    batch = _masked_batch()
    own = reference(**batch, return_dict=False, use_cache=True)
    ours = model(**batch, return_dict=False, use_cache=True)
    assert len(ours) == len(own) == 3
    assert float(ours[0].detach()) == pytest.approx(float(own[0].detach()), rel=1e-5)
    assert ours[1] is None and own[1].shape[-1] == VOCAB
    assert type(ours[2]) is type(own[2]) and ours[2].get_seq_length() == own[2].get_seq_length()


def test_verify_compares_the_losses_without_dropout_noise():
    """On a model in training mode with dropout, verify compares the head's arithmetic, not two
    draws of dropout: the losses agree to fp32 rounding, and the model is left in training mode."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.5,
            embd_pdrop=0.5,
            attn_pdrop=0.5,
        )
    ).train()
    model = prepare_model(model, _chunked())
    check = verify(model, make_batch("gpt2")).check("loss")
    ours, theirs = (float(x) for x in check.detail.split(" on the first")[0].replace(",", "").split()[2::4])
    assert check.ok and ours == pytest.approx(theirs, rel=1e-5), check.detail
    assert all(m.training for m in model.modules())


def test_verify_compares_the_losses_on_a_sample_with_labels(load_model):
    """A first sample whose labels are all -100 has no loss (nan in both heads): verify compares the
    heads on the first sample that has one (was: a FAIL saying they differ, advising to drop loss:chunked)."""
    batch = make_batch("llama", batch_size=3)
    batch["labels"][0] = -100
    check = verify(prepare_model(load_model("llama"), _chunked()), batch).check("loss")
    with torch.no_grad():
        own = float(load_model("llama")(**{k: v[1:2] for k, v in batch.items()}).loss)  # the second sample's
    ours, theirs = (float(x) for x in check.detail.split(" on the first")[0].replace(",", "").split()[2::4])
    assert check.ok, check.detail
    assert ours == pytest.approx(own, rel=1e-5) and theirs == pytest.approx(own, rel=1e-5)


def test_forward_signature_pickle_and_deepcopy_are_kept(load_model):
    model = prepare_model(load_model("llama"), _chunked(precision="bf16"))
    original = inspect.signature(type(model).forward)
    assert list(inspect.signature(model.forward).parameters) == list(original.parameters)[1:]  # Trainer reads this
    batch = _masked_batch()
    loss = float(model(**batch).loss.detach())
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        # The wrappers, outermost first: autocast, the packed-batch guard (it sees the batch as the caller passes it), the loss head.
        chain, forward = [], copied.forward
        while hasattr(forward, "__wrapped__"):
            chain.append(type(forward).__name__)
            forward = forward.__wrapped__
        assert chain[:3] == ["AutocastForward", "PackedBatchGuard", "ChunkedLossForward"], (
            chain
        )  # then the bound forward
        assert copied(**batch).logits is None
        assert float(copied(**batch).loss.detach()) == pytest.approx(loss, rel=1e-6)


def test_activations_after_the_forward_lose_the_logits():
    vocab, batch = 4096, make_batch("llama", batch_size=4, seq=32)
    batch = {k: v % vocab for k, v in batch.items()}
    plain = measure_step(prepare_model(_causal_lm("llama", vocab), "bf16"), batch, None, timed=False)
    chunked = measure_step(prepare_model(_causal_lm("llama", vocab), "bf16+loss:chunked"), batch, None, timed=False)
    # Gone: the fp32 copy of the logits that the loss keeps for its backward (4 bytes a logit; the bf16
    # logits themselves only live through the forward). The head's bf16 gradient, made in the forward,
    # takes the place of the bf16 weight copy the plain head saves for its backward.
    logits = 4 * 32 * vocab * 4
    assert chunked.saved_activations <= plain.saved_activations - 0.95 * logits, (plain, chunked)
    assert chunked.peak_bytes <= plain.peak_bytes - 0.95 * logits


def _peft_model(arch: str, how: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = {"attention": ["q_proj", "v_proj"], "lora-head": ["q_proj", "lm_head"]}
    saved = ["lm_head"] if how == "saved-head" else None
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=targets.get(how, ["q_proj"]), modules_to_save=saved, init_lora_weights=False
    )
    torch.manual_seed(3)
    return get_peft_model(_causal_lm(arch), config)


@pytest.mark.parametrize("how, path", [("attention", "fused"), ("saved-head", "fused"), ("lora-head", "checkpointed")])
def test_peft_heads(how, path):
    reference = _peft_model("llama", how)
    model = prepare_model(copy.deepcopy(reference), _chunked())
    assert model.memstack.loss.path == path
    batch = _masked_batch()
    want_loss, want = _step(reference, batch)
    got_loss, got = _step(model, batch)
    assert got and all("lora_" in n or "modules_to_save" in n for n in got)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(got, want, rel=1e-5)


@pytest.mark.parametrize("spec", ["fp32+ckpt", "fp32+ckpt+compile:regional", "fp32+ckpt:selective+compile"])
def test_composes_with_checkpointing_and_compile(load_model, spec):
    reference = load_model("llama")
    policy = _chunked(chunk_tokens=6)
    merged = MemoryPolicy.from_dict({**MemoryPolicy.from_string(spec).to_dict(), "loss": policy.to_dict()["loss"]})
    merged.compile.backend = "aot_eager"  # dynamo traces the chunked head; inductor is in the slow tests
    model = prepare_model(copy.deepcopy(reference), merged)
    batch = _masked_batch()
    report = verify(model, batch)
    assert report.ok and report.check("loss").ok, str(report)
    want_loss, want = _step(reference, batch)
    got_loss, got = _step(model, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(got, want, rel=1e-5)
    if merged.compile.mode != "none":
        assert model.memstack.compile.graph_calls > 0


def _doubled_llama() -> torch.nn.Module:
    """A causal LM whose forward scales its logits in a way hf_memstack does not know."""
    import transformers

    class DoubledLlamaForCausalLM(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = 2 * self.lm_head(hidden)
            loss = self.loss_function(logits, labels, self.config.vocab_size) if labels is not None else None
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    torch.manual_seed(0)
    return DoubledLlamaForCausalLM(_causal_lm("llama").config).train()


@pytest.mark.parametrize(
    "build, fragments",
    [
        (
            lambda load: load("bert"),
            (
                "policy.loss.mode='chunked'",
                "BertForSequenceClassification",
                "not a causal language model",
                "drop loss:chunked",
            ),
        ),
        (lambda load: PlainStack(), ("policy.loss.mode='chunked'", "PlainStack", "drop loss:chunked")),
        (lambda load: _doubled_llama(), ("differs from the model's own", "Drop loss:chunked")),
    ],
)
def test_bad_input_is_refused_with_the_model_untouched(load_model, build, fragments):
    model = build(load_model)
    before = snapshot(model)
    with pytest.raises(ValueError) as e:
        prepare_model(model, "bf16+ckpt+loss:chunked")
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert_untouched(model, before)


@pytest.mark.parametrize(
    "field, position, value",
    [
        ("input_ids", (0, 3), VOCAB),
        ("input_ids", (1, 0), -1),
        ("labels", (0, 5), VOCAB + 7),
        ("labels", (1, 2), -1),
    ],
)
def test_ids_outside_the_vocabulary_are_named(load_model, field, position, value):
    """Before the forward, one check over input_ids and labels names the field, the id and the
    vocabulary (the embedding's and the loss's own index errors name neither); -100 stays allowed."""
    model = prepare_model(load_model("llama"), _chunked())
    batch = _masked_batch()
    batch[field][position] = value
    with pytest.raises(ValueError) as e:
        model(**batch)
    message = str(e.value)
    assert f"{field} holds id {value}" in message and f"{VOCAB} ids: 0-{VOCAB - 1}" in message, message
    assert "resize_token_embeddings" in message
    assert all(p.grad is None for p in model.parameters())  # refused before anything ran


@pytest.mark.parametrize(
    "labels_of, fragments",
    [
        # Shifted by the user (one position short): flattened, they were matched to the wrong positions.
        (lambda ids: ids[:, 1:], ("labels has shape [3, 15]", "[3, 16] positions", "shift_labels")),
        (lambda ids: ids[:1], ("labels has shape [1, 16]", "[3, 16] positions")),
        (lambda ids: ids.float(), ("labels has dtype torch.float32", "labels.long()")),
    ],
    ids=["pre-shifted", "one-row", "float"],
)
def test_labels_that_do_not_match_the_positions_are_refused(load_model, labels_of, fragments):
    """Transformers' own loss stops on these (a count or dtype mismatch); flattened into the chunks,
    labels of another shape used to train silently on misaligned targets."""
    model = prepare_model(load_model("llama"), _chunked())
    batch = _masked_batch()
    batch["labels"] = labels_of(batch["input_ids"])
    with pytest.raises(ValueError) as e:
        model(**batch).loss.backward()
    assert all(f in str(e.value) for f in fragments), str(e.value)
    assert all(p.grad is None for p in model.parameters())  # refused before any gradient


def test_fp16_head_gradient_does_not_overflow_where_the_models_own_does_not():
    """fp16: the head's gradient summed over a step's tokens, unscaled, passes fp16's 65504 on a batch
    of repeated tokens over large hidden states, where the true (mean) gradient is small: it must
    accumulate in fp32, or GradScaler skips every step. Reference: the unprepared model in fp32."""
    model = _causal_lm("llama", vocab=97)
    with torch.no_grad():
        model.model.norm.weight.fill_(40.0)  # final hidden states of magnitude ~40
    ids = torch.full((4, 512), 5)
    ids[:, :8] = torch.randint(0, 97, (4, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}  # 2,000 labelled repeats of one token
    _, want = _step(copy.deepcopy(model), batch)
    prepared = prepare_model(model, MemoryPolicy(precision="fp16", loss={"mode": "chunked", "chunk_tokens": 64}))
    _, got = _step(prepared, batch)
    head = got["lm_head.weight"]
    assert torch.isfinite(head).all(), "the head's fp16 gradient overflowed"
    assert torch.allclose(head, want["lm_head.weight"], rtol=2e-2, atol=2e-2 * want["lm_head.weight"].abs().max())


def test_chunked_lm_loss_names_a_label_outside_the_head():
    from hf_memstack.transforms.loss_head import chunked_lm_loss

    head = torch.nn.Linear(8, 16, bias=False)
    hidden = torch.randn(2, 5, 8)
    labels = torch.tensor([[1, 2, -100, 3, 4], [5, 6, 7, 16, 0]])
    with pytest.raises(ValueError, match=r"labels holds id 16 .*16 ids: 0-15.*-100 \(ignore_index\)"):
        chunked_lm_loss(hidden, head, labels=labels, chunk_tokens=3)
    labels[1, 3] = 15
    want = torch.nn.functional.cross_entropy(head(hidden)[:, :-1].reshape(-1, 16), labels[:, 1:].reshape(-1))
    assert float(chunked_lm_loss(hidden, head, labels=labels, chunk_tokens=3)) == pytest.approx(float(want), rel=1e-5)


def test_policy_tokens_round_trip():
    p = MemoryPolicy.from_string("bf16+ckpt+loss:chunked")
    assert (p.loss.mode, p.loss.chunk_tokens) == ("chunked", None)
    assert MemoryPolicy.from_string(p.to_string()) == p
    assert MemoryPolicy.from_dict(p.to_dict()) == p


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_chunks_equal_the_models_own(arch):
    """loss:chunked:compiled (issue 22): the per-chunk softmax, loss and gradient under torch.compile
    give the model's own loss and gradients (soft-capping too), over chunks of two lengths (dynamic)."""
    reference = _causal_lm(arch)
    model = prepare_model(
        copy.deepcopy(reference),
        MemoryPolicy(precision="fp32", loss={"mode": "chunked", "chunk_tokens": 7, "compiled": True}),
    )
    assert model.memstack.loss.compiled and "compiled chunks" in model.memstack.loss.describe()
    batch = _masked_batch()  # 3 x 16 tokens: chunks of 7, 7, ..., then a shorter one
    want_loss, want = _step(reference, batch)
    got_loss, got = _step(model, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close(got, want, rel=1e-5)


def test_compiled_chunks_are_estimated_and_metered_like_eager_ones(load_model, pretrained_dirs):
    """Under the estimator's fake tensors and the meter's MemTracker the chunk runs eagerly (Dynamo
    cannot compile there; a compile under fake tensors crashed the process): same peak as loss:chunked."""
    from hf_memstack import estimate_memory

    d = pretrained_dirs["llama"]
    compiled = estimate_memory(d, "fp32+loss:chunked:compiled", batch_size=2, seq_len=16)
    eager = estimate_memory(d, "fp32+loss:chunked", batch_size=2, seq_len=16)
    assert compiled.peak_bytes == eager.peak_bytes and compiled.policy == "fp32+loss:chunked:compiled"
    batch = make_batch("llama")
    peaks = [
        measure_step(prepare_model(load_model("llama"), spec), batch, None, timed=False).peak_bytes
        for spec in ("fp32+loss:chunked:compiled", "fp32+loss:chunked")
    ]
    assert peaks[0] == peaks[1]


def test_compiled_token_round_trips_and_needs_the_chunked_mode():
    p = MemoryPolicy.from_string("bf16+loss:chunked:compiled")
    assert (p.loss.mode, p.loss.compiled) == ("chunked", True) and p.to_string() == "bf16+loss:chunked:compiled"
    assert MemoryPolicy.from_dict(p.to_dict()) == p
    with pytest.raises(
        ValueError, match=r"policy.loss.compiled=True only applies to mode='chunked'.*loss:chunked:compiled"
    ):
        MemoryPolicy(loss={"mode": "default", "compiled": True})
    with pytest.raises(ValueError, match=r"'loss:compiled' is not one of 'loss:chunked', 'loss:chunked:compiled'"):
        MemoryPolicy.from_string("bf16+loss:compiled")
