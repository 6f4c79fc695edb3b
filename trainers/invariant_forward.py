"""The policy's logprobs computed the way the batch-invariant engine computes them: same kernels, same reduction order, bit for bit on CUDA.

With the engine in batch-invariant mode (engine/kernels/batch_invariant.py) a token's logprob does
not depend on its step: not on the batch, the prefix-cache hits, the chunk boundaries or the block
layout. So one full forward over prompt + response, made of the engine's own kernels, reproduces
every logprob the engine returned during generation:

    per sequence (a request of one prefill; a trivial paged layout: request b owns blocks b*nb ...):
      embed -> [rms_norm -> qkv (fused weights, linear_invariant) -> rotary | qk_norm_rope
                -> write_kv_cache -> paged_attention_invariant -> o_proj
                -> rms_norm(+residual) -> gate_up -> silu_and_mul -> down] x layers
      -> rms_norm -> rows predicting the response -> LM head (linear_invariant)
      -> the sampler's float32 copy divided by the temperature (apply_temperature) -> log_softmax -> gather

The parameters are the trainer's (HF names; under FSDP2 each DTensor is gathered with full_tensor(),
one layer at a time), cast to the engine's dtype as a weight sync casts them, and fused as the engine
fuses them (q|k|v, gate|up). Supported: Llama, Qwen2, Qwen3 (dense), without LoRA adapters.

The Triton kernels have no backward: this forward runs without autograd. Policy.response_logprobs
keeps training possible with an exact straight-through: the returned values are this forward's,
bit for bit, and their gradient is the HF forward's (the same function up to rounding). On CPU the
engine runs other kernels (C attention, bucketed linears), so there the numbers are close, not equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import torch_ref
from engine.attention.metadata import AttentionMetadata
from engine.kernels import use_triton
from engine.kernels.activation import silu_and_mul
from engine.kernels.attention import paged_attention_invariant, write_kv_cache
from engine.kernels.batch_invariant import linear_invariant
from engine.kernels.norm import rms_norm
from engine.kernels.qk_norm_rope import qk_norm_rope
from engine.kernels.rotary import rotary_embedding
from engine.models.layers import get_rope
from engine.sample.topk_topp import apply_temperature

# HF architectures whose decoder this forward reproduces (engine/models/llama.py, qwen3.py).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
BLOCK_SIZE = 16  # of the trivial KV layout; any value gives the same bits (attention is layout-invariant)


def architecture_of(hf_config) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    return archs[0] if archs else type(hf_config).__name__


def check_supported(hf_config) -> None:
    """ValueError naming the architecture unless this forward reproduces the engine's model for it."""
    arch = architecture_of(hf_config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model.invariant_forward: architecture {arch!r} is not supported; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")


def _full(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole parameter in the engine's dtype (an FSDP2 DTensor gathered; float32 -> bf16 rounds as a sync does)."""
    if p is None:
        return None
    from torch.distributed.tensor import DTensor

    t = p.full_tensor() if isinstance(p, DTensor) else p
    return t.detach().to(dtype)


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The engine's fused parameter: HF tensors stacked along the output rows (None when they have none)."""
    if tensors[0] is None:
        return None
    return torch.cat(tensors, dim=0)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    # CUDA: the engine's invariant GEMM (whatever this process's mode); CPU: F.linear (the reference).
    return linear_invariant(x, w, b) if use_triton(x) else F.linear(x, w, b)


def _attention(q, kv_cache, metadata, scale):
    if use_triton(q):
        return paged_attention_invariant(q, kv_cache, metadata, scale)
    return torch_ref.paged_attention(q, kv_cache, metadata, scale)


def _trivial_metadata(num_seqs: int, length: int, device: torch.device) -> AttentionMetadata:
    """num_seqs requests of `length` tokens each, all computed in one step, sequence b in blocks [b*nb, (b+1)*nb)."""
    nb = -(-length // BLOCK_SIZE)
    i32 = dict(dtype=torch.int32, device=device)
    block_table = torch.arange(num_seqs * nb, **i32).view(num_seqs, nb)  # [B, nb]
    pos = torch.arange(length, dtype=torch.int64, device=device)
    slots = (torch.arange(num_seqs, dtype=torch.int64, device=device)[:, None] * nb * BLOCK_SIZE + pos).reshape(-1)
    return AttentionMetadata(
        num_actual_tokens=num_seqs * length,
        query_start_loc=torch.arange(num_seqs + 1, **i32) * length,
        seq_lens=torch.full((num_seqs,), length, **i32),
        block_table=block_table,
        slot_mapping=slots,
        max_query_len=length,
        max_seq_len=length,
        query_lens_cpu=[length] * num_seqs,
        seq_lens_cpu=[length] * num_seqs,
    )


def engine_token_logprobs(
    logits: torch.Tensor,  # [N, V] in the model's dtype, as the engine's LM head returns them
    token_ids: torch.Tensor,  # [N] int64
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen [N] float32, log-probs [N, V] float32) as the engine's sampler makes processed_logprobs: one
    float32 copy divided by the row's float32 temperature (a division by 1.0 is the exact copy that
    greedy rows get), log_softmax over the vocabulary, gather."""
    temp = torch.full((logits.shape[0],), temperature, dtype=torch.float32, device=logits.device)
    logp = apply_temperature(logits, temp, None, out_dtype=torch.float32).log_softmax(dim=-1)  # [N, V]
    return logp.gather(1, token_ids.to(logits.device, torch.int64).unsqueeze(1)).squeeze(1), logp


class InvariantForward:
    """The engine's forward over an HF causal LM's parameters (see the module docstring).

    `model` is the HF model (FSDP2-sharded or not, not PEFT), `hf_config` the checkpoint's config as
    the engine reads it, `dtype` the engine's model dtype.
    """

    def __init__(self, model: nn.Module, hf_config, dtype: torch.dtype, device: torch.device) -> None:
        check_supported(hf_config)
        if hasattr(model, "get_base_model"):
            raise ValueError("model.invariant_forward: a LoRA (PEFT) policy is not supported")
        self.model, self.config, self.dtype, self.device = model, hf_config, dtype, torch.device(device)
        self.qwen3 = architecture_of(hf_config) == "Qwen3ForCausalLM"
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.num_heads
        self.eps = hf_config.rms_norm_eps
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        # The engine's cos/sin cache, built by the engine's code on the same device in the same dtype
        # setting (engine/models/loader.load_model), so its float32 values are the engine's.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(self.device):
                self.rope = get_rope(self.head_dim, hf_config)
        finally:
            torch.set_default_dtype(previous)

    @torch.no_grad()
    def hidden_rows(self, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [len(rows), hidden] at flat positions `rows` of input_ids [B, L] (b * L + t)."""
        base = self.model.model
        num_seqs, length = input_ids.shape
        ids = input_ids.to(self.device).reshape(-1)  # [T]
        positions = torch.arange(length, dtype=torch.int64, device=self.device).repeat(num_seqs)  # [T]
        md = _trivial_metadata(num_seqs, length, self.device)
        nb = md.block_table.shape[1]
        kv_cache = torch.empty(2, num_seqs * nb, BLOCK_SIZE, self.num_kv_heads, self.head_dim,
                               dtype=self.dtype, device=self.device)  # one cache, rewritten by every layer
        num_tokens = ids.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dt = self.dtype

        hidden = F.embedding(ids, _full(base.embed_tokens.weight, dt))  # [T, hidden]
        residual = None
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if residual is None:
                residual, hidden = hidden, rms_norm(hidden, _full(layer.input_layernorm.weight, dt), self.eps)
            else:
                hidden, residual = rms_norm(hidden, _full(layer.input_layernorm.weight, dt), self.eps, residual)
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            qkv = _linear(hidden, _cat([_full(p.weight, dt) for p in projs]),
                          _cat([_full(p.bias, dt) for p in projs]))  # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            if self.qwen3:
                q, k = qk_norm_rope(positions, q, k, _full(attn.q_norm.weight, dt), _full(attn.k_norm.weight, dt),
                                    self.eps, self.rope.cos_cache, self.rope.sin_cache,
                                    self.head_dim)
            else:
                q, k = rotary_embedding(positions, q, k, self.rope.cos_cache, self.rope.sin_cache, self.head_dim)
            write_kv_cache(k.view(num_tokens, self.num_kv_heads, self.head_dim),
                           v.view(num_tokens, self.num_kv_heads, self.head_dim), kv_cache, md.slot_mapping)
            out = _attention(q.view(num_tokens, self.num_heads, self.head_dim), kv_cache, md, self.head_dim**-0.5)
            hidden = _linear(out.view(num_tokens, q_size), _full(attn.o_proj.weight, dt), _full(attn.o_proj.bias, dt))
            hidden, residual = rms_norm(hidden, _full(layer.post_attention_layernorm.weight, dt), self.eps, residual)
            gate_up = _linear(hidden, _cat([_full(mlp.gate_proj.weight, dt), _full(mlp.up_proj.weight, dt)]),
                              _cat([_full(mlp.gate_proj.bias, dt), _full(mlp.up_proj.bias, dt)]))
            hidden = _linear(silu_and_mul(gate_up), _full(mlp.down_proj.weight, dt), _full(mlp.down_proj.bias, dt))
        hidden, _ = rms_norm(hidden, _full(base.norm.weight, dt), self.eps, residual)
        return hidden[rows.to(self.device)]

    def lm_head_weight(self) -> torch.Tensor:
        head = self.model.model.embed_tokens.weight if self.tied else self.model.lm_head.weight
        return _full(head, self.dtype)

    @torch.no_grad()
    def response_logprobs(
        self,
        input_ids: torch.Tensor,  # [B, L] prompt + response, right-padded
        prompt_lens: torch.Tensor,  # [B]
        response_ids: torch.Tensor,  # [B, R]
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logprobs [B, R] float32 of response_ids (and entropy [B, R]), the engine's numbers; no autograd.

        Rows past a sequence's end read its last column (as trainers.policy.gather_response_rows);
        callers mask them out. Padding after a sequence never changes its rows: attention is causal.
        """
        num_seqs, length = input_ids.shape
        num_resp = response_ids.shape[1]
        offsets = torch.arange(num_resp, device=self.device)
        cols = (prompt_lens.to(self.device).unsqueeze(1) - 1 + offsets).clamp(max=length - 1)  # [B, R]
        rows = (torch.arange(num_seqs, device=self.device).unsqueeze(1) * length + cols).reshape(-1)  # [B R]
        hidden = self.hidden_rows(input_ids, rows)  # [B R, hidden]
        logits = _linear(hidden, self.lm_head_weight())  # [B R, V]: the engine's LMHead, no bias
        chosen, logp = engine_token_logprobs(logits, response_ids.reshape(-1), temperature)
        entropy = -(logp.exp() * logp).sum(-1).view(num_seqs, num_resp) if with_entropy else None
        return chosen.view(num_seqs, num_resp), entropy


class _StraightThrough(torch.autograd.Function):
    """value's numbers exactly, with the gradient of `grad_source` (the HF forward's)."""

    @staticmethod
    def forward(ctx, grad_source: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ARG004
        return grad, None


def straight_through(grad_source: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A tensor equal to `value` bit for bit whose backward is grad_source's (same shape)."""
    if grad_source.shape != value.shape:
        raise ValueError(f"straight_through: shapes differ, {list(grad_source.shape)} vs {list(value.shape)}")
    return _StraightThrough.apply(grad_source, value.to(grad_source.dtype))
