"""Maps HF `architectures` names to the engine's model classes."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_model_class(hf_config) -> type[nn.Module]:
    """Returns the class for the first supported name in hf_config.architectures."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"architectures: {architectures} is not supported; supported: {sorted(ARCHITECTURES)}")
