"""GPU tier: the fused q/k RMSNorm + rope kernel against its reference, the Qwen3 path that uses it, and no recompiles while serving."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import AttentionMetadata
from engine.kernels import attention, override_kernels
from engine.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, qk_norm_rope_triton

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _rope_cache(head_size: int, max_position: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (1e6 ** (torch.arange(0, head_size, 2, device=DEV).float() / head_size))
    freqs = torch.outer(torch.arange(max_position, device=DEV).float(), inv)
    return freqs.cos(), freqs.sin()


def _case(num_tokens, num_q_heads, num_kv_heads, head_size, dtype):
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=DEV)
    weights = [(1.0 + 0.2 * torch.randn(head_size, device=DEV)).to(dtype) for _ in range(2)]
    positions = torch.randint(0, 4096, (num_tokens,), device=DEV)
    return qkv, weights, positions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(16, 8, 128), (32, 4, 128), (14, 2, 64), (8, 8, 64)])  # GQA and MHA
@pytest.mark.parametrize("num_tokens", [1, 7, 333])
def test_qk_norm_rope_matches_reference(dtype, heads, num_tokens):
    num_q, num_kv, d = heads
    qkv, (q_w, k_w), positions = _case(num_tokens, num_q, num_kv, d, dtype)
    cos, sin = _rope_cache(d)
    q, k = qkv[:, : num_q * d], qkv[:, num_q * d : (num_q + num_kv) * d]  # strided views, as the model passes
    v_before = qkv[:, (num_q + num_kv) * d :].clone()
    rq, rk = qk_norm_rope_ref(positions, q, k, q_w, k_w, 1e-6, cos, sin, d)
    oq, ok = qk_norm_rope_triton(positions, q, k, q_w, k_w, 1e-6, cos, sin, d)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr()  # in place on the qkv output
    assert torch.equal(qkv[:, (num_q + num_kv) * d :], v_before)  # v untouched
    for out, ref in ((oq, rq), (ok, rk)):
        assert not torch.isnan(out).any()
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:
            # Same rounding points as the reference: only the float32 rsqrt/sum order can flip a bf16 ulp.
            assert (out == ref).float().mean() >= 0.99
            torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)


def test_qk_norm_rope_dispatch_and_override():
    qkv, (q_w, k_w), positions = _case(5, 4, 2, 64, torch.bfloat16)
    cos, sin = _rope_cache(64)
    q, k = qkv[:, :256], qkv[:, 256:384]
    with override_kernels(False):
        rq, _ = qk_norm_rope(positions, q, k, q_w, k_w, 1e-6, cos, sin, 64)
        assert rq.data_ptr() != q.data_ptr()  # the reference makes new tensors
    oq, _ = qk_norm_rope(positions, q, k, q_w, k_w, 1e-6, cos, sin, 64)
    assert oq.data_ptr() == q.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qwen3_attention_fused_matches_unfused(tiny_checkpoint, dtype):
    """Qwen3Attention's fused pre-processing gives what q_norm, k_norm, rotary_emb give (the old path)."""
    from tests.models.test_qk_norm_rope import qwen3_fused_and_unfused

    (oq, ok), (rq, rk) = qwen3_fused_and_unfused(tiny_checkpoint("qwen3"), dtype, DEV, 13, 100)
    tol = {"rtol": 1.6e-2, "atol": 1.6e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(oq.float(), rq.float(), **tol)
    torch.testing.assert_close(ok.float(), rk.float(), **tol)


def _num_compiled(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_paged_attention_compiles_once_per_config():
    """num_reqs and the block table's width change every step: they must not select new variants."""
    num_heads, num_kv_heads, head_size, block_size = 16, 8, 128, 16
    num_blocks = 200
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEV)
    kernel = attention._paged_attention_kernel
    counts = []
    # Prefill-class steps (max_query_len > 1: one tile config, no split) of 1, 2, 3, 16, 17 requests
    # whose block tables are 1, 2, 16, 17 and 32 blocks wide.
    for query_lens, seq_lens in [([5], [5]), ([3, 1], [20, 9]), ([9, 1, 1], [250, 3, 7]),
                                 ([2] * 16, [270] * 16), ([7] + [1] * 16, [512] + [33] * 16)]:
        md = AttentionMetadata.build(query_lens, seq_lens,
                                     [[(i * 37 + j) % num_blocks for j in range(-(-s // block_size))]
                                      for i, s in enumerate(seq_lens)], block_size, device=DEV)
        q = torch.randn(sum(query_lens), num_heads, head_size, dtype=torch.bfloat16, device=DEV)
        attention.paged_attention(q, kv, md, head_size**-0.5)
        counts.append(_num_compiled(kernel))
    assert counts[1:] == [counts[0]] * (len(counts) - 1), counts


def test_worker_warm_up_leaves_state_alone(tiny_checkpoint):
    """The start-up warm-up on GPU: the KV cache, request state and engine generator are untouched."""
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.worker.worker import Worker

    cfg = EngineConfig(model=ModelConfig(model=tiny_checkpoint("qwen3"), enforce_eager=True),
                       device=DeviceConfig("cuda"), cache=CacheConfig(block_size=16),
                       scheduler=SchedulerConfig(max_num_seqs=40, max_num_batched_tokens=256))
    worker = Worker(cfg, max_model_len=512)
    try:
        worker.initialize_kv_cache(64)  # runs the warm-up once
        for layer in worker.attn_layers:
            layer.kv_cache.normal_()
        before = [layer.kv_cache.clone() for layer in worker.attn_layers]
        gen_state = worker.model_runner.sampler.generator.get_state()
        assert worker.run_warm_up_passes() > 3  # prefill, mixed, and eager decode sizes
        assert all(torch.equal(b, layer.kv_cache) for b, layer in zip(before, worker.attn_layers))
        assert torch.equal(gen_state, worker.model_runner.sampler.generator.get_state())
        assert not worker.model_runner.state.req_id_to_slot
    finally:
        worker.shutdown()
