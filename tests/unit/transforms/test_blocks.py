import pytest
from tiny import PlainStack
from torch import nn

from hf_memstack.transforms.blocks import find_blocks


@pytest.mark.parametrize(
    "arch, count, cls",
    [("llama", 2, "LlamaDecoderLayer"), ("gpt2", 2, "GPT2Block"), ("bert", 2, "BertLayer"), ("t5", 4, "T5Block")],
)
def test_transformers_blocks_from_no_split_modules(load_model, arch, count, cls):
    blocks = find_blocks(load_model(arch))
    assert blocks.source == "_no_split_modules"
    assert len(blocks) == count and blocks.class_names == (cls,)
    # BERT also lists BertEmbeddings in _no_split_modules; it is not a repeated block.
    assert all(type(m).__name__ == cls for m in blocks.modules)


def test_plain_module_uses_largest_module_list():
    model = PlainStack(depth=4)
    blocks = find_blocks(model)
    assert blocks.source == "largest ModuleList"
    assert blocks.names == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert all(b is model.layers[i] for i, b in enumerate(blocks.modules))


def test_override_takes_outermost_match(load_model):
    model = load_model("llama")
    blocks = find_blocks(model, ["LlamaMLP"])
    assert blocks.source == "override" and len(blocks) == 2
    assert blocks.names == ("model.layers.0.mlp", "model.layers.1.mlp")


def test_sequential_of_leaves_is_not_blocks():
    with pytest.raises(ValueError, match=r"cannot find repeated blocks in Sequential.*block_classes"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
