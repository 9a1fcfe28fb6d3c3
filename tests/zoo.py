"""A zoo of tiny models of real architectures (decoder LMs, MoE, vision-language, encoders,
encoder-decoders), built from configs with no download, and a batch for each: what the "any model"
matrix test runs every main policy over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VOCAB = 256
SEQ = 32
_DENSE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# Vision towers: 2 blocks 32 wide; a 28-pixel image is 2 x 2 patches of 14 (4 image tokens).
IMAGE_TOKEN = 250
IMAGE_TOKENS = 4
_VIT: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 28,
    "patch_size": 14,
}
_TEXT_MROPE: dict[str, Any] = {**_DENSE, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
_QWEN_VISION_COMMON: dict[str, Any] = {
    "depth": 2,
    "num_heads": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}
_QWEN2_VISION: dict[str, Any] = {**_QWEN_VISION_COMMON, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}
_QWEN25_VISION: dict[str, Any] = {
    **_QWEN_VISION_COMMON,
    "hidden_size": 32,
    "out_hidden_size": 64,
    "intermediate_size": 64,
    "fullatt_block_indexes": [1],
    "window_size": 56,
}
_QWEN_TOKENS: dict[str, Any] = {"image_token_id": IMAGE_TOKEN, "video_token_id": 251, "vision_start_token_id": 252}


@dataclass(frozen=True)
class Arch:
    """One architecture: its config type and fields, the Auto class that builds it, its kind."""

    name: str
    model_type: str
    fields: dict[str, Any]
    auto: str = "AutoModelForCausalLM"
    kind: str = "decoder"  # decoder, moe, vlm, encoder, encoder-decoder
    extra: dict[str, Any] = field(default_factory=dict)


def _dense(**over: Any) -> dict[str, Any]:
    return {**_DENSE, **over}


ZOO: tuple[Arch, ...] = (
    Arch("llama", "llama", _dense()),
    Arch("mistral", "mistral", _dense()),
    Arch("qwen2", "qwen2", _dense()),
    Arch("qwen3", "qwen3", _dense(head_dim=16)),
    Arch("gemma", "gemma", _dense(head_dim=16)),
    Arch("gemma2", "gemma2", _dense(head_dim=16, sliding_window=16)),
    Arch("phi", "phi", _dense(resid_pdrop=0.0, embd_pdrop=0.0)),
    Arch("phi3", "phi3", _dense()),
    Arch("stablelm", "stablelm", _dense()),
    Arch("granite", "granite", _dense()),
    Arch("starcoder2", "starcoder2", _dense(residual_dropout=0.0, embedding_dropout=0.0)),
    Arch("olmo2", "olmo2", _dense()),
    Arch("gpt_neox", "gpt_neox", _dense(hidden_dropout=0.0, attention_dropout=0.0)),
    Arch(
        "falcon",
        "falcon",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": VOCAB,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    Arch(
        "bloom",
        "bloom",
        {"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2},
    ),
    Arch(
        "opt",
        "opt",
        {
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 64,
            "vocab_size": VOCAB,
            "max_position_embeddings": 128,
            "dropout": 0.0,
            "pad_token_id": 0,
        },
    ),
    Arch(
        "gpt2",
        "gpt2",
        {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": VOCAB,
            "n_positions": 128,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    Arch("mixtral", "mixtral", _dense(num_local_experts=4, num_experts_per_tok=2), kind="moe"),
    Arch(
        "qwen2_moe",
        "qwen2_moe",
        _dense(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64),
        kind="moe",
    ),
    Arch("olmoe", "olmoe", _dense(num_experts=4, num_experts_per_tok=2), kind="moe"),
    Arch(
        "qwen2_vl",
        "qwen2_vl",
        {"text_config": _TEXT_MROPE, "vision_config": _QWEN2_VISION, **_QWEN_TOKENS},
        auto="AutoModelForImageTextToText",
        kind="vlm",
    ),
    Arch(
        "qwen2_5_vl",
        "qwen2_5_vl",
        {"text_config": _TEXT_MROPE, "vision_config": _QWEN25_VISION, **_QWEN_TOKENS},
        auto="AutoModelForImageTextToText",
        kind="vlm",
    ),
    Arch(
        "llava",
        "llava",
        {
            "text_config": {"model_type": "llama", **_DENSE},
            "vision_config": {"model_type": "clip_vision_model", **_VIT, "projection_dim": 32},
            "image_token_id": IMAGE_TOKEN,
            "vision_feature_layer": -1,
        },
        auto="AutoModelForImageTextToText",
        kind="vlm",
    ),
    Arch(
        "gemma3",
        "gemma3",
        {
            "text_config": {"model_type": "gemma3_text", **_DENSE, "head_dim": 16, "sliding_window": 16},
            "vision_config": {"model_type": "siglip_vision_model", **_VIT},
            "mm_tokens_per_image": 4,
            "image_token_index": IMAGE_TOKEN,
            "boi_token_index": 251,
            "eoi_token_index": 252,
        },
        auto="AutoModelForImageTextToText",
        kind="vlm",
    ),
    Arch(
        "bert",
        "bert",
        _dense(num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        auto="AutoModelForSequenceClassification",
        kind="encoder",
    ),
    Arch(
        "roberta",
        "roberta",
        _dense(num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=160),
        auto="AutoModelForSequenceClassification",
        kind="encoder",
    ),
    Arch(
        "t5",
        "t5",
        {
            "d_model": 64,
            "d_ff": 128,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 4,
            "d_kv": 16,
            "vocab_size": VOCAB,
            "dropout_rate": 0.0,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
            "eos_token_id": 1,
        },
        auto="AutoModelForSeq2SeqLM",
        kind="encoder-decoder",
    ),
    Arch(
        "bart",
        "bart",
        {
            "d_model": 64,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 4,
            "decoder_attention_heads": 4,
            "vocab_size": VOCAB,
            "max_position_embeddings": 128,
            "dropout": 0.0,
            "pad_token_id": 0,
            "decoder_start_token_id": 2,
        },
        auto="AutoModelForSeq2SeqLM",
        kind="encoder-decoder",
    ),
)


def build(arch: Arch, folder: Any = None, seed: int = 0) -> nn.Module:
    """``arch`` drawn fresh after ``manual_seed(seed)`` (fp32), or loaded from ``folder`` the default
    way (``dtype="auto"``: the saved dtype), in train mode."""
    import transformers

    auto = getattr(transformers, arch.auto)
    if folder is not None:
        return auto.from_pretrained(folder).train()
    config = transformers.AutoConfig.for_model(arch.model_type, **arch.fields)
    torch.manual_seed(seed)
    return auto.from_config(config).train()


def make_batch(arch: Arch, batch_size: int = 2, seq: int = SEQ, seed: int = 0) -> dict[str, torch.Tensor]:
    """A training batch for ``arch``: token ids with labels (class labels for an encoder)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE_TOKEN, (batch_size, seq), generator=g)  # no special id by chance
    if arch.kind == "vlm":
        return _vlm_batch(arch, ids, g)
    if arch.kind == "encoder":
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 3, (batch_size,), generator=g),
        }
    return {"input_ids": ids, "labels": ids.clone()}


def _lora_config(arch: Arch) -> Any:
    from peft import LoraConfig

    task = {"encoder": "SEQ_CLS", "encoder-decoder": "SEQ_2_SEQ_LM"}.get(arch.kind, "CAUSAL_LM")
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type=task)


def peft_lora(model: nn.Module, arch: Arch) -> nn.Module:
    """``get_peft_model`` with LoRA r=8 on every linear layer but the head (PEFT's ``all-linear``)."""
    from peft import get_peft_model

    return get_peft_model(model, _lora_config(arch))


peft_lora.config = _lora_config  # type: ignore[attr-defined]


def _vlm_batch(arch: Arch, ids: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One 28 x 28 image per sample, its IMAGE_TOKENS placeholders after the first token, as the
    family's processor lays them out (Qwen: patch-major pixels with ``image_grid_thw``)."""
    n = ids.shape[0]
    ids = ids.clone()
    ids[:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    batch = {"input_ids": ids, "labels": labels}
    if arch.model_type.startswith("qwen"):
        grid = torch.tensor([[1, 4, 4]] * n)  # 4 x 4 patches, merged 2 x 2 into 4 tokens
        batch["pixel_values"] = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g)
        batch["image_grid_thw"] = grid
        batch["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    else:
        batch["pixel_values"] = torch.randn(n, 3, 28, 28, generator=g)
        if arch.model_type == "gemma3":
            batch["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    return batch
