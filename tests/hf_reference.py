"""HF transformers as the reference: greedy continuations of a checkpoint, and a MoE router's top-k choices."""

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


@torch.no_grad()
def hf_router_top_k(path: str, sequences: list[list[int]]) -> list[list[list[list[int]]]]:
    """Per sequence [position][moe_layer][k]: HF's router top-k (softmax, best first) over the whole sequence."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    for seq in sequences:
        router_logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits  # per MoE layer [T, E]
        top_k = [torch.topk(torch.softmax(l.float(), -1), config.num_experts_per_tok, -1).indices for l in router_logits]
        out.append(torch.stack(top_k, dim=1).tolist())  # [T, L, K]
    return out


@torch.no_grad()
def hf_token_logprobs(path: str, ids: list[int]) -> tuple[list[float], list[float]]:
    """HF's forward over `ids` (float32, eager): per position 1.. (logprob of ids[i] given ids[:i], the
    largest logprob there)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, vocab]
    chosen = logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return chosen.tolist(), logprobs[:-1].max(dim=1).values.tolist()
