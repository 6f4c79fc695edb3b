"""Llama (incl. Llama-3 rope scaling) and Qwen2 causal LMs, as small variations of one decoder (tensor parallel through its layers)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.models.layers import (
    LMHead,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabEmbedding,
    get_rope,
    load_weights_with_mapping,
)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    # Qwen2 overrides these: bias on q/k/v but not on o.
    def _biases(self, config) -> tuple[bool, bool]:
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def __init__(self, config):
        super().__init__()
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = self._biases(config)
        # Column parallel: this rank computes its query heads and the KV heads they read.
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, qkv_bias
        )
        # Head counts and sizes below are this rank's (the whole model's with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Row parallel: each rank's heads give a partial sum of the output, reduced inside.
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, o_bias)
        self.rotary_emb = get_rope(self.head_dim, config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def _qk_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as attention reads them: rotated (Qwen3 normalises each head first, in one kernel).

        q, k are views into the qkv output; an override may overwrite them in place.
        """
        return self.rotary_emb(positions, q, k)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) * D], this rank's heads
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._qk_rope(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, hidden]


class Qwen2Attention(LlamaAttention):
    def _biases(self, config) -> tuple[bool, bool]:
        return True, False


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: {config.hidden_act!r} is not supported; supported: silu")
        bias = getattr(config, "mlp_bias", False)
        # gate/up column parallel and down row parallel: the activation between them stays local.
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        # [T, 2 * I / tp] -> [T, I / tp] -> [T, hidden] (reduced over ranks)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, attention_cls: type[LlamaAttention], mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention_cls(config)
        self.mlp = LlamaMLP(config) if mlp is None else mlp  # [T, hidden] -> [T, hidden]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, attention_cls: type[LlamaAttention],
                 make_mlp: Callable[[object, int], nn.Module] | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # make_mlp(config, layer_idx): the MLP of each layer (MoE families mix sparse and dense ones).
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attention_cls, None if make_mlp is None else make_mlp(config, i))
            for i in range(config.num_hidden_layers)
        )
        # One cos/sin cache for all layers (same positions, same frequencies): per layer it is
        # max_position_embeddings x head_dim floats twice, 21 MiB for Qwen3's 40960 positions, 0.6 GiB in all.
        shared_rope = self.layers[0].self_attn.rotary_emb
        for layer in self.layers[1:]:
            layer.self_attn.rotary_emb = shared_rope
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, self.attention_cls, self.make_mlp)
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_embedding=tied)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """The MLP of decoder layer `layer_idx` (called while the model is built)."""
        return LlamaMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 (all requests flattened) -> [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab]: the model's dtype on GPU (the sampler upcasts), float32 on CPU."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors; returns the names of the parameters that were fully loaded."""
        skip = ("lm_head.weight",) if self.tie_word_embeddings else ()
        return load_weights_with_mapping(self, weights, self.packed_modules_mapping, skip=skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
