"""prepare_model's per-sample SDPA on packed rows (``hf_memstack_sdpa``): the same logits and
gradients as Transformers' own SDPA with its block-diagonal mask, the attention work of the
samples alone (the SDPA kernels' query x key positions, read at PyTorch's dispatch), and every
other batch run as Transformers runs it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memstack import estimate_memory, measure_step, prepare_model
from hf_memstack.transforms.packed_attention import PACKED_SDPA
from tests.tiny import VOCAB, configs, llama_config

LENGTHS = [7, 1, 12, 4, 8]  # one sample a single token; 32 tokens a row


def _config(arch: str, attn: str = "sdpa"):
    from transformers import Qwen2Config

    if arch == "llama":
        config = llama_config()
    elif arch == "qwen2-sliding":  # every layer with a window of 5 tokens: samples' blocks are not plain causal
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=0,
        )
    else:
        config = configs()["gpt2"]  # the suite's tiny GPT-2, without dropout
    config._attn_implementation = attn
    config.use_cache = False  # else Transformers' own packed-row detection is off (the reference would attend across)
    return config


def _model(arch: str, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(arch, attn)).train()


def _packed(rows: int = 2, lengths: list[int] = LENGTHS, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(rows, -1).clone()
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding", "gpt2"])
def test_packed_rows_give_transformers_sdpa_logits_and_gradients(arch):
    reference = _model(arch)  # Transformers' SDPA, attending over each row with its block-diagonal mask
    prepared = prepare_model(copy.deepcopy(reference), "fp32")
    assert prepared.config._attn_implementation == PACKED_SDPA
    assert prepared.memstack.attention.applied
    assert "per sample on packed rows" in prepared.memstack.describe()
    batch = _packed()
    reference(**batch).loss.backward()
    out = prepared(**batch)
    out.loss.backward()
    with torch.no_grad():
        expected = reference(**batch).logits
    torch.testing.assert_close(out.logits.detach(), expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(reference.named_parameters(), prepared.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


class _AttentionWork(TorchDispatchMode):
    """Sums, over the SDPA kernels that run, rows x heads x queries x keys: the work that grows
    with the square of the attended length (PyTorch's FlopCounterMode has no CPU SDPA formula)."""

    def __init__(self) -> None:
        super().__init__()
        self.work = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            q, k = args[0], args[1]
            self.work += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        return func(*args, **(kwargs or {}))


def _attention_flops(model, batch) -> int:
    with torch.no_grad(), _AttentionWork() as counter:
        model(**batch)
    return counter.work


def test_the_attention_does_the_work_of_the_samples_alone():
    reference = _model("llama")
    prepared = prepare_model(copy.deepcopy(reference), "fp32")
    batch = _packed()
    _attention_flops(prepared, batch)  # the packed-batch guard's one-time probe runs two small forwards of its own
    whole, per_sample = _attention_flops(reference, batch), _attention_flops(prepared, batch)
    assert whole > 0
    # SDPA's work grows with queries x keys: sum(L_i^2) per row instead of (sum L_i)^2.
    assert per_sample / whole == pytest.approx(sum(n * n for n in LENGTHS) / sum(LENGTHS) ** 2, rel=1e-6)


def test_batches_that_are_not_packed_run_as_transformers_sdpa():
    reference = _model("llama").eval()
    prepared = prepare_model(copy.deepcopy(reference), "fp32").eval()
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    padded_mask = torch.ones_like(ids)
    padded_mask[1, -5:] = 0
    with torch.no_grad():
        for batch in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": padded_mask}):
            assert torch.equal(prepared(**batch).logits, reference(**batch).logits)
            assert _attention_flops(prepared, batch) == _attention_flops(reference, batch)


def test_a_4d_mask_that_lets_the_samples_see_each_other_runs_as_given():
    reference = _model("llama").eval()
    prepared = prepare_model(copy.deepcopy(reference), "fp32").eval()
    batch = _packed()
    batch.pop("labels")
    tokens = batch["input_ids"].shape[1]
    batch["attention_mask"] = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(2, 1, -1, -1)
    with torch.no_grad():
        assert torch.equal(prepared(**batch).logits, reference(**batch).logits)
        assert _attention_flops(prepared, batch) == _attention_flops(reference, batch)


def test_other_attention_implementations_are_kept():
    prepared = prepare_model(_model("llama", attn="eager"), "fp32")
    assert prepared.config._attn_implementation == "eager"
    assert not prepared.memstack.attention.applied
    assert "attention:" not in prepared.memstack.describe()


def test_describe_follows_a_later_switch_of_the_attention():
    prepared = prepare_model(_model("llama"), "fp32")
    assert "run per sample on packed rows" in prepared.memstack.describe()
    prepared.set_attn_implementation("eager")  # the user's own switch, after prepare_model
    line = next(x for x in prepared.memstack.describe().splitlines() if "attention:" in x)
    assert "eager (set after prepare_model" in line and "per sample" not in line


def test_the_estimate_of_packed_rows_follows_the_per_sample_run():
    config = _config("llama")
    config.max_position_embeddings = 512
    lengths = [100, 60, 96]
    batch = _packed(lengths=lengths)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = prepare_model(LlamaForCausalLM(config).train(), "fp32+ckpt")
    measured = measure_step(model, batch, torch.optim.AdamW(model.parameters())).peak_bytes
    estimated = estimate_memory(config, "fp32+ckpt", batch_size=2, seq_len=sum(lengths), packed=True).peak_bytes
    assert estimated == pytest.approx(measured, rel=0.02)


def test_merged_adapters_come_back_on_sdpa():
    from peft import LoraConfig, get_peft_model

    from hf_memstack import merge_adapters

    model = get_peft_model(_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    prepared = prepare_model(model, "fp32")
    assert prepared.get_base_model().config._attn_implementation == PACKED_SDPA
    merged = merge_adapters(prepared, dtype=torch.float32)
    assert merged.config._attn_implementation == "sdpa"


def test_a_4d_mask_sharing_a_prompt_between_two_samples_runs_whole():
    # Found by a new-user trial: [prompt][chosen][rejected] with `rejected` seeing the prompt but not
    # `chosen` (the DPO layout) was split at the restart of the positions and lost the prompt.
    reference = _model("llama").eval()
    prepared = prepare_model(copy.deepcopy(reference), "fp32").eval()
    prompt, chosen, rejected = 6, 5, 4
    tokens = prompt + chosen + rejected
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(prompt + chosen), torch.arange(prompt, prompt + rejected)]).unsqueeze(0)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    mask[prompt + chosen :, prompt : prompt + chosen] = False
    batch = {"input_ids": ids, "position_ids": positions, "attention_mask": mask[None, None]}
    with torch.no_grad():
        torch.testing.assert_close(prepared(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)
        assert _attention_flops(prepared, batch) == _attention_flops(reference, batch)


def test_a_model_whose_own_code_crosses_the_boundaries_is_refused_saying_so():
    # OPT builds its positions from the attention mask: a trial found the refusal told the user to
    # load it with the very implementation it had.
    from transformers import AutoModelForCausalLM, OPTConfig

    config = OPTConfig(
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        word_embed_proj_dim=64,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_config(config).train(), "fp32")
    with pytest.raises(ValueError, match=r"the model's own code crosses them .* do not pack it"):
        model(**_packed())
