"""The trainer's engine-kernel forward (trainers/invariant_forward.py) on CPU: the HF model's logprobs from the
engine's decoder built over the trainer's (FSDP2) parameters, the exact straight-through in Policy.response_logprobs,
and the config switch. The bit-for-bit claim against the engine is CUDA's: tests/gpu/test_bitwise_on_policy_gpu.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.loader import load_hf_config
from trainers.config import LoRAConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig
from trainers.invariant_forward import InvariantForward, check_supported, engine_token_logprobs, straight_through
from trainers.policy import Policy, init_distributed


@pytest.fixture
def group(process_group):
    init_distributed("cpu")


def batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.tensor([5, 9, 3])
    resp_lens = [7, 4, 10]
    length = int(max(p + r for p, r in zip(prompt_lens.tolist(), resp_lens)))
    input_ids = torch.full((3, length), 0, dtype=torch.int64)
    response_ids = torch.zeros(3, max(resp_lens), dtype=torch.int64)
    for b, (p, r) in enumerate(zip(prompt_lens.tolist(), resp_lens)):
        seq = torch.randint(3, vocab, (p + r,), generator=g)
        input_ids[b, : p + r] = seq
        response_ids[b, :r] = seq[p:]
    mask = torch.zeros(3, max(resp_lens))
    for b, r in enumerate(resp_lens):
        mask[b, :r] = 1.0
    return input_ids, prompt_lens, response_ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_invariant_forward_reproduces_the_hf_model_on_fsdp_parameters(group, tiny_checkpoint, arch, temperature):
    path = tiny_checkpoint(arch)
    policy = Policy(ModelConfig(path=path, invariant_forward=False), OptimConfig())
    assert all(type(p).__name__ == "DTensor" for p in policy.model.parameters())
    forward = InvariantForward(policy.model, load_hf_config(path), torch.float32, policy.device)
    input_ids, prompt_lens, response_ids, mask = batch(policy.model.config.vocab_size)
    with torch.no_grad():
        want, want_entropy = policy.response_logprobs(input_ids, prompt_lens, response_ids, temperature=temperature,
                                                      with_entropy=True)
    got, entropy = forward.response_logprobs(input_ids, prompt_lens, response_ids, temperature, with_entropy=True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float(((got - want).abs() * mask).max()) < 1e-4
    assert float(((entropy - want_entropy).abs() * mask).max()) < 1e-4
    # A sequence's rows do not depend on the padding after it or on the other sequences (causal, per row).
    alone, _ = forward.response_logprobs(input_ids[1:2, :13], prompt_lens[1:2], response_ids[1:2, :4], temperature)
    assert float((alone - got[1:2, :4]).abs().max()) < 1e-5


def test_engine_token_logprobs_is_the_sampler_arithmetic():
    logits = torch.randn(5, 33).bfloat16()
    tokens = torch.randint(0, 33, (5,))
    chosen, logp = engine_token_logprobs(logits, tokens, 0.7)
    want = torch.div(logits, torch.full((5, 1), 0.7)).float().log_softmax(-1)  # tensor division, as apply_temperature
    assert torch.equal(logp, want) and torch.equal(chosen, want.gather(1, tokens[:, None]).squeeze(1))
    greedy, _ = engine_token_logprobs(logits, tokens, 1.0)  # greedy rows: the plain float32 copy
    assert torch.equal(greedy, logits.float().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1))


def test_policy_switch_returns_the_invariant_values_with_the_hf_gradient(group, tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    policy = Policy(ModelConfig(path=path, invariant_forward=True), OptimConfig(lr=1e-2))
    assert policy.invariant is not None
    input_ids, prompt_lens, response_ids, mask = batch(policy.model.config.vocab_size, seed=1)
    exact, exact_entropy = policy.invariant.response_logprobs(input_ids, prompt_lens, response_ids, 0.7, True)
    with torch.no_grad():
        no_grad, _ = policy.response_logprobs(input_ids, prompt_lens, response_ids, temperature=0.7)
    assert torch.equal(no_grad, exact)
    logprobs, entropy = policy.response_logprobs(input_ids, prompt_lens, response_ids, temperature=0.7,
                                                 with_entropy=True)
    assert torch.equal(logprobs.detach(), exact) and torch.equal(entropy.detach(), exact_entropy)
    assert logprobs.requires_grad and entropy.requires_grad
    (-(logprobs * mask).sum() - (entropy * mask).sum()).backward()
    grads = [p.grad.full_tensor().clone() for p in policy.model.parameters()]
    policy.optimizer.zero_grad(set_to_none=True)
    # The gradient is exactly the HF forward's.
    policy.invariant, saved = None, policy.invariant
    hf, hf_entropy = policy.response_logprobs(input_ids, prompt_lens, response_ids, temperature=0.7, with_entropy=True)
    (-(hf * mask).sum() - (hf_entropy * mask).sum()).backward()
    for got, p in zip(grads, policy.model.parameters()):
        assert torch.equal(got, p.grad.full_tensor())
    assert any(float(g.abs().max()) > 0 for g in grads)
    policy.invariant = saved


def test_straight_through_is_exact_and_checks_shapes():
    source = torch.randn(4, requires_grad=True)
    value = torch.randn(4)
    out = straight_through(source * 2, value)
    assert torch.equal(out.detach(), value)
    out.sum().backward()
    assert torch.equal(source.grad, torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="shapes differ"):
        straight_through(source, torch.randn(3))


def test_close_to_the_cpu_engine(group, tiny_checkpoint):
    # On CPU the engine runs its own kernels (C attention), so close, not equal; on CUDA they are equal.
    path = tiny_checkpoint("llama")
    policy = Policy(ModelConfig(path=path, invariant_forward=True), OptimConfig())
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, logprobs_mode="processed_logprobs")
    from trainers.rollouts import generate_rollouts

    rollouts = generate_rollouts(llm, ["The quick brown fox", "12+35="], n=2, temperature=0.8, max_tokens=8, seed=3)
    with torch.no_grad():
        got, _ = policy.response_logprobs(rollouts.input_ids, rollouts.prompt_lens, rollouts.response_ids,
                                          temperature=0.8)
    assert float(((got - rollouts.rollout_logprobs).abs() * rollouts.response_mask).max()) < 1e-4
    llm.engine_core.shutdown()


def test_config_switch_follows_the_engine_mode(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    on = TrainerConfig(model=ModelConfig(path=path), rollout=RolloutConfig(batch_invariant=True))
    assert on.model.invariant_forward
    assert not TrainerConfig(model=ModelConfig(path=path)).model.invariant_forward
    assert not TrainerConfig(model=ModelConfig(path=path), rollout=RolloutConfig(batch_invariant=True),
                             lora=LoRAConfig(rank=4)).model.invariant_forward
    off = TrainerConfig(model=ModelConfig(path=path, invariant_forward=False),
                        rollout=RolloutConfig(batch_invariant=True))
    assert off.model.invariant_forward is False
    with pytest.raises(ValueError, match="model.invariant_forward"):
        TrainerConfig(model=ModelConfig(path=path, invariant_forward=True), lora=LoRAConfig(rank=4))
    with pytest.raises(ValueError, match="model.invariant_forward"):
        check_supported(load_hf_config(tiny_checkpoint("qwen3_moe")))
