"""Engine models against HF transformers on tiny random checkpoints: one prefill and a mixed chunked/decode/fresh batch."""

from __future__ import annotations

import pytest
import torch

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.forward_context import set_forward_context
from engine.models.loader import load_hf_config, load_model
from engine.tiny_models import BUILTIN_TINY_MODELS, make_tiny_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 32
ATOL = 1e-4

VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": BUILTIN_TINY_MODELS["tiny-llama3-rope"],
    # The transformers v4 spelling, converted by the config class into rope_parameters.
    "llama3-rope-scaling-kwarg": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", {}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-dense-layer": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": False}),
}


@pytest.fixture(params=sorted(VARIANTS), scope="module")
def checkpoint(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)


def load_engine_model(path: str, dtype: torch.dtype = torch.float32):
    model = load_model(path, load_hf_config(path), dtype, "cpu")
    for module in model.modules():
        if isinstance(module, Attention):
            module.kv_cache = torch.zeros(
                2, NUM_BLOCKS, BLOCK_SIZE, module.num_kv_heads, module.head_size, dtype=dtype
            )
    return model


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    return hf_model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def engine_step(model, rows: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
    """Runs one forward; each row is (all tokens so far, num_computed, block ids); returns logits per row."""
    input_ids, positions, query_lens, seq_lens, block_table = [], [], [], [], []
    for tokens, num_computed, blocks in rows:
        input_ids += tokens[num_computed:]
        positions += range(num_computed, len(tokens))
        query_lens.append(len(tokens) - num_computed)
        seq_lens.append(len(tokens))
        block_table.append(blocks)
    metadata = AttentionMetadata.build(query_lens, seq_lens, block_table, BLOCK_SIZE)
    with set_forward_context(metadata):
        hidden = model(torch.tensor(input_ids), torch.tensor(positions))  # [T, hidden]
    logits = model.compute_logits(hidden)  # [T, vocab]
    assert logits.dtype == torch.float32
    return list(logits.split(query_lens))


def random_tokens(generator: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=generator).tolist()


def test_single_prefill(checkpoint):
    model, hf_model = load_engine_model(checkpoint), load_hf_model(checkpoint)
    vocab = hf_model.config.vocab_size
    prompt = random_tokens(torch.Generator().manual_seed(1), 13, vocab)
    (logits,) = engine_step(model, [(prompt, 0, [5, 2, 9, 0])])
    expected = hf_logits(hf_model, prompt)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_mixed_batch_chunked_decode_fresh(checkpoint):
    model, hf_model = load_engine_model(checkpoint), load_hf_model(checkpoint)
    vocab = hf_model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    prompt_a = random_tokens(gen, 11, vocab)  # prefilled in two chunks: 6 then 5
    context_b = random_tokens(gen, 9, vocab)  # prefilled, then one decode
    context_d = random_tokens(gen, 3, vocab)  # a second, shorter decode row
    prompt_c = random_tokens(gen, 7, vocab)  # fresh in step 2
    # Non-contiguous, shuffled physical blocks per request.
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    blocks_a, blocks_b, blocks_c, blocks_d = perm[0:3], perm[3:6], perm[6:8], perm[8:9]

    step1 = engine_step(model, [(prompt_a[:6], 0, blocks_a), (context_b, 0, blocks_b), (context_d, 0, blocks_d)])
    torch.testing.assert_close(step1[0], hf_logits(hf_model, prompt_a[:6]), atol=ATOL, rtol=0)
    torch.testing.assert_close(step1[1], hf_logits(hf_model, context_b), atol=ATOL, rtol=0)

    seq_b = context_b + [int(step1[1][-1].argmax())]
    seq_d = context_d + [7]
    logits_a, logits_b, logits_c, logits_d = engine_step(
        model,
        [(prompt_a, 6, blocks_a), (seq_b, len(context_b), blocks_b), (prompt_c, 0, blocks_c), (seq_d, 3, blocks_d)],
    )
    torch.testing.assert_close(logits_a, hf_logits(hf_model, prompt_a)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_b, hf_logits(hf_model, seq_b)[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_c, hf_logits(hf_model, prompt_c), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits_d, hf_logits(hf_model, seq_d)[-1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_runs(tmp_path, dtype):
    path = make_tiny_checkpoint(tmp_path, "qwen3", dtype="bfloat16")
    model = load_engine_model(path, dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    prompt = list(range(20, 40))
    (logits,) = engine_step(model, [(prompt, 0, [3, 1, 4, 7, 5])])
    reference = hf_logits(load_hf_model(path), prompt)
    assert torch.isfinite(logits).all()
    assert (logits - reference).abs().mean() < 0.1


def test_load_reports_missing_and_mismatched(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path, "llama")
    state = load_file(f"{path}/model.safetensors")
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"][:-1]
    save_file(state, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(path, load_hf_config(path), torch.float32, "cpu")

    del state["model.layers.0.self_attn.k_proj.weight"]
    del state["model.norm.weight"]
    save_file(state, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight.*model\.norm\.weight"):
        load_model(path, load_hf_config(path), torch.float32, "cpu")
