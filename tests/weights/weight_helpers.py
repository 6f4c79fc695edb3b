"""Shared helpers of the weight-update tests: HF greedy references, engine greedy runs, checkpoint tensors."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 78, 79]]
MAX_TOKENS = 10


def hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model.eval()


def hf_greedy(model, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def engine_greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def read_state(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")
