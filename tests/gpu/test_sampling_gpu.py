"""GPU tier: the chunked Gumbel-max kernel against the one-program-per-row scan and the torch reference, and the Sampler's fast path."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
DEV = "cuda"

triton = pytest.importorskip("triton")
tl = triton.language

from engine.kernels.sampling import (  # needs triton: the kernels exist only when it imports
    _BLOCK,
    _gumbel_partial_kernel,
    gumbel_sample_ref,
    gumbel_sample_triton,
)


# The kernel as it was before chunking (one program scans a whole row, int64 hash): the
# chunked kernel must give exactly its tokens.
@triton.jit
def _fmix32_i64(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit
def _row_scan_kernel(out_ptr, logits_ptr, keys_ptr, stride_row, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row)
    greedy = key < 0
    key = tl.maximum(key, 0)
    k0 = key & 0xFFFFFFFF
    k1 = (key >> 32) & 0xFFFFFFFF
    best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int64)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
        v64 = v.to(tl.int64)
        h = ((v64 * 0x9E3779B1) & 0xFFFFFFFF) ^ k0
        h = _fmix32_i64(_fmix32_i64(h) ^ k1)
        u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
        noise = -tl.log(-tl.log(u))
        val = tl.where(greedy, x, x + noise)
        better = val > best_val
        best_val = tl.where(better, val, best_val)
        best_idx = tl.where(better, v64, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
    tl.store(out_ptr + row, idx)


def row_scan(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _row_scan_kernel[(logits.shape[0],)](out, logits, keys, logits.stride(0), logits.shape[1], BLOCK=1024, num_warps=4)
    return out


def make_case(num_rows: int, vocab: int, seed: int, dtype=torch.float32):
    """Random logits with masked tails, ties and an all -inf row; random keys with greedy rows; temperatures."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[: num_rows // 2, vocab // 4 :] = float("-inf")  # top-k style masked tails
    logits[1:3] = logits[1:3].round()  # many exact ties (row 1 is greedy)
    if num_rows > 3:
        logits[3] = float("-inf")  # nothing finite: the scan answers 0
    keys = torch.randint(0, 2**63 - 1, (num_rows,), generator=gen)
    keys[1 % num_rows] = -1  # greedy
    temperature = torch.rand(num_rows, generator=gen) + 0.2
    return logits.to(dtype).to(DEV), keys.to(DEV), temperature.to(DEV)


@pytest.mark.parametrize(
    "num_rows,vocab", [(1, 151936), (5, 151936), (64, 32000), (7, 1000), (9, 1025), (4, 1), (3, 3001)]
)
def test_chunked_kernel_equals_row_scan_for_every_chunking(num_rows, vocab):
    logits, keys, _ = make_case(num_rows, vocab, seed=vocab + num_rows)
    expected = row_scan(logits, keys)
    num_tiles = -(-vocab // _BLOCK)
    for tiles in sorted({1, 2, 3, 4, 16, num_tiles, num_tiles + 5}):
        out = gumbel_sample_triton(logits, keys, tiles_per_chunk=tiles)
        assert torch.equal(out, expected), f"tiles_per_chunk={tiles}"
    assert torch.equal(gumbel_sample_triton(logits, keys), expected)  # the heuristic's choice


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_rows,vocab", [(256, 151936), (16, 151936), (33, 5003)])
def test_temperature_in_kernel_equals_scaling_first(dtype, num_rows, vocab):
    """Reading model-dtype logits and dividing in registers = the old float32 copy, division, then scan."""
    logits, keys, temperature = make_case(num_rows, vocab, seed=num_rows, dtype=dtype)
    greedy = keys < 0
    scaled = logits.float() / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    expected = row_scan(scaled, keys)
    for tiles in (1, 4, 16):
        assert torch.equal(gumbel_sample_triton(logits, keys, temperature, tiles_per_chunk=tiles), expected)
    # Greedy rows ignore their temperature (0.0 marks them in SamplingMetadata).
    zero_t = temperature.masked_fill(greedy, 0.0)
    assert torch.equal(gumbel_sample_triton(logits, keys, zero_t), expected)
    assert torch.equal(expected[greedy], logits[greedy].float().argmax(dim=-1))


def test_strided_rows():
    """Rows with a stride past V (the TP head's view without padding columns)."""
    logits, keys, temperature = make_case(8, 3000, seed=3, dtype=torch.bfloat16)
    wide = torch.full((8, 3072), 100.0, dtype=torch.bfloat16, device=DEV)  # padding would win if read
    wide[:, :3000] = logits
    view = wide[:, :3000]
    assert torch.equal(gumbel_sample_triton(view, keys, temperature), gumbel_sample_triton(logits, keys, temperature))


@pytest.mark.parametrize("num_rows,vocab", [(256, 151936), (7, 1025)])
def test_kernel_matches_cpu_reference(num_rows, vocab):
    logits, keys, temperature = make_case(num_rows, vocab, seed=11, dtype=torch.bfloat16)
    gpu = gumbel_sample_triton(logits, keys, temperature).cpu()
    cpu = gumbel_sample_ref(logits.cpu(), keys.cpu(), temperature.cpu())
    # Same noise bits; log() may differ in the last ulp, which flips only near-exact ties.
    assert (gpu == cpu).float().mean() >= 0.99
    greedy = (keys < 0).cpu()
    assert torch.equal(gpu[greedy], cpu[greedy])


def test_row_counts_do_not_recompile():
    vocab = 151936
    logits = torch.randn(300, vocab, dtype=torch.bfloat16, device=DEV)
    keys = torch.randint(0, 2**62, (300,), device=DEV)
    temperature = torch.full((300,), 0.6, device=DEV)
    caches = getattr(_gumbel_partial_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its kernel cache elsewhere")
    kernel_cache = caches[torch.cuda.current_device()][0]
    num_before = len(kernel_cache)
    for num_rows in (1, 16, 64, 256):
        gumbel_sample_triton(logits[:num_rows], keys[:num_rows], temperature[:num_rows])
    num_after = len(kernel_cache)
    # At most one compiled variant per chunk length (1, 4, 16 tiles) ...
    assert num_after - num_before <= 3, list(kernel_cache)
    # ... and other row counts reuse them.
    for num_rows in (2, 3, 13, 17, 33, 100, 230, 255, 257, 300):
        gumbel_sample_triton(logits[:num_rows], keys[:num_rows], temperature[:num_rows])
    assert len(kernel_cache) == num_after, list(kernel_cache)


def test_sampler_fast_path_equals_general_path():
    """Plain temperature sampling on bf16 logits: the one-pass path gives the float32 path's tokens."""
    from engine.sample import Sampler, SamplingMetadata, make_generator

    num_rows, vocab = 64, 151936
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    temperature = (torch.rand(num_rows, generator=gen) + 0.3).to(DEV)
    temperature[::5] = 0.0  # greedy rows

    def md(top_p):
        return SamplingMetadata(
            temperature=temperature,
            all_greedy=False,
            all_random=False,
            top_k=None,
            top_p=top_p,
            min_p=None,
            generators={i: make_generator(77, i) for i in range(num_rows)},
            presence_penalties=None,
            frequency_penalties=None,
            repetition_penalties=None,
            prompt_token_ids=None,
            output_token_ids=[],
        )

    fast = Sampler()(logits, md(None)).sampled_token_ids
    # top_p = 1.0 everywhere takes the general path (float32 copy, division, mask pass) and masks nothing.
    general = Sampler()(logits, md(torch.ones(num_rows, device=DEV))).sampled_token_ids
    assert torch.equal(fast, general)
    greedy = temperature == 0
    assert torch.equal(fast[greedy], logits[greedy].argmax(dim=-1))
