"""Qwen3-MoE causal LM: the Qwen3 decoder with a sparse mixture-of-experts MLP in the layers HF picks, a dense MLP in the others."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.models.llama import LlamaMLP
from engine.models.moe import (
    SparseMoeBlock,
    check_no_tensor_parallelism,
    routed_expert_ids,
    set_routing_capture,
    split_expert_weights,
)
from engine.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    """HF's rule: every decoder_sparse_step-th layer is sparse, except those in mlp_only_layers."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 attention (per-head q/k norm) + SparseMoeBlock; Qwen3-MoE has no shared experts.

    HF names: the router is `mlp.gate.weight`, experts `mlp.experts.{e}.{gate,up,down}_proj.weight`
    (or transformers v5's stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`); dense layers
    are named as in Qwen3.
    """

    # The torch reference experts read per-expert token counts on the host every layer, which a
    # CUDA graph cannot capture: decode runs eagerly until a fused MoE kernel replaces it.
    supports_cuda_graphs = False

    def __init__(self, config):
        check_no_tensor_parallelism(type(self).__name__)
        super().__init__(config)

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: {config.hidden_act!r} is not supported; supported: silu")
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.norm_topk_prob,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        dense = super().load_weights(split_expert_weights(self, weights, loaded))  # experts land on the way
        return dense | loaded

    def set_routing_capture(self, enabled: bool) -> None:
        """On: every forward records the experts each token was routed to (see routed_expert_ids)."""
        set_routing_capture(self, enabled)

    def routed_expert_ids(self) -> torch.Tensor | None:
        """[num_tokens, num_moe_layers, top_k] int32 expert ids of the last forward (None when not capturing)."""
        return routed_expert_ids(self)
