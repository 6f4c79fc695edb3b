"""PEFT adapters built offline on tiny checkpoints, and HF + PEFT's merged model as the reference for their outputs."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 12  # generated per request in the LoRA tests
NUM_PROMPTS = 8


def make_prompts(seed: int = 0) -> list[list[int]]:
    """NUM_PROMPTS prompts of 9..50 tokens; most share a 20-token prefix (more than one 16-token block)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 400) for _ in range(20)]
    return [(shared if i % 3 else []) + [rng.randrange(3, 400) for _ in range(9 + 3 * i)] for i in range(NUM_PROMPTS)]


def _hf_model(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model.eval()


def make_peft_adapter(base_path: str, out_dir, r: int, target_modules: list[str], *, lora_alpha: int | None = None,
                      seed: int = 0, b_std: float = 0.3, **config) -> str:
    """Saves a PEFT LoRA adapter for the checkpoint at base_path into out_dir (adapter_config.json +
    adapter_model.safetensors) and returns its path. PEFT initialises lora_B to zeros (a no-op adapter),
    so B is drawn at random here; A keeps PEFT's own initialisation (seeded)."""
    torch.manual_seed(seed)
    lora_config = LoraConfig(r=r, lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
                             target_modules=target_modules, lora_dropout=0.0, bias="none", **config)
    peft_model = get_peft_model(_hf_model(base_path), lora_config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


@dataclass(frozen=True)
class Reference:
    """What HF computes for one prompt: greedy tokens and each one's logprob."""

    token_ids: list[int]
    logprobs: list[float]


@torch.no_grad()
def reference_model(base_path: str, adapter_path: str | None):
    """The plain HF model, or HF + PEFT with the adapter merged into the weights (merge_and_unload)."""
    model = _hf_model(base_path)
    if adapter_path is None:
        return model
    merged = PeftModel.from_pretrained(model, adapter_path).merge_and_unload().eval()
    merged.generation_config.eos_token_id = None
    return merged


@torch.no_grad()
def reference(model, prompt: list[int], max_new_tokens: int) -> Reference:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)[0]
    tokens = out[len(prompt):].tolist()
    logprobs = torch.log_softmax(model(out.unsqueeze(0)).logits[0].float(), dim=-1)  # [P + N, V]
    chosen = [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
    return Reference(tokens, chosen)
