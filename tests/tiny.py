"""Tiny models of real architectures and a plain ``nn.Module`` stack, their batches, and a
snapshot that tells whether a model was left untouched. No downloads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 128
SEQ = 16


# The one tiny shape the architectures here share: 64 wide, 2 layers of 4 heads, an MLP of 128.
SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
# A tiny Llama (grouped-query attention: 2 key/value heads) over VOCAB ids.
LLAMA: dict[str, Any] = {**SHAPE, "num_key_value_heads": 2, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2}


def llama_config(**overrides: Any) -> Any:
    """The tiny ``LlamaConfig`` (``LLAMA``), with ``overrides`` on top (e.g. ``vocab_size=256``)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA, **overrides})


def tiny_llama(seed: int = 0, **overrides: Any) -> nn.Module:
    """A fresh ``LlamaForCausalLM`` of ``llama_config(**overrides)``, its weights drawn after ``manual_seed(seed)``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides)).train()


def configs(positions: int = 64) -> dict[str, Any]:
    """Each architecture's tiny config; ``positions``: the longest sequence its position table holds."""
    from transformers import BertConfig, GPT2Config, T5Config

    return {
        "llama": llama_config(max_position_embeddings=positions, pad_token_id=0),
        "gpt2": GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=positions,
            bos_token_id=1,
            eos_token_id=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
        "bert": BertConfig(
            **SHAPE,
            vocab_size=VOCAB,
            max_position_embeddings=positions,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        "t5": T5Config(
            d_model=64,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            d_kv=16,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
    }


def model_class(arch: str) -> Any:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "gpt2": transformers.GPT2LMHeadModel,
        "bert": transformers.BertForSequenceClassification,
        "t5": transformers.T5ForConditionalGeneration,
    }[arch]


ARCHS = ("llama", "gpt2", "bert", "t5")


def make_batch(arch: str, batch_size: int = 2, seq: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if arch == "plain":
        x = torch.randn(batch_size, seq, PlainStack.DIM, generator=g)
        return {"x": x, "y": x.mean(1).sum(-1, keepdim=True).tanh()}
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    if arch == "bert":
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 3, (batch_size,), generator=g),
        }
    return {"input_ids": ids, "labels": ids.clone()}


def batches(arch: str = "llama", seq: int = 32) -> Callable[[int], dict[str, torch.Tensor]]:
    """``make(n)``: a batch of ``n`` samples of ``arch`` (seeded by ``n``), as the batch-size finder asks for them."""

    def make(n: int) -> dict[str, torch.Tensor]:
        return make_batch(arch, batch_size=n, seq=seq, seed=n)

    return make


class PlainBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class PlainStack(nn.Module):
    """Not a Transformers model: no checkpointing API, blocks found as the largest ModuleList."""

    DIM = 32

    def __init__(self, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(self.DIM, self.DIM)
        self.layers = nn.ModuleList(PlainBlock(self.DIM) for _ in range(depth))
        self.head = nn.Linear(self.DIM, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        out = self.head(h).mean(1)
        result = {"logits": out}
        if y is not None:
            result["loss"] = nn.functional.mse_loss(out.float(), y.float())
        return result


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What 'untouched' means: same class, same forward, same modules, same weights, no record."""
    return {
        "class": type(model),
        "forward": model.__dict__.get("forward"),
        "modules": [(n, type(m)) for n, m in model.named_modules()],
        "state": copy.deepcopy({k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}),
        "ckpt": [getattr(m, "gradient_checkpointing", None) for m in model.modules()],
        "compiled": [getattr(m, "_compiled_call_impl", None) for m in model.modules()],
        "use_cache": getattr(getattr(model, "config", None), "use_cache", None),
    }


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    after = snapshot(model)
    assert after["class"] is before["class"]
    assert after["forward"] is before["forward"]
    assert after["modules"] == before["modules"]
    assert after["ckpt"] == before["ckpt"]
    assert after["compiled"] == before["compiled"]
    assert after["use_cache"] == before["use_cache"]
    assert getattr(model, "memstack", None) is None
    assert before["state"].keys() == after["state"].keys()  # tensors (quantized modules also hold packed non-tensors)
    for k, v in before["state"].items():
        if v.is_meta:  # no values to compare: the same tensor shape and dtype
            assert (v.shape, v.dtype) == (after["state"][k].shape, after["state"][k].dtype), k
        else:
            assert torch.equal(v, after["state"][k]), k
