"""The FSDP2 policy on a single-process gloo group: engine/trainer logprob agreement at step 0, response-row indexing, and HF saving the engine loads."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from engine import LLM, SamplingParams
from trainers.config import ModelConfig, OptimConfig
from trainers.policy import Policy, gather_response_rows, init_distributed, token_logprobs_and_entropy
from trainers.rollouts import generate_rollouts

PROMPTS = ["The quick brown fox", "Once upon a time", "12+35=", "Numbers appear too:"]


@pytest.fixture(scope="module")
def process_group():
    """A single-process gloo group, as a one-rank training script has."""
    created = not dist.is_initialized()
    rank, world_size = init_distributed("cpu")
    assert (rank, world_size) == (0, 1)
    yield
    if created:
        dist.destroy_process_group()


def masked_mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_step0_engine_and_trainer_logprobs_agree(process_group, tiny_checkpoint, arch, temperature):
    path = tiny_checkpoint(arch)
    policy = Policy(ModelConfig(path=path), OptimConfig())
    assert all(type(p).__name__ == "DTensor" for p in policy.model.parameters())  # really fully_shard'ed
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, logprobs_mode="processed_logprobs")
    batch = generate_rollouts(llm, PROMPTS, n=3, temperature=temperature, max_tokens=12, seed=7)
    assert batch.num_samples == len(PROMPTS) * 3
    assert batch.response_mask.sum() > 0.5 * batch.response_mask.numel()
    with torch.no_grad():
        logprobs, entropy = policy.response_logprobs(
            batch.input_ids, batch.prompt_lens, batch.response_ids, temperature=temperature, with_entropy=True
        )
    mismatch = masked_mean_abs(logprobs, batch.rollout_logprobs, batch.response_mask)
    assert mismatch < 1e-4, mismatch
    # The trainer really scores at the sampling temperature: at T=1 the same tokens score differently.
    if temperature != 1.0:
        with torch.no_grad():
            untempered, _ = policy.response_logprobs(batch.input_ids, batch.prompt_lens, batch.response_ids)
        assert masked_mean_abs(untempered, batch.rollout_logprobs, batch.response_mask) > 1e-2
    assert bool((entropy[batch.response_mask.bool()] > 0).all())


def test_response_rows_follow_each_prompt_length():
    # logits[b, t, :] = one-hot at token id 10 * b + t, so the chosen row is readable back.
    batch, length, vocab = 2, 6, 64
    logits = torch.full((batch, length, vocab), -1e4)
    for b in range(batch):
        for t in range(length):
            logits[b, t, 10 * b + t] = 0.0
    prompt_lens = torch.tensor([2, 4])
    rows = gather_response_rows(logits, prompt_lens, num_response_positions=3)  # [2, 3, V]
    picked = rows.argmax(-1)
    # row b, response j comes from column prompt_lens[b] - 1 + j, clamped to the last column
    assert picked.tolist() == [[1, 2, 3], [13, 14, 15]]
    logprobs, entropy = token_logprobs_and_entropy(rows, picked)
    assert torch.allclose(logprobs, torch.zeros_like(logprobs), atol=1e-6)
    assert torch.allclose(entropy, torch.zeros_like(entropy), atol=1e-3)
    clamped = gather_response_rows(logits, prompt_lens, num_response_positions=4).argmax(-1)
    assert clamped[1, 3].item() == 15  # past the end: the last column, masked out by callers


def test_entropy_matches_definition():
    logits = torch.randn(2, 3, 17, dtype=torch.float32)
    tokens = torch.randint(0, 17, (2, 3))
    logprobs, entropy = token_logprobs_and_entropy(logits, tokens, temperature=0.5)
    probs = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1), atol=1e-5)
    assert torch.allclose(logprobs, probs.log().gather(-1, tokens.unsqueeze(-1)).squeeze(-1), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 ties lm_head to the embedding
def test_trained_checkpoint_saves_in_hf_format_and_the_engine_serves_it(process_group, tiny_checkpoint, tmp_path, arch):
    path = tiny_checkpoint(arch)
    policy = Policy(ModelConfig(path=path), OptimConfig(lr=1e-2))
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    prompt_lens = torch.tensor([3, 2])
    response_ids = torch.tensor([[8, 9, 10], [13, 14, 15]])
    logprobs, _ = policy.response_logprobs(input_ids, prompt_lens, response_ids)
    before = logprobs.detach()
    (-logprobs.sum()).backward()
    metrics = policy.optimizer_step()
    assert metrics["grad_norm"] > 0 and metrics["step_skipped"] == 0.0
    with torch.no_grad():
        after, _ = policy.response_logprobs(input_ids, prompt_lens, response_ids)
    assert float((after - before).mean()) > 0.1  # the update raised the likelihood it was asked to

    out = policy.save(str(tmp_path / "saved"))
    assert out == str(tmp_path / "saved")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))

    # The engine loads the saved directory and scores the response tokens as the trained policy does.
    llm = LLM(out, device="cpu", dtype="float32", max_model_len=64)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    served = []
    for row, (ids, plen) in enumerate(zip(input_ids.tolist(), prompt_lens.tolist())):
        result = llm.generate([{"prompt_token_ids": ids[: plen + 3]}], params, use_tqdm=False)[0]
        served.append([result.prompt_logprobs[plen + j][ids[plen + j]].logprob for j in range(3)])
    assert torch.allclose(torch.tensor(served), after, atol=1e-4), (served, after)
