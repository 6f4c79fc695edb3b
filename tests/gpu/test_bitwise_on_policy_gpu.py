"""Bitwise on-policy on the GPU (issue 28): in batch-invariant mode a request's tokens AND logprobs are bit-identical
alone, in a batch of 64, after prefix-cache hits, under chunked prefill, after a preemption and with each speculator;
and the trainer's engine-kernel forward (trainers/invariant_forward.py) gives the engine's logprobs exactly."""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.distributed as dist

from engine import LLM, SamplingParams
from engine.attention import torch_ref
from engine.attention.metadata import AttentionMetadata
from engine.kernels import batch_invariant
from engine.kernels.attention import paged_attention_invariant
from trainers.invariant_forward import engine_token_logprobs

pytestmark = pytest.mark.gpu
DEV = "cuda"
MAX_TOKENS = 24


@pytest.fixture(autouse=True)
def _restore_mode():
    """The mode is process-wide and an engine switches it on: later tests of the session get it back as it was."""
    before = batch_invariant.batch_invariant()
    yield
    batch_invariant.set_batch_invariant(before)


# ---- kernels ----------------------------------------------------------------------------------------


def _attention_rows(reqs, q_heads, kv_heads, d, block_size, layout_seed, dtype):
    """reqs: [(q [S, H, D], k, v, query_start, seq_len)] -> each request's output rows (paged_attention_invariant)."""
    num_blocks = sum(-(-r[4] // block_size) for r in reqs) + 8
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(layout_seed)).tolist()
    cache = torch.full((2, num_blocks, block_size, kv_heads, d), float("nan"), dtype=dtype, device=DEV)
    tables, qs, query_lens, seq_lens = [], [], [], []
    for q, k, v, start, seq_len in reqs:
        n = -(-seq_len // block_size)
        row, perm = perm[:n], perm[n:]
        blocks = torch.tensor(row, device=DEV)
        pos = torch.arange(seq_len, device=DEV)
        cache[0, blocks[pos // block_size], pos % block_size] = k[:seq_len]
        cache[1, blocks[pos // block_size], pos % block_size] = v[:seq_len]
        tables.append(row)
        qs.append(q[start:seq_len])
        query_lens.append(seq_len - start)
        seq_lens.append(seq_len)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=DEV)
    query = torch.cat(qs)
    out = paged_attention_invariant(query, cache, md, d**-0.5)
    ref = torch_ref.paged_attention(query.float(), cache.float().nan_to_num(0.0), md, d**-0.5)
    bounds = md.query_start_loc.tolist()
    return [out[a:b] for a, b in zip(bounds, bounds[1:])], [ref[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("q_heads, kv_heads, d", [(16, 8, 128), (4, 2, 32), (14, 2, 64)])  # Qwen3-0.6B, tiny, 1.5B
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_attention_row_is_the_same_however_its_keys_arrived(q_heads, kv_heads, d, dtype):
    torch.manual_seed(0)
    seq = 700
    q_all = torch.randn(seq, q_heads, d, device=DEV, dtype=dtype)
    k_all = torch.randn(seq, kv_heads, d, device=DEV, dtype=dtype)
    v_all = torch.randn(seq, kv_heads, d, device=DEV, dtype=dtype)

    def ours(start, end):
        return (q_all, k_all, v_all, start, end)

    (full,), (ref,) = _attention_rows([ours(0, seq)], q_heads, kv_heads, d, 16, 1, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert not torch.isnan(full).any()
    torch.testing.assert_close(full.float(), ref, rtol=tol, atol=tol)

    def check(rows, start, what):
        bad = (rows != full[start:start + rows.shape[0]]).flatten(1).any(1).nonzero().flatten().tolist()
        assert not bad, f"{what}: positions {[start + i for i in bad][:8]} differ from the one-prefill rows"

    for cached in (1, 15, 16, 17, 63, 64, 65, 100, 255, 256, 511, 699):  # prefix-cache hits
        for block_size in (16, 32):  # and another block layout
            (rows,), _ = _attention_rows([ours(cached, seq)], q_heads, kv_heads, d, block_size, cached, dtype)
            check(rows, cached, f"after a cached prefix of {cached} (block size {block_size})")
    for bounds in ((0, 37, 300, 700), (0, 64, 128, 512, 700), (0, 1, 2, 333, 699, 700)):  # chunked prefill
        for a, b in zip(bounds, bounds[1:]):
            (rows,), _ = _attention_rows([ours(a, b)], q_heads, kv_heads, d, 16, a, dtype)
            check(rows, a, f"chunk [{a}, {b})")
    for pos in (0, 1, 63, 64, 65, 127, 128, 500, 699):  # decode rows
        (rows,), _ = _attention_rows([ours(pos, pos + 1)], q_heads, kv_heads, d, 16, pos, dtype)
        check(rows, pos, f"decode at {pos}")
    for start in (60, 124, 400, 695):  # verify rows: a few tokens over a long context
        (rows,), _ = _attention_rows([ours(start, start + 5)], q_heads, kv_heads, d, 16, start, dtype)
        check(rows, start, f"verify at {start}")
    g = torch.Generator(device=DEV).manual_seed(1)

    def other(n, start):
        return (torch.randn(n, q_heads, d, device=DEV, generator=g).to(dtype),
                torch.randn(n, kv_heads, d, device=DEV, generator=g).to(dtype),
                torch.randn(n, kv_heads, d, device=DEV, generator=g).to(dtype), start, n)

    mates = [other(300, 0), other(90, 89), other(260, 250), other(40, 5)] + [other(50 + i, 49 + i) for i in range(60)]
    # In mixed steps of up to 65 requests.
    for index, (a, b) in enumerate(((0, seq), (300, seq), (699, seq), (400, 404))):
        reqs = mates[: 16 * index] + [ours(a, b)] + mates[16 * index:]
        outs, refs = _attention_rows(reqs, q_heads, kv_heads, d, 16, 100 + index, dtype)
        check(outs[16 * index], a, f"in a mixed step at index {16 * index}, [{a}, {b})")
        for got, want in zip(outs, refs):
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("vocab, hidden", [(151936, 1024), (1000, 64)])
def test_lm_head_and_logprob_rows_do_not_depend_on_the_row_count(vocab, hidden):
    torch.manual_seed(0)
    x = torch.randn(131, hidden, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=DEV, dtype=torch.bfloat16) / hidden**0.5
    tokens = torch.randint(0, vocab, (131,), device=DEV)
    logits = batch_invariant.linear_invariant(x, w)
    chosen, _ = engine_token_logprobs(logits, tokens, 0.7)
    for rows in (slice(7, 8), slice(0, 5), slice(60, 131), slice(64, 128)):
        part = batch_invariant.linear_invariant(x[rows], w)
        assert torch.equal(part, logits[rows])
        assert torch.equal(engine_token_logprobs(part, tokens[rows], 0.7)[0], chosen[rows])
    # The engine's LM head takes the invariant GEMM in this mode.
    from engine.models.layers import LMHead

    head = LMHead(vocab, hidden).to(DEV, torch.bfloat16)
    head.weight.data.copy_(w)
    batch_invariant.set_batch_invariant(True)
    try:
        assert torch.equal(head(x[7:8]), logits[7:8]) and torch.equal(head(x), logits)
    finally:
        batch_invariant.set_batch_invariant(False)


# ---- engine -----------------------------------------------------------------------------------------


def _llm(path, **kw):
    args = dict(device=DEV, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=1 << 28, max_num_seqs=64,
                batch_invariant=True, logprobs_mode="processed_logprobs")
    args.update(kw)
    return LLM(path, **args)


def _shutdown(llm):
    llm.engine_core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _params(i: int, greedy: bool = False) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, seed=1000 + i)


def _results(outputs):
    """[(token ids, their logprobs)] per request: the logprob of each sampled token, as returned."""
    out = []
    for o in outputs:
        c = o.outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return out


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:  # a repeated phrase, so n-gram drafts get accepted
            out.append([rng.randrange(3, vocab) for _ in range(9)] * rng.randint(3, 12))
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randint(4, 200))])
    return out


def _alone(llm, prompts, greedy=False, indices=None):
    # One request per generate call, after a reset: nothing cached, nothing beside it. indices: the requests'
    # places in the batch they are compared with (their seeds are keyed by it).
    indices = range(len(prompts)) if indices is None else indices
    got = []
    for i, p in zip(indices, prompts):
        llm.engine_core.scheduler.reset_prefix_cache()
        got += _results(llm.generate([{"prompt_token_ids": p}], _params(i, greedy), use_tqdm=False))
    return got


def _batched(llm, prompts, greedy=False, indices=None):
    indices = range(len(prompts)) if indices is None else indices
    return _results(llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i, greedy) for i in indices],
                                 use_tqdm=False))


def _same(got, want, what):
    for i, ((tg, lg), (tw, lw)) in enumerate(zip(got, want)):
        assert tg == tw, f"{what}: request {i} tokens differ"
        assert lg == lw, f"{what}: request {i} logprobs differ (max |d| {max(abs(a - b) for a, b in zip(lg, lw))})"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("greedy", [False, True])
def test_tokens_and_logprobs_bit_identical_across_batching_cache_hits_chunking_and_preemption(tiny_checkpoint, arch,
                                                                                             greedy):
    path = tiny_checkpoint(arch)
    llm = _llm(path)
    vocab = llm.engine_core.vocab_size
    prompts = _prompts(vocab, 64, seed=3)
    probe = list(range(0, 64, 8))  # requests checked alone (8 of the 64, all lengths and kinds)
    alone = _alone(llm, [prompts[i] for i in probe], greedy, indices=probe)
    # Alone vs a batch of 64 (parameters keyed by the request's index, so seeds match).
    llm.engine_core.scheduler.reset_prefix_cache()
    batch = _batched(llm, prompts, greedy)
    _same([batch[i] for i in probe], alone, "in a batch of 64")
    # The same 64 again: every prompt now hits the prefix cache (all its full blocks).
    hits_before = llm.engine_core.scheduler.kv_cache_manager.total_prefix_cache_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(i, greedy) for i in range(64)],
                         use_tqdm=False)
    assert llm.engine_core.scheduler.kv_cache_manager.total_prefix_cache_hits > hits_before
    assert sum(o.num_cached_tokens > 0 for o in again) > 32
    _same(_results(again), batch, "the batch of 64 again, from the prefix cache")
    # Prefix-cache hits of several lengths: a prompt sharing the first c tokens runs first, then the probe.
    long_prompt = [t for p in prompts for t in p][:190]
    (want,) = _alone(llm, [long_prompt], greedy)
    hit_lengths = set()
    for shared in (16, 17, 40, 64, 100, 150, 189, 190):
        llm.engine_core.scheduler.reset_prefix_cache()
        warm = long_prompt[:shared] + [3 + (t * 7) % (vocab - 3) for t in range(20)]
        llm.generate([{"prompt_token_ids": warm}], _params(99, greedy), use_tqdm=False)
        (out,) = llm.generate([{"prompt_token_ids": long_prompt}], _params(0, greedy), use_tqdm=False)
        assert out.num_cached_tokens >= 16, shared  # whole blocks of the shared part come from the cache
        hit_lengths.add(out.num_cached_tokens)
        _same(_results([out]), [want], f"after a prefix-cache hit of {out.num_cached_tokens} ({shared} shared)")
    assert len(hit_lengths) >= 5, hit_lengths
    _shutdown(llm)

    # Chunked prefill: small token budgets put chunk boundaries everywhere; no prefix cache.
    for budget in (16, 48):
        chunked = _llm(path, max_num_batched_tokens=budget, enable_prefix_caching=False, max_num_seqs=16)
        got = _batched(chunked, [prompts[i] for i in probe], greedy, indices=probe)
        _same(got, alone, f"chunked prefill, max_num_batched_tokens={budget}")
        _shutdown(chunked)

    # Preemption: a KV cache far smaller than the requests need, so some are preempted and recomputed.
    tight = _llm(path, num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
    got = _batched(tight, [prompts[i] for i in probe], greedy, indices=probe)
    assert tight.engine_core.scheduler.num_preemptions > 0, "the KV cache was meant to be small enough to preempt"
    _same(got, alone, "with preemptions")
    _shutdown(tight)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("greedy", [True, False])
def test_tokens_and_logprobs_bit_identical_with_each_speculator(tiny_checkpoint, arch, greedy):
    path = tiny_checkpoint(arch)
    other = tiny_checkpoint("qwen3" if arch == "llama" else "llama")
    plain = _llm(path, max_num_seqs=16)
    prompts = _prompts(plain.engine_core.vocab_size, 12, seed=5)
    want = _batched(plain, prompts, greedy)
    _shutdown(plain)
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "draft_same": {"method": "draft_model", "num_speculative_tokens": 3, "model": path},
        "draft_other": {"method": "draft_model", "num_speculative_tokens": 3, "model": other},
    }
    for name, config in configs.items():
        spec = _llm(path, max_num_seqs=16, speculative_config=config)
        _same(_batched(spec, prompts, greedy), want, name)
        totals = spec.engine_core.scheduler.spec_totals
        assert totals.num_drafts > 0, name
        if greedy and name == "draft_same":  # the same model drafts what the target verifies
            assert totals.num_accepted_tokens == totals.num_draft_tokens, name
        _shutdown(spec)


# ---- trainer forward --------------------------------------------------------------------------------


@pytest.fixture
def nccl_group():
    from trainers.policy import init_distributed

    created = not dist.is_initialized()
    init_distributed("cuda")
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _masked_max(a, b, mask):
    return float(((a.float().cpu() - b.float().cpu()).abs() * mask).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_trainer_forward_reproduces_the_engine_logprobs_exactly(nccl_group, tiny_checkpoint, arch):
    from trainers.config import ModelConfig, OptimConfig
    from trainers.policy import Policy
    from trainers.rollouts import generate_rollouts

    path = tiny_checkpoint(arch)
    llm = _llm(path, max_num_seqs=64)
    vocab = llm.engine_core.vocab_size
    prompts = [{"prompt_token_ids": p} for p in _prompts(vocab, 64, seed=7)]  # 256 rollouts
    # n = 4 samples per prompt: the first computes the prompt, the others hit the prefix cache (as GRPO's groups do).
    rollouts = generate_rollouts(llm, prompts, n=4, temperature=0.8, max_tokens=MAX_TOKENS, seed=11)
    assert llm.engine_core.scheduler.kv_cache_manager.total_prefix_cache_hits > 0
    _shutdown(llm)
    mask = rollouts.response_mask
    assert mask.sum() > 0.9 * mask.numel()

    model_config = ModelConfig(path=path, device="cuda", param_dtype="bfloat16", invariant_forward=True)
    policy = Policy(model_config, OptimConfig())
    with torch.no_grad():
        got, _ = policy.response_logprobs(rollouts.input_ids, rollouts.prompt_lens, rollouts.response_ids,
                                          temperature=0.8)
    assert _masked_max(got, rollouts.rollout_logprobs, mask) == 0.0
    # The HF forward (the switch off) is close but not exact: what the switch buys.
    invariant, policy.invariant = policy.invariant, None
    with torch.no_grad():
        hf, _ = policy.response_logprobs(rollouts.input_ids, rollouts.prompt_lens, rollouts.response_ids,
                                         temperature=0.8)
    assert 0.0 < _masked_max(hf, rollouts.rollout_logprobs, mask) < 0.5
    policy.invariant = invariant
    # With autograd on: the same values (straight-through), and a gradient to train on.
    logprobs, _ = policy.response_logprobs(rollouts.input_ids, rollouts.prompt_lens, rollouts.response_ids,
                                           temperature=0.8)
    assert logprobs.requires_grad
    assert _masked_max(logprobs.detach(), rollouts.rollout_logprobs, mask) == 0.0
    (-(logprobs * mask.to(logprobs.device)).sum()).backward()
    assert policy.optimizer_step()["grad_norm"] > 0


def _vowel_fraction(completion: str, item) -> float:
    return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)


@pytest.mark.parametrize("arch", ["qwen3"])
def test_grpo_with_the_invariant_mode_has_zero_mismatch_at_every_step(nccl_group, tiny_checkpoint, tmp_path, arch):
    """The issue's GRPO check: engine batch-invariant, trainer's engine-kernel forward on (its default then), weights
    synced every step; every step's samples are scored by the trainer exactly as the engine scored them."""
    from trainers.common import single_reward
    from trainers.config import AlgorithmConfig, LoggingConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig
    from trainers.grpo import GRPOTrainer

    config = TrainerConfig(
        model=ModelConfig(path=tiny_checkpoint(arch), device="cuda", param_dtype="bfloat16"),
        rollout=RolloutConfig(num_prompts_per_step=4, num_samples_per_prompt=4, max_tokens=16, max_model_len=256,
                              batch_invariant=True, gpu_memory_utilization=0.3),
        algorithm=AlgorithmConfig(mismatch="tis"),
        optim=OptimConfig(lr=1e-3),
        logging=LoggingConfig(output_dir=str(tmp_path / "run"), save_final=False),
        num_steps=3,
    )
    assert config.model.invariant_forward  # on by default with the engine batch-invariant
    prompts = ["The quick brown fox", "Once upon a time", "12+35=", "Numbers appear too:"]
    with GRPOTrainer(config, single_reward(_vowel_fraction), log=lambda m, s: None) as trainer:
        history = trainer.train(prompts)
    assert len(history) == 3
    for step, metrics in enumerate(history, start=1):
        assert metrics["mismatch/kl"] == 0.0, (step, metrics["mismatch/kl"])
        assert metrics["mismatch/abs"] == 0.0, (step, metrics["mismatch/abs"])
        assert metrics["is_weight_mean"] == 1.0, (step, metrics["is_weight_mean"])
        assert metrics["grad_norm"] > 0, step
