"""Qwen3 causal LM: the Llama decoder with a per-head RMSNorm on q and k before rope."""

from __future__ import annotations

import torch

from engine.kernels.qk_norm_rope import qk_norm_rope
from engine.models.layers import RMSNorm
from engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _qk_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One launch for both norms and rope on GPU (in place on the qkv output); on CPU exactly
        # q_norm, k_norm, then rotary_emb.
        rope = self.rotary_emb
        return qk_norm_rope(
            positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            rope.cos_cache, rope.sin_cache, self.head_dim,
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
