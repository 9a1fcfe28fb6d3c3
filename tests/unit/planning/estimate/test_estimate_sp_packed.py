"""estimate_memory of packed rows under sequence parallelism (sp:N, ``packed=True``): one rank traced with
its rows' samples run as Ulysses runs them after the all-to-all (each sample its own SDPA call, a sample
across the shard boundary), under compile as whole rows with one boolean mask, a sliding window per
sample; a row N does not divide traced with its padded tail as a sample. The readings against the meter
on each of 2 ranks: tests/distributed/test_sp_estimate_packed.py."""

from transformers import LlamaConfig, MistralConfig

from hf_memstack import estimate_memory

B = 2
MODEL_STATES = ("parameters", "gradients", "optimizer", "trainable_parameters", "total_parameters")


def _config(**extra):
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=1024,
        **extra,
    )


def _sp(cfg, policy="fp32+sp:2", seq=256, **kwargs):
    return estimate_memory(cfg, policy, batch_size=B, seq_len=seq, device="cpu", **kwargs)


def _traced_row(note):
    """The samples a note says each row was traced as: '... packed rows traced as 254+1+1 token samples'."""
    return [int(n) for n in note.split("packed rows traced as ", 1)[1].split(" token samples", 1)[0].split("+")]


def test_packed_rows_under_sp_are_traced_per_sample_across_the_shard_boundary():
    cfg = _config()
    packed = _sp(cfg, packed=True)  # refused before ("not estimated yet")
    unpacked = _sp(cfg)
    whole = estimate_memory(cfg, "fp32", batch_size=B, seq_len=256, packed=True, device="cpu")
    assert (packed.sequence_parallel, packed.sp_tokens_per_rank, packed.seq_len) == (2, 128, 256)
    for k in MODEL_STATES:
        assert getattr(packed, k) == getattr(unpacked, k), k
    # The samples' attention after the exchange: at least an unpacked row's bytes, less than one device's
    # packed rows.
    assert unpacked.forward_backward_peak <= packed.forward_backward_peak < whole.forward_backward_peak
    assert packed.sp_all_to_all_bytes == unpacked.sp_all_to_all_bytes
    note = next(n for n in packed.notes if n.startswith("sp:2: one rank of 2"))
    row = _traced_row(note)
    ends = [sum(row[: i + 1]) for i in range(len(row))]
    assert sum(row) == 256 and len(row) >= 2 and any(a < 128 < b for a, b in zip([0, *ends], ends)), note
    assert "packed rows traced as" not in next(n for n in unpacked.notes if n.startswith("sp:2: one rank of 2"))


def test_checkpointed_blocks_keep_what_unpacked_rows_keep():
    # Every block checkpointed keeps its input only: the samples' attention is transient, in the recompute.
    cfg = _config()
    ckpt = _sp(cfg, "fp32+ckpt+loss:chunked+sp:2", packed=True)
    plain = _sp(cfg, "fp32+ckpt+loss:chunked+sp:2")
    assert ckpt.activations == plain.activations  # checkpointed: the blocks keep their inputs only, as unpacked
    assert ckpt.peak_bytes >= plain.peak_bytes


def test_packed_rows_under_compile_run_whole_with_one_mask():
    est = _sp(_config(), "fp32+compile+sp:2", packed=True)
    assert any("packed rows run whole under compile" in n for n in est.notes), est.notes


def test_a_sliding_window_model_packed_under_sp_is_estimated():
    cfg = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        sliding_window=32,
        head_dim=16,
    )
    packed = _sp(cfg, packed=True)
    assert packed.sequence_parallel == 2 and packed.peak_bytes > 0


def test_a_row_n_does_not_divide_is_traced_with_its_padded_tail_as_a_sample():
    est = _sp(_config(), seq=255)
    note = next(n for n in est.notes if n.startswith("sp:2: one rank of 2"))
    assert "the padded tail a sample of its own (255+1 tokens)" in note, note
