import pytest
from dist_utils import run_ranks

pytestmark = pytest.mark.distributed


def _find(rank, world, budgets):
    import torch
    from tiny import make_batch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_memstack import find_batch_size, prepare_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128, bos_token_id=1, eos_token_id=2))
    prepare_model(model, "bf16")
    opt = torch.optim.AdamW(model.parameters())
    result = find_batch_size(model, lambda n: make_batch("llama", batch_size=n, seq=32, seed=n), opt,
                             budget=budgets[rank], global_batch_size=64, cache=False)
    return result.batch_size, result.world_size, result.grad_accum, [(p.batch_size, p.fits) for p in result.probes]


def _alone(budget):
    return run_ranks(_find, [budget], world=1)[0][0]


def test_two_ranks_agree_on_the_smaller_budget():
    small, large = 12 * 2**20, 24 * 2**20
    results = run_ranks(_find, [large, small], world=2)
    (bs0, world0, acc0, probes0), (bs1, world1, acc1, probes1) = results
    assert bs0 == bs1 and world0 == world1 == 2
    assert probes0 == probes1  # the same probes, in the same order, with agreed outcomes
    assert bs0 == _alone(small) < _alone(large)  # the rank with less memory decides
    assert acc0 == acc1 == -(-64 // (bs0 * 2))
