"""The Attention module models call: writes this step's KV into the paged cache, then attends over it."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import torch
from torch import nn

from engine.forward_context import get_forward_context

# Backend modules, each providing write_kv_cache(...) and paged_attention(...) with the
# signatures of engine.attention.torch_ref. A GPU Triton module registers here.
ATTENTION_BACKENDS = {
    "torch_ref": "engine.attention.torch_ref",
    # Triton kernels for CUDA tensors; falls back to torch_ref for CPU tensors.
    "triton": "engine.kernels.attention",
    # A C kernel for CPU tensors reading the paged cache in place; torch_ref where it does not apply.
    "cpu": "engine.kernels.cpu_attention",
}


def _default_backend_name() -> str:
    """The one place the attention implementation is chosen (GPU kernels plug in here)."""
    from engine.kernels import triton_enabled

    return "triton" if triton_enabled() else "cpu"


_backend: ModuleType = importlib.import_module(ATTENTION_BACKENDS[_default_backend_name()])


def get_attention_backend() -> ModuleType:
    return _backend


def set_attention_backend(name: str) -> None:
    """Selects the attention backend for all Attention layers by name."""
    global _backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend: {name!r} is unknown; known: {sorted(ATTENTION_BACKENDS)}")
    _backend = importlib.import_module(ATTENTION_BACKENDS[name])


@contextmanager
def override_attention_backend(name: str) -> Iterator[None]:
    """Temporarily selects another backend (for tests comparing kernels against the reference)."""
    global _backend
    previous = _backend
    set_attention_backend(name)
    try:
        yield
    finally:
        _backend = previous


class Attention(nn.Module):
    """Paged multi-head attention with GQA; knows nothing about batching or CUDA graphs.

    Under tensor parallelism every count is this rank's: num_heads query heads and the
    num_kv_heads KV heads they read (see QKVLinear), so the KV cache the worker sizes from
    num_kv_heads holds this rank's heads only.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # [2, num_blocks, block_size, num_kv_heads, head_size]; set by the worker after allocation.
        self.kv_cache: torch.Tensor | None = None
        # Per-tensor scales of an fp8 KV cache (stored = value / scale); 1.0, vLLM's default without
        # checkpoint scales. Unused when the cache has the model's dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        if self.kv_cache is None:
            raise RuntimeError("Attention.kv_cache is not set; the worker must allocate the KV cache first")
        metadata = get_forward_context().attn_metadata
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        _backend.write_kv_cache(k, v, self.kv_cache, metadata.slot_mapping, self.k_scale, self.v_scale)
        out = _backend.paged_attention(q, self.kv_cache, metadata, self.scale, self.k_scale, self.v_scale)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_size={self.head_size}, num_kv_heads={self.num_kv_heads}"
