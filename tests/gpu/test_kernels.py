"""GPU tier: every Triton kernel against its torch reference on fresh random inputs (bf16 bounds)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels import attention, override_kernels
from engine.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from engine.kernels.norm import rms_norm_ref, rms_norm_triton
from engine.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton
from engine.kernels.sampling import gumbel_sample_ref, gumbel_sample_triton

pytestmark = pytest.mark.gpu
DEV = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 1024), (300, 128), (33, 3584)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, shape, with_residual):
    x = torch.randn(shape, dtype=dtype, device=DEV)
    w = 1.0 + 0.1 * torch.randn(shape[-1], dtype=dtype, device=DEV)
    r = torch.randn(shape, dtype=dtype, device=DEV) if with_residual else None
    ref = rms_norm_ref(x, w, 1e-6, r)
    out = rms_norm_triton(x, w, 1e-6, r)
    if with_residual:
        assert torch.equal(out[1], ref[1])  # the add is exact in the input dtype
        out, ref = out[0], ref[0]
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_rms_norm_strided_heads():
    # Qwen3's per-head q norm: a [T, H, D] view into the fused qkv output.
    qkv = torch.randn(11, (16 + 2 * 8) * 128, dtype=torch.bfloat16, device=DEV)
    q = qkv[:, : 16 * 128].reshape(11, 16, 128)
    w = 1.0 + 0.1 * torch.randn(128, dtype=torch.bfloat16, device=DEV)
    assert rel_err(rms_norm_triton(q, w, 1e-6), rms_norm_ref(q, w, 1e-6)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 2 * 3072), (257, 2 * 18944), (3, 2 * 80)])
def test_silu_and_mul(dtype, shape):
    x = torch.randn(shape, dtype=dtype, device=DEV)
    assert rel_err(silu_and_mul_triton(x), silu_and_mul_ref(x)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("heads", [(16, 8, 128), (28, 4, 128), (4, 2, 16)])
def test_rotary(heads):
    num_q, num_kv, d = heads
    T = 37
    positions = torch.randint(0, 4000, (T,), device=DEV)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    qkv = torch.randn(T, (num_q + 2 * num_kv) * d, dtype=torch.bfloat16, device=DEV)
    q, k = qkv[:, : num_q * d], qkv[:, num_q * d : (num_q + num_kv) * d]  # strided views, as the model passes
    rq, rk = rotary_embedding_ref(positions, q, k, cos, sin, d)
    oq, ok = rotary_embedding_triton(positions, q, k, cos, sin, d)
    assert rel_err(oq, rq) < 1e-2 and rel_err(ok, rk) < 1e-2


def _random_batch(query_lens, seq_lens, num_kv_heads, head_size, block_size=16, num_blocks=None):
    """Random paged cache + metadata with shuffled (non-contiguous) block ids per request."""
    need = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = num_blocks or need + 5
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[i : i + n])
        i += n
    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=DEV)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEV)
    return md, kv


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([1] * 9, [1, 5, 16, 17, 64, 100, 333, 1024, 2047]),  # decode only
        ([300], [300]),  # one whole prompt
        ([77, 1, 128, 1, 5], [200, 50, 128, 1000, 5]),  # mixed: chunks over cached prefixes + decodes
        ([513, 1, 1], [1537, 12, 700]),
    ],
)
@pytest.mark.parametrize("heads", [(16, 8, 128), (28, 4, 128), (8, 8, 64), (4, 2, 16)])
@pytest.mark.parametrize("longest_first", [False, True])  # decode steps: programs by context length, longest first
def test_paged_attention(query_lens, seq_lens, heads, longest_first, monkeypatch):
    monkeypatch.setattr(attention, "LONGEST_FIRST", longest_first)
    num_heads, num_kv_heads, head_size = heads
    md, kv = _random_batch(query_lens, seq_lens, num_kv_heads, head_size)
    q = torch.randn(sum(query_lens), num_heads, head_size, dtype=torch.bfloat16, device=DEV)
    scale = head_size**-0.5
    ref = attention.paged_attention_ref(q.float(), kv.float(), md, scale)
    md.backend_plan = None
    out = attention.paged_attention(q, kv, md, scale)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("longest_first", [False, True])
def test_paged_attention_padding_rows_give_zeros(longest_first, monkeypatch):
    # A CUDA-graph bucket pads with rows of seq_len 0 and tokens past num_actual_tokens.
    monkeypatch.setattr(attention, "LONGEST_FIRST", longest_first)
    md, kv = _random_batch([1, 1], [40, 7], 8, 128)
    md.query_start_loc = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32, device=DEV)
    md.seq_lens = torch.tensor([40, 7, 0, 0], dtype=torch.int32, device=DEV)
    md.block_table = torch.cat([md.block_table, torch.zeros_like(md.block_table)])
    q = torch.randn(4, 16, 128, dtype=torch.bfloat16, device=DEV)
    out = attention.paged_attention(q, kv, md, 0.1)
    assert torch.isfinite(out).all() and torch.all(out[2:] == 0)


@pytest.mark.parametrize("query_lens,seq_lens", [([1] * 9, [1, 5, 16, 17, 64, 100, 333, 1024, 2047]),
                                                   ([77, 1, 128, 1, 5], [200, 50, 128, 1000, 5])])
@pytest.mark.parametrize("heads", [(16, 8, 128), (8, 8, 64)])
def test_paged_attention_fp8_cache(query_lens, seq_lens, heads):
    """An e4m3 cache with per-tensor scales: the kernel reads stored * scale, as the reference does."""
    num_heads, num_kv_heads, head_size = heads
    md, kv = _random_batch(query_lens, seq_lens, num_kv_heads, head_size)
    k_scale, v_scale = 0.02, 0.01  # stored values up to ~200: e4m3's range, not just its top
    fp8 = torch.stack([attention.torch_ref.to_cache_dtype(kv[0], torch.float8_e4m3fn, k_scale),
                       attention.torch_ref.to_cache_dtype(kv[1], torch.float8_e4m3fn, v_scale)])
    q = torch.randn(sum(query_lens), num_heads, head_size, dtype=torch.bfloat16, device=DEV)
    scale = head_size**-0.5
    dequant = torch.stack([fp8[0].float() * k_scale, fp8[1].float() * v_scale])
    ref = attention.paged_attention_ref(q.float(), dequant, md, scale)
    md.backend_plan = None
    out = attention.paged_attention(q, fp8, md, scale, k_scale, v_scale)
    assert rel_err(out, ref) < 2e-2
    md.backend_plan = None
    assert rel_err(attention.paged_attention_ref(q.float(), fp8, md, scale, k_scale, v_scale), ref) < 1e-5


def test_write_kv_cache_fp8_matches_the_reference_bytes():
    num_kv_heads, head_size, T, num_blocks, block_size = 8, 128, 50, 20, 16
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:T]
    slots[3] = -1  # skipped
    k = torch.randn(T, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEV) * 40
    v = torch.randn(T, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEV)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 3e-3, 0.0])  # saturating, tiny, zero
    ref = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.float8_e4m3fn, device=DEV)
    out = ref.clone()
    attention.write_kv_cache_ref(k, v, ref, slots, 0.1, 0.5)
    attention.write_kv_cache(k, v, out, slots, 0.1, 0.5)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    assert not torch.isnan(out.float()).any()


@pytest.mark.parametrize("heads", [(8, 128), (4, 16)])
def test_write_kv_cache(heads):
    num_kv_heads, head_size = heads
    T, num_blocks, block_size = 50, 20, 16
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:T]
    slots[3] = -1  # skipped
    qkv = torch.randn(T, 3 * num_kv_heads * head_size, dtype=torch.bfloat16, device=DEV)
    k = qkv[:, : num_kv_heads * head_size].view(T, num_kv_heads, head_size)
    v = qkv[:, num_kv_heads * head_size : 2 * num_kv_heads * head_size].view(T, num_kv_heads, head_size)
    init = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEV)
    ref, out = init.clone(), init.clone()
    attention.write_kv_cache_ref(k, v, ref, slots)
    attention.write_kv_cache(k, v, out, slots)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("num_rows,vocab", [(1, 151936), (64, 32000), (7, 1000)])
def test_gumbel_sample(num_rows, vocab):
    logits = 3 * torch.randn(num_rows, vocab, device=DEV)
    keys = torch.randint(0, 2**62, (num_rows,), device=DEV)
    keys[0] = -1  # a greedy row
    ref = gumbel_sample_ref(logits, keys)
    out = gumbel_sample_triton(logits, keys)
    assert int(out[0]) == int(logits[0].argmax())
    # The noise is computed identically; log() may differ in the last ulp, so allow rare flips.
    assert (out == ref).float().mean() >= 0.95


def test_gumbel_sample_is_batch_independent_and_distributed():
    vocab = 50
    logits = torch.randn(1, vocab, device=DEV)
    keys = torch.arange(20000, device=DEV) * 7919 + 12345
    draws = gumbel_sample_triton(logits.expand(len(keys), vocab).contiguous(), keys)
    # The same key alone gives the same token as inside the big batch.
    assert int(gumbel_sample_triton(logits, keys[5:6])) == int(draws[5])
    freq = torch.bincount(draws, minlength=vocab).float() / len(keys)
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.02


def test_override_kernels_uses_reference():
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEV)
    from engine.kernels.norm import rms_norm

    with override_kernels(False):
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


# ---- sampling: the Sampler's GPU path (Triton Gumbel-max, topk-based top-k/top-p) against CPU ----


def test_gumbel_kernel_golden_tokens():
    """The kernel gives the tokens pinned for the CPU reference (tests/sample/test_sample_gumbel.py)."""
    from engine.sample.random_sampling import mix_seed

    keys = torch.tensor([mix_seed(42, p) for p in range(6)], device=DEV)
    out = gumbel_sample_triton(torch.zeros(6, 1000, device=DEV), keys)
    assert out.tolist() == [367, 470, 404, 591, 967, 589]


@pytest.mark.parametrize("num_rows,vocab", [(256, 151936), (64, 32000)])
def test_gumbel_kernel_matches_fast_cpu_reference(num_rows, vocab):
    gen = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[: num_rows // 2, vocab // 4 :] = float("-inf")  # masked tails
    keys = torch.randint(0, 2**63 - 1, (num_rows,), generator=gen)
    keys[1] = -1
    cpu = gumbel_sample_ref(logits, keys)
    gpu = gumbel_sample_triton(logits.to(DEV), keys.to(DEV)).cpu()
    # Same noise bits; log() may differ in the last ulp, which flips only near-exact ties.
    assert (gpu == cpu).float().mean() >= 0.99
    assert int(gpu[1]) == int(logits[1].argmax())


def _sampler_case(num_rows: int, vocab: int, device: str):
    from engine.sample import SamplingMetadata, make_generator

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    temperature = torch.rand(num_rows, generator=gen) + 0.3
    temperature[::7] = 0.0  # greedy rows
    top_k = torch.where(torch.arange(num_rows) % 3 == 1, 50, 0)
    top_p = torch.where(torch.arange(num_rows) % 4 == 2, 0.9, 1.0)
    md = SamplingMetadata(
        temperature=temperature.to(device),
        all_greedy=False,
        all_random=False,
        top_k=top_k.to(device),
        top_p=top_p.to(device),
        min_p=None,
        generators={i: make_generator(1000 + i, 9, device) for i in range(num_rows) if temperature[i] > 0},
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        prompt_token_ids=None,
        output_token_ids=[],
    )
    return logits.to(device), md


def test_sampler_seeded_rows_same_on_gpu_and_cpu_and_alone():
    from engine.sample import Sampler

    num_rows, vocab = 256, 151936
    logits_gpu, md_gpu = _sampler_case(num_rows, vocab, DEV)
    logits_cpu, md_cpu = _sampler_case(num_rows, vocab, "cpu")
    cuda_gen = torch.Generator(device=DEV).manual_seed(0)  # what the model runner passes
    gpu = Sampler(cuda_gen)(logits_gpu, md_gpu).sampled_token_ids.cpu()
    cpu = Sampler()(logits_cpu, md_cpu).sampled_token_ids
    assert (gpu == cpu).float().mean() >= 0.99
    # A seeded row alone on the GPU gives its in-batch token.
    for row in (3, 100, 255):
        _, md_one = _sampler_case(num_rows, vocab, DEV)
        md_one.temperature = md_one.temperature[row : row + 1]
        md_one.top_k, md_one.top_p = md_one.top_k[row : row + 1], md_one.top_p[row : row + 1]
        md_one.generators = {0: md_gpu.generators[row]} if row in md_gpu.generators else {}
        md_one.all_random = bool(md_one.temperature[0] > 0)
        md_one.all_greedy = not md_one.all_random
        alone = Sampler(cuda_gen)(logits_gpu[row : row + 1], md_one).sampled_token_ids
        assert int(alone) == int(gpu[row])


@pytest.mark.parametrize("vocab", [151936, 5000])
def test_top_k_top_p_gpu_matches_sort_reference(vocab):
    from engine.sample.topk_topp import apply_top_k_top_p, apply_top_k_top_p_sort

    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab, generator=gen) * 2).to(DEV)
    top_k = torch.tensor([0, 1, 20, 50, vocab - 1, vocab, 0, 7] * 8, device=DEV)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.8, 1.0, 0.3] * 8, device=DEV)
    for k, p in [(top_k, top_p), (top_k, None), (None, top_p)]:
        new = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))
        ref = torch.isfinite(apply_top_k_top_p_sort(logits.clone(), k, p))
        # Rounding of the cumulative mass may move a boundary token in a rare row.
        assert (new != ref).any(dim=-1).float().mean() <= 0.05
        assert (new != ref).sum() <= 64
