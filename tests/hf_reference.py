"""HF transformers as the reference: greedy continuations of a checkpoint, run to a fixed length."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF generate()'s greedy tokens after prompt_ids (float32, eager attention, EOS ignored)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
