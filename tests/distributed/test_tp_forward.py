"""Tensor parallelism of size 2 (two gloo ranks) against one rank: same logits, same greedy tokens, for every architecture."""

from __future__ import annotations

import pytest
import torch
from tp_group import greedy, load_engine_model

from engine.models.loader import load_hf_config

ATOL = 1e-4
MAX_TOKENS = 6
# Ids near both ends of the vocab, so both ranks' halves of the embedding are looked up.
PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 501, 79], [508, 3, 260, 4]]

VARIANTS = {
    # 4 query heads, 2 KV heads: both split across the 2 ranks; separate lm_head.
    "llama": ("llama", {}),
    # One KV head, replicated on both ranks; biases in every linear (row-parallel ones added once);
    # a vocab of 509 (odd): padded to 510, the second rank holds one padding row.
    "llama-kv1-bias-odd-vocab": ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True,
                                           "vocab_size": 509}),
    # Tied embeddings (one parameter split by vocab, used by the embedding and the LM head), q/k/v bias.
    "qwen2-tied-odd-vocab": ("qwen2", {"vocab_size": 509}),
    # Per-head q/k norms, head_dim 32, tied.
    "qwen3": ("qwen3", {}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_matches_tp1(tp_group, tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    ref_logits, ref_tokens = greedy(load_engine_model(path), PROMPTS, MAX_TOKENS)

    ranks = tp_group.run("rank_greedy", path, PROMPTS, MAX_TOKENS)
    config = load_hf_config(path)
    for rank in ranks:
        assert rank["num_heads"] == config.num_attention_heads // 2  # each rank runs half of the query heads
        assert rank["num_kv_heads"] == max(1, config.num_key_value_heads // 2)  # and only the KV heads they read
        assert rank["generated"] == ref_tokens
        assert len(rank["logits"]) == len(ref_logits)
        for got, expected in zip(rank["logits"], ref_logits):
            assert got.dtype == torch.float32 and got.shape == expected.shape  # full vocab, padding dropped
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # Every rank holds the very same logits, so every rank samples the same tokens.
    for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]):
        assert torch.equal(a, b)


def test_head_counts_that_do_not_split_are_refused(tp_group):
    # (hidden, head_size, num_heads, num_kv_heads)
    messages = tp_group.run("rank_construct_errors", [(64, 16, 3, 1), (96, 16, 6, 3), (64, 16, 4, 1), (64, 16, 4, 2)])
    for rank_messages in messages:
        assert "num_attention_heads (3) is not divisible by tensor_parallel_size (2)" in rank_messages[0]
        assert "num_key_value_heads (3) is not divisible by tensor_parallel_size (2)" in rank_messages[1]
        assert rank_messages[2:] == ["", ""]  # one KV head is replicated; two are split


def test_dummy_weights_are_the_one_rank_model_split(tp_group, tiny_checkpoint):
    """load_format="dummy": both ranks draw the full tensors from the same seed, so replicated weights agree
    and the split model computes the one-rank dummy model's logits."""
    from tp_group import load_dummy_model

    arch, overrides = VARIANTS["llama-kv1-bias-odd-vocab"]
    path = tiny_checkpoint(arch, **overrides)
    expected = greedy(load_dummy_model(path, seed=7), PROMPTS, 1)[0]
    for logits in tp_group.run("rank_dummy_logits", path, PROMPTS, 7):
        for got, want in zip(logits, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
