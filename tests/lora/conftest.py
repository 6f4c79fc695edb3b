"""Fixtures of the LoRA tests: one tiny Llama checkpoint, three PEFT adapters for it and their HF + PEFT references."""

from __future__ import annotations

import pytest

from engine.lora.request import LoRARequest
from peft_reference import (
    ALL_TARGETS, MAX_TOKENS, NUM_PROMPTS, make_peft_adapter, make_prompts, reference, reference_model,
)

# Three adapters of different ranks and targets; "all" covers every projection (fused q/k/v and gate/up too).
ADAPTERS = {
    "qv": dict(r=4, target_modules=["q_proj", "v_proj"], seed=1),
    "mixed": dict(r=8, target_modules=["k_proj", "o_proj", "gate_proj"], seed=2, use_rslora=True),
    "all": dict(r=16, target_modules=ALL_TARGETS, seed=3, lora_alpha=8),
}


@pytest.fixture(scope="session")
def base_model(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def adapters(base_model, tmp_path_factory) -> dict[str, LoRARequest]:
    """name -> LoRARequest of a PEFT adapter directory saved for base_model (ids 1, 2, 3)."""
    out = {}
    for lora_id, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        path = make_peft_adapter(base_model, tmp_path_factory.mktemp(f"lora-{name}"), **spec)
        out[name] = LoRARequest(name, lora_id, path)
    return out


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="session")
def assignment() -> list[str | None]:
    """The adapter of each prompt: the three adapters and the base model, mixed in one batch."""
    return [["qv", "mixed", "all", None][i % 4] for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="session")
def references(base_model, adapters, prompts):
    """(adapter name or None, prompt index) -> Reference, for every adapter and the base model on every prompt."""
    out = {}
    for name in [None, *adapters]:
        model = reference_model(base_model, adapters[name].lora_path if name else None)
        for i, prompt in enumerate(prompts):
            out[name, i] = reference(model, prompt, MAX_TOKENS)
    return out
