"""The explicit per-step context: set by the model runner around one forward pass, read by attention (and LoRA) layers."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass
class ForwardContext:
    """What attention layers (and LoRA deltas) may read during one forward pass."""

    attn_metadata: Any  # engine.attention.metadata.AttentionMetadata
    lora_mapping: Any = None  # engine.lora.ops.LoRAMapping: each token's adapter slot; None: no token has one


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata, lora_mapping=None) -> Iterator[ForwardContext]:
    """Makes `attn_metadata` (and the step's LoRA mapping) visible to the layers for the duration of the block."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata=attn_metadata, lora_mapping=lora_mapping)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    """Returns the context of the forward pass in progress; raises outside one."""
    if _forward_context is None:
        raise RuntimeError("no forward context is set; wrap the model call in set_forward_context(...)")
    return _forward_context
