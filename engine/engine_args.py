"""Flat engine arguments (vLLM's names) mapped onto the nested, documented config sections."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from engine.config import ENGINE_CONFIG_SECTIONS, EngineConfig, UsageContext


def engine_arg_names() -> dict[str, str]:
    """Every flat argument name -> the EngineConfig section that owns it."""
    names: dict[str, str] = {}
    for section, cls in ENGINE_CONFIG_SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in names, f"config field {f.name!r} appears in two sections"
            names[f.name] = section
    return names


def create_engine_config(usage_context: UsageContext = "engine", **kwargs: Any) -> EngineConfig:
    """Builds and validates an EngineConfig from flat arguments, e.g. model=DIR, block_size=16.

    usage_context: who drives the engine (LLM: llm_class, the HTTP server: api_server); on a GPU it picks
    the default max_num_batched_tokens, as vLLM's does.

    Unknown names raise TypeError listing them; bad values raise ValueError naming the field.
    max_model_len defaults to (and may not exceed) the checkpoint's max_position_embeddings.
    """
    owners = engine_arg_names()
    unknown = sorted(set(kwargs) - set(owners))
    if unknown:
        raise TypeError(f"unknown engine arguments: {unknown}")
    if "model" not in kwargs:
        raise TypeError("the engine needs model=<checkpoint directory>")
    sections: dict[str, dict[str, Any]] = {name: {} for name in ENGINE_CONFIG_SECTIONS}
    for name, value in kwargs.items():
        sections[owners[name]][name] = value
    built = {name: ENGINE_CONFIG_SECTIONS[name](**args) for name, args in sections.items()}
    model = built["model"]

    hf_config = model.hf_config_dict()
    limit = hf_config.get("max_position_embeddings")
    if model.max_model_len is None:
        if limit is None:
            raise ValueError("max_model_len: config.json has no max_position_embeddings; pass max_model_len")
        model.max_model_len = int(limit)
    elif limit is not None and model.max_model_len > limit:
        raise ValueError(
            f"max_model_len: {model.max_model_len} exceeds the model's max_position_embeddings={limit}"
        )
    num_experts = num_routed_experts(hf_config)
    tp_size = built["parallel"].tensor_parallel_size
    if num_experts and tp_size > 1:  # checked here too, so no worker process is started for nothing
        raise ValueError(
            f"tensor_parallel_size: {hf_config.get('architectures')} is a mixture-of-experts model ({num_experts} experts), "
            f"which runs with tensor_parallel_size 1 only (shard its experts with enable_expert_parallel over "
            f"data_parallel_size engines instead); got {tp_size}"
        )
    spec = built["speculative"].settings
    if spec is not None:
        if tp_size > 1:
            raise ValueError(f"speculative_config: speculative decoding runs with tensor_parallel_size 1 only, got {tp_size}")
        if spec.model is not None:
            with open(os.path.join(spec.model, "config.json")) as f:
                draft_config = json.load(f)
            draft_vocab = draft_config.get("vocab_size")
            draft_limit = draft_config.get("max_position_embeddings")
            if draft_limit is not None and draft_limit < model.max_model_len:
                # The draft reads every position the model does; past its limit it has no rotary angles.
                raise ValueError(
                    f"speculative_config: the draft model's max_position_embeddings ({draft_limit}) is below "
                    f"max_model_len ({model.max_model_len}); lower max_model_len or use a draft that covers it"
                )
            if draft_vocab != hf_config.get("vocab_size"):
                raise ValueError(
                    f"speculative_config: the draft model's vocab_size ({draft_vocab}) differs from the model's "
                    f"({hf_config.get('vocab_size')}); a draft model must share the model's tokenizer"
                )
    return EngineConfig(**built, usage_context=usage_context)


# config.json keys that give a mixture-of-experts model's number of routed experts (Qwen-MoE, Mixtral, DeepSeek).
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def num_routed_experts(hf_config: dict) -> int:
    """A mixture-of-experts config.json's number of routed experts; 0 for a dense model."""
    return next((hf_config[k] for k in _NUM_EXPERTS_KEYS if hf_config.get(k)), 0)
