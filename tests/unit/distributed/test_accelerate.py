"""accelerate_fsdp_plugin: Accelerate's FSDP2 plugin built from a policy. Accelerate 1.15 shards
only on GPUs, so here the plugin is checked field by field and through Accelerate's own auto-wrap
function (the one its ``prepare`` calls), which must pick exactly the blocks prepare_model found."""

import pytest
import torch


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "t5", "plain"])
def test_accelerate_wraps_exactly_our_blocks(load_model, arch):
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from hf_memstack.distributed import accelerate_fsdp_plugin
    from hf_memstack.policy import MemoryPolicy
    from hf_memstack.transforms.blocks import find_blocks
    from hf_memstack.transforms.checkpointing.apply import apply_checkpointing

    policy = MemoryPolicy.from_string("bf16+ckpt+fsdp")
    model = load_model(arch)
    blocks = find_blocks(model)
    plugin = accelerate_fsdp_plugin(policy, model)
    # Checkpointing goes on first (prepare_model's order); for the plain stack that is
    # torch.utils.checkpoint installed on each block, which keeps the blocks where they were.
    apply_checkpointing(model, policy.checkpointing, blocks=blocks)
    wrap = fsdp2_prepare_auto_wrap_policy(plugin, model)
    chosen = {name for name, m in model.named_modules() if wrap(m)}
    assert chosen == set(blocks.names)


@pytest.mark.parametrize(
    "policy, param_dtype, reshard, offload",
    [
        ("bf16+fsdp", torch.bfloat16, True, False),
        ("fp32+fsdp:shard_grad_op", None, False, False),
        ("bf16+ckpt+fsdp:offload", torch.bfloat16, True, True),
    ],
)
def test_plugin_fields_follow_the_policy(load_model, policy, param_dtype, reshard, offload):
    from torch.distributed.fsdp import CPUOffloadPolicy

    from hf_memstack.distributed import accelerate_fsdp_plugin

    plugin = accelerate_fsdp_plugin(policy, load_model("llama"))
    assert plugin.fsdp_version == 2
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.mixed_precision_policy.param_dtype == param_dtype
    # fp32 gradient reduction: Accelerate's own default would reduce in the compute dtype.
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32
    assert plugin.reshard_after_forward is reshard
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is offload
    assert plugin.activation_checkpointing is False  # prepare_model checkpoints, through Transformers
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"


@pytest.mark.parametrize(
    "policy, fragment", [("bf16+ckpt", "policy.fsdp.mode='none'"), ("bf16+fsdp:hybrid_shard", "launch with torchrun")]
)
def test_plugin_refuses_what_it_cannot_build(load_model, policy, fragment):
    from hf_memstack.distributed import accelerate_fsdp_plugin

    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("+", r"\+")):
        accelerate_fsdp_plugin(policy, load_model("llama"))
