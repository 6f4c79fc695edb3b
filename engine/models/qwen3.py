"""Qwen3 causal LM: the Llama decoder with a per-head RMSNorm on q and k before rope."""

from __future__ import annotations

import torch

from engine.models.layers import RMSNorm
from engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        return q.view(num_tokens, self.q_size), k.view(num_tokens, self.kv_size)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
