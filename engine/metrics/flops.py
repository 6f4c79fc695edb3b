"""Analytic FLOPs and memory-traffic estimate of engine steps, from the model config and the scheduler's StepWork."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from engine.core.stats import StepWork

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The shape numbers of a dense decoder-only transformer that the estimate needs."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        hidden = config["hidden_size"]
        num_heads = config["num_attention_heads"]
        return cls(
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden // num_heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    # Cached: the estimate runs on every engine step (the shape never changes).
    @cached_property
    def layer_linear_params(self) -> int:
        """Weights of one layer's matmuls (biases and norms are left out: they are tiny)."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        gated_mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        return q_and_o + k_and_v + gated_mlp

    @cached_property
    def kv_elems_per_token(self) -> int:
        """K and V elements one token keeps, over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim


@dataclass
class StepCost:
    """Estimated work of one or more steps on one GPU."""

    flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0


def estimate_step_cost(shape: ModelShape, work: StepWork, dtype_bytes: int, world_size: int = 1) -> StepCost:
    """FLOPs and bytes of the steps in `work`, split evenly over `world_size` GPUs.

    Activations other than the KV cache are left out; so is the sampler.
    """
    s = shape
    # Linear layers: a multiply-add (2 FLOPs) per weight per token.
    linear_flops = 2 * s.num_layers * s.layer_linear_params * work.num_tokens
    # Attention: per query head and (query, key) pair, QK^T and PV each take 2*head_dim FLOPs.
    attn_flops = 4 * s.num_layers * s.num_heads * s.head_dim * work.attn_context_sum
    # Unembedding: hidden x vocab logits, only for the rows that sample.
    unembed_flops = 2 * s.hidden_size * s.vocab_size * work.num_sampling_reqs

    # Weights: every layer's matrices and the unembedding once per step (batching shares the read).
    weight_bytes = work.num_steps * (s.num_layers * s.layer_linear_params + s.hidden_size * s.vocab_size) * dtype_bytes
    # Embedding lookups read one row per token, from a separate table only when it is not tied.
    embed_bytes = 0 if s.tie_word_embeddings else work.num_tokens * s.hidden_size * dtype_bytes
    # KV read: each row's keys and values once (exact for decode; a lower bound for prefill).
    kv_read_bytes = work.kv_context_sum * s.kv_elems_per_token * dtype_bytes
    # KV write: every scheduled token stores its keys and values.
    kv_write_bytes = work.num_tokens * s.kv_elems_per_token * dtype_bytes

    return StepCost(
        flops=(linear_flops + attn_flops + unembed_flops) / world_size,
        read_bytes=(weight_bytes + embed_bytes + kv_read_bytes) / world_size,
        write_bytes=kv_write_bytes / world_size,
    )


class StepCostEstimator:
    """estimate_step_cost() bound to one engine's model shape, dtype and GPU count."""

    def __init__(self, shape: ModelShape, dtype_bytes: int, world_size: int = 1) -> None:
        self.shape = shape
        self.dtype_bytes = dtype_bytes
        self.world_size = world_size

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> StepCostEstimator:
        dtype = config.model.dtype
        if dtype == "auto":  # the worker's rule: float32 on CPU, bfloat16 on GPU
            dtype = "float32" if config.device.resolve() == "cpu" else "bfloat16"
        # One GPU per engine until the engine grows tensor parallelism.
        return cls(ModelShape.from_hf_config(config.model.hf_config_dict()), DTYPE_BYTES[dtype])

    def estimate(self, work: StepWork) -> StepCost:
        return estimate_step_cost(self.shape, work, self.dtype_bytes, self.world_size)


def estimator_for(config: EngineConfig) -> StepCostEstimator | None:
    """The engine's estimator, or None (and a warning) when its config lacks a shape field."""
    try:
        return StepCostEstimator.from_engine_config(config)
    except (KeyError, TypeError, ValueError) as e:
        logger.warning("FLOPs/bytes estimate off: the model config lacks %s", e)
        return None
