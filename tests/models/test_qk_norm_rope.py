"""The fused q/k RMSNorm + rope: its reference is exactly the unfused ops, and its Triton kernel matches it under the interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from engine.kernels.norm import rms_norm_ref
from engine.kernels.qk_norm_rope import qk_norm_rope_ref
from engine.kernels.rotary import rotary_embedding_ref


def _case(num_tokens=7, num_q=6, num_kv=2, d=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_q + 2 * num_kv) * d, generator=gen).to(dtype)
    q, k = qkv[:, : num_q * d], qkv[:, num_q * d : (num_q + num_kv) * d]
    q_w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    k_w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(512).float(), inv)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen)
    return positions, q, k, q_w, k_w, freqs.cos(), freqs.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_unfused_ops(dtype):
    positions, q, k, q_w, k_w, cos, sin = _case(dtype=dtype)
    T, d = q.shape[0], 64
    nq = rms_norm_ref(q.reshape(T, -1, d), q_w, 1e-6).view(T, -1)
    nk = rms_norm_ref(k.reshape(T, -1, d), k_w, 1e-6).view(T, -1)
    rq, rk = rotary_embedding_ref(positions, nq, nk, cos, sin, d)
    oq, ok = qk_norm_rope_ref(positions, q, k, q_w, k_w, 1e-6, cos, sin, d)
    assert torch.equal(oq, rq) and torch.equal(ok, rk)


def qwen3_fused_and_unfused(path: str, dtype: torch.dtype, device: str, num_tokens: int, first_position: int):
    """Layer 0 of the tiny Qwen3 on random hidden states: (q, k) from Qwen3Attention._qk_rope, and
    (q, k) from q_norm, k_norm, then rotary_emb (the unfused modules)."""
    from engine.models.loader import load_hf_config, load_model

    model = load_model(path, load_hf_config(path), dtype, torch.device(device), "auto")
    attn = model.model.layers[0].self_attn
    T = num_tokens
    hidden = torch.randn(T, model.config.hidden_size, dtype=dtype, device=device)
    positions = torch.arange(first_position, first_position + T, device=device)
    with torch.inference_mode():
        q, k, _ = attn.qkv_proj(hidden).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        nq = attn.q_norm(q.reshape(T, attn.num_heads, attn.head_dim)).view(T, -1)
        nk = attn.k_norm(k.reshape(T, attn.num_kv_heads, attn.head_dim)).view(T, -1)
        unfused = attn.rotary_emb(positions, nq, nk)
        fused = attn._qk_rope(positions, q, k)
    return fused, unfused


def test_qwen3_attention_cpu_path_is_the_unfused_modules(tiny_checkpoint):
    (oq, ok), (rq, rk) = qwen3_fused_and_unfused(tiny_checkpoint("qwen3"), torch.float32, "cpu", 5, 3)
    assert torch.equal(oq, rq) and torch.equal(ok, rk)


# Run in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are decorated.
_INTERPRETED = """
import torch
from engine.kernels.qk_norm_rope import qk_norm_rope_ref, qk_norm_rope_triton
from tests.models.test_qk_norm_rope import _case
for (num_tokens, num_q, num_kv, d), dtype in [((7, 6, 2, 64), torch.float32), ((3, 4, 4, 128), torch.float32),
                                             ((1, 3, 1, 16), torch.float32), ((5, 8, 2, 64), torch.bfloat16)]:
    positions, q, k, q_w, k_w, cos, sin = _case(num_tokens, num_q, num_kv, d, dtype)
    qkv = q._base
    v_before = qkv[:, (num_q + num_kv) * d :].clone()
    rq, rk = qk_norm_rope_ref(positions, q, k, q_w, k_w, 1e-6, cos, sin, d)
    oq, ok = qk_norm_rope_triton(positions, q, k, q_w, k_w, 1e-6, cos, sin, d)
    assert oq.data_ptr() == q.data_ptr() and ok.data_ptr() == k.data_ptr()
    assert torch.equal(qkv[:, (num_q + num_kv) * d :], v_before)
    if dtype == torch.bfloat16:  # the kernel rounds where the reference does: equal but for rare rsqrt ulps
        assert (oq == rq).float().mean() >= 0.99 and (ok == rk).float().mean() >= 0.99
    else:
        torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter runs on CPU)")
def test_triton_kernel_under_interpreter():
    """float32, and bfloat16 (the kernel rounds to bfloat16 by integer ops, which the interpreter runs exactly)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
