"""Scheduler tests driven by a fake deterministic model runner that also checks the KV it reads."""

from collections import defaultdict

import numpy as np
import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, _ends_in_repetition
from engine.sampling_params import RepetitionDetectionParams, SamplingParams
from engine.wire import FinishReason, LogprobsLists
from engine.worker.runner_output import ModelRunnerOutput

BS = 4


def default_next_token(token_ids):
    return (token_ids[-1] * 7 + len(token_ids)) % 100


class FakeRunner:
    """Keeps per-request state like the real runner and a fake KV cache of (token, position)
    per slot: every step writes the scheduled tokens, then checks that each request reads
    back exactly its own tokens at positions [0, end) through its block table."""

    def __init__(self, block_size=BS, next_token=default_next_token):
        self.block_size = block_size
        self.next_token = next_token
        self.reqs = {}  # req_id -> [token_ids, block_ids, num_computed_tokens]
        self.kv = {}  # slot -> (token_id, position)
        self.new_reqs_seen = []  # NewRequestData of every step

    def slot(self, block_ids, pos):
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out):
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.new_reqs_seen.append(new)
            self.reqs[new.req_id] = [list(new.token_ids), list(new.block_ids), new.num_computed_tokens]
        cached = out.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.reqs[req_id]
            assert state[2] == num_computed
            state[1] += new_block_ids or []
        assert set(out.num_scheduled_tokens) == {n.req_id for n in out.scheduled_new_reqs} | set(cached.req_ids)
        for req_id, num in out.num_scheduled_tokens.items():  # every layer writes first...
            token_ids, block_ids, start = self.reqs[req_id]
            assert num > 0 and start + num <= min(len(token_ids), len(block_ids) * self.block_size)
            for pos in range(start, start + num):
                self.kv[self.slot(block_ids, pos)] = (token_ids[pos], pos)
        req_ids, sampled = [], []
        for req_id, num in out.num_scheduled_tokens.items():  # ...then attention reads
            state = self.reqs[req_id]
            token_ids, block_ids, start = state
            end = start + num
            for pos in range(end):
                assert self.kv[self.slot(block_ids, pos)] == (token_ids[pos], pos), (req_id, pos)
            state[2] = end
            req_ids.append(req_id)
            if end == len(token_ids):
                token_ids.append(self.next_token(token_ids))
                sampled.append([token_ids[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled)


def make_scheduler(num_blocks=64, max_model_len=64, block_size=BS, caching=True, default_token_budget=2048, **sched):
    return Scheduler(
        SchedulerConfig(**sched), CacheConfig(block_size=block_size, enable_prefix_caching=caching), max_model_len,
        num_blocks, default_token_budget=default_token_budget,
    )


def make_request(req_id, token_ids, eos=None, arrival=0.0, priority=0, **params):
    params.setdefault("max_tokens", 8)
    return Request(req_id, token_ids, SamplingParams(**params), eos, arrival_time=arrival, priority=priority)


def run(sched, runner, max_steps=500, on_step=None):
    """Steps until nothing is left; checks the budget every step. Returns tokens and finals."""
    tokens, finals = defaultdict(list), {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.max_num_seqs
        # A request preempted this step (even after its turn came) computes nothing in it.
        assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
        result = sched.update_from_output(out, runner.execute(out))
        if on_step:
            on_step(out, result)
        for o in result.outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
    assert not sched.has_unfinished_requests()
    return dict(tokens), finals


def reference_tokens(prompt, num_tokens):
    token_ids = list(prompt)
    for _ in range(num_tokens):
        token_ids.append(default_next_token(token_ids))
    return token_ids[len(prompt) :]


def test_chunked_prefill_splits_prompt_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", list(range(40)), max_tokens=3))
    steps = []
    tokens, finals = run(sched, FakeRunner(), on_step=lambda out, res: steps.append((out, res)))
    assert [o.num_scheduled_tokens["a"] for o, _ in steps] == [16, 16, 8, 1, 1]
    assert [len(r.outputs) for _, r in steps] == [0, 0, 1, 1, 1]
    assert steps[0][0].scheduled_new_reqs[0].num_computed_tokens == 0
    assert steps[1][0].scheduled_cached_reqs.num_computed_tokens == [16]
    assert tokens["a"] == reference_tokens(range(40), 3)
    assert finals["a"].finish_reason == FinishReason.LENGTH


def test_decodes_and_prefill_chunks_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    sched.add_request(make_request("a", list(range(4)), max_tokens=10))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("b", list(range(50, 90)), max_tokens=2))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    sched.update_from_output(out, runner.execute(out))
    tokens, _ = run(sched, runner)
    assert tokens["a"] == reference_tokens(range(4), 10)[2:]  # two steps ran before run()
    assert tokens["b"] == reference_tokens(range(50, 90), 2)


def test_schedule_before_outputs_arrive_gives_the_coming_sample_a_row():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", list(range(4))))
    sched.add_request(make_request("b", list(range(10, 20))))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 4, "b": 4}
    # "a"'s sample is in flight: the next step computes it at position 4 (async scheduling);
    # "b" is mid-prompt and samples nothing, so it just continues its prompt.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 6}
    assert second.scheduled_cached_reqs.num_computed_tokens == [4, 4]
    assert sched.requests["a"].num_output_placeholders == 2 and sched.requests["b"].num_output_placeholders == 1


def test_running_rows_list_new_block_ids_only_where_blocks_were_appended():
    """As vLLM's CachedRequestData: a row that took no new block has None (most decode steps)."""
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", list(range(6)), max_tokens=8))  # 6 tokens: 2 blocks of 4
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    new_block_ids = []
    for _ in range(3):  # positions 6, 7 fit the blocks it holds; position 8 starts a third block
        out = sched.schedule()
        new_block_ids += out.scheduled_cached_reqs.new_block_ids
        sched.update_from_output(out, runner.execute(out))
    assert new_block_ids[:2] == [None, None] and len(new_block_ids[2]) == 1
    assert new_block_ids[2] == sched.kv_cache_manager.get_block_ids("a")[2:]


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i, i + 1, i + 2], max_tokens=4))
    tokens, finals = run(sched, FakeRunner(), on_step=lambda out, res: None)
    assert len(finals) == 5
    for i in range(5):
        assert tokens[f"r{i}"] == reference_tokens([i, i + 1, i + 2], 4)


def test_default_step_budget_follows_vllms_by_device_and_usage():
    """vLLM's EngineArgs.get_batch_defaults: big GPUs (not A100s) take 16384 offline, 8192 served; smaller GPUs
    8192 / 2048; the CPU and a plain engine 2048; >= 160 GiB 16384 for both."""
    from engine.core.scheduler import default_max_num_batched_tokens as default

    gib = 2**30
    h100 = (80 * gib, "NVIDIA H100 80GB HBM3")
    assert default("llm_class", "cuda", *h100) == 16384
    assert default("api_server", "cuda", *h100) == 8192
    assert default("engine", "cuda", *h100) == 2048
    assert default("llm_class", "cuda", 80 * gib, "NVIDIA A100-SXM4-80GB") == 8192
    assert default("api_server", "cuda", 80 * gib, "NVIDIA A100-SXM4-80GB") == 2048
    assert default("api_server", "cuda", 24 * gib, "NVIDIA L4") == 2048
    assert default("api_server", "cuda", 180 * gib, "NVIDIA B200") == 16384
    assert default("llm_class", "cpu") == default("api_server", "cpu") == 2048
    # An explicit budget wins; the default is raised to max_num_seqs and, without chunked prefill, max_model_len.
    assert make_scheduler(num_blocks=1024, max_model_len=4096, default_token_budget=16384).max_num_batched_tokens == 16384
    assert make_scheduler(max_num_batched_tokens=64, default_token_budget=16384).max_num_batched_tokens == 64
    assert make_scheduler(num_blocks=8192, max_model_len=20000, enable_chunked_prefill=False,
                          default_token_budget=16384).max_num_batched_tokens == 20000


def test_usage_context_is_checked_and_set_by_each_entry_point(tiny_checkpoint):
    from engine import LLM
    from engine.engine_args import create_engine_config

    path = tiny_checkpoint("llama")
    assert create_engine_config(model=path).usage_context == "engine"
    with pytest.raises(ValueError, match="usage_context"):
        create_engine_config(model=path, usage_context="offline")
    llm = LLM(path, device="cpu", max_model_len=64)
    assert llm.config.usage_context == "llm_class"
    assert llm.engine_core.scheduler.max_num_batched_tokens == 2048  # the CPU keeps its default
    llm.shutdown()


def test_the_workers_device_default_is_the_schedulers_budget(tiny_checkpoint, monkeypatch):
    """The budget a worker resolves for its device (a GPU's, here faked on CPU) is what the scheduler hands out:
    a 3 x 1500-token batch then prefills in one step of 4500 tokens, with the outputs of a run given that budget."""
    from engine import LLM, SamplingParams
    from engine.worker.worker import Worker

    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 90 for j in range(1500)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    explicit = LLM(path, device="cpu", max_model_len=2048, max_num_batched_tokens=4608)
    want = [o.outputs[0].token_ids for o in explicit.generate(prompts, params, use_tqdm=False)]
    explicit.shutdown()

    def default_token_budget(self) -> int:  # a GPU's default, as the worker would resolve it there
        return 4608

    monkeypatch.setattr(Worker, "default_token_budget", default_token_budget)
    llm = LLM(path, device="cpu", max_model_len=2048)
    scheduled = []
    step = llm.engine_core.scheduler.schedule
    monkeypatch.setattr(llm.engine_core.scheduler, "schedule",
                        lambda: scheduled.append(out := step()) or out)
    assert llm.engine_core.scheduler.max_num_batched_tokens == 4608
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert scheduled[0].total_num_scheduled_tokens == 4500
    llm.shutdown()


def test_chunked_prefill_disabled():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_model_len=32, max_num_batched_tokens=16, enable_chunked_prefill=False)
    assert make_scheduler(num_blocks=1024, max_model_len=4096, enable_chunked_prefill=False).max_num_batched_tokens == 4096
    assert make_scheduler(num_blocks=1024, max_model_len=4096).max_num_batched_tokens == 2048
    sched = make_scheduler(max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", list(range(10)), max_tokens=2))
    sched.add_request(make_request("b", list(range(20, 30)), max_tokens=2))
    sched.add_request(make_request("c", [1, 2], max_tokens=2))
    out = sched.schedule()
    # "b" does not fit the rest of the budget and is not chunked; "c" waits behind it (FCFS).
    assert out.num_scheduled_tokens == {"a": 10}


def test_rejects_prompts_too_long_and_cache_too_small():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_request("a", list(range(9))))
    with pytest.raises(ValueError, match="prompt"):
        sched.add_request(make_request("a", []))
    with pytest.raises(ValueError, match="num_blocks"):
        make_scheduler(num_blocks=2, max_model_len=9)


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_resumes_with_generated_tokens_and_same_result(caching):
    prompts = {f"r{i}": [i * 10 + j for j in range(6)] for i in range(4)}

    def go(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, max_model_len=32, caching=caching)
        for req_id, prompt in prompts.items():
            sched.add_request(make_request(req_id, prompt, max_tokens=14))
        runner = FakeRunner()
        preempted = []
        tokens, finals = run(sched, runner, on_step=lambda out, res: preempted.extend(out.preempted_req_ids))
        return sched, runner, preempted, tokens, finals

    _, _, preempted, expected, _ = go(num_blocks=64)
    assert preempted == []
    sched, runner, preempted, tokens, finals = go(num_blocks=8)
    assert preempted and sched.num_preemptions == len(preempted)
    assert tokens == expected
    assert all(f.finish_reason == FinishReason.LENGTH for f in finals.values())
    # A resumed request travels in full, carrying the tokens it generated before preemption.
    resumed = [n for n in runner.new_reqs_seen if len(n.token_ids) > n.num_prompt_tokens]
    assert resumed
    for new in resumed:
        prompt = prompts[new.req_id]
        assert new.token_ids == prompt + expected[new.req_id][: len(new.token_ids) - len(prompt)]
    assert sched.kv_cache_manager.usage == 0.0


def test_priority_policy_orders_waiting_requests():
    sched = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    for req_id, priority, arrival in [("c", 3, 0.0), ("a", 1, 1.0), ("b", 2, 2.0), ("a2", 1, 3.0)]:
        sched.add_request(make_request(req_id, [1, 2, 3], priority=priority, arrival=arrival, max_tokens=2))
    order = []
    run(sched, FakeRunner(), on_step=lambda out, res: order.extend(o.request_id for o in res.outputs if o.finished))
    assert order == ["a", "a2", "b", "c"]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_preemption_picks_lowest_priority(policy, victim):
    # 6 blocks of 4: both requests cannot reach 20 tokens at once.
    sched = make_scheduler(num_blocks=6, max_model_len=24, scheduling_policy=policy)
    runner = FakeRunner()
    sched.add_request(make_request("low", list(range(8)), priority=5, arrival=0.0, max_tokens=12))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("high", list(range(50, 58)), priority=0, arrival=1.0, max_tokens=12))
    preempted = []
    tokens, _ = run(sched, runner, on_step=lambda out, res: preempted.extend(out.preempted_req_ids))
    assert preempted[0] == victim
    assert tokens["high"] == reference_tokens(range(50, 58), 12)
    assert tokens["low"] == reference_tokens(range(8), 12)[1:]  # its first token came before run()


def test_abort_frees_blocks_and_reports_finished_ids():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    sched.add_request(make_request("a", list(range(10))))
    sched.add_request(make_request("b", list(range(10))))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert sched.kv_cache_manager.usage > 0
    finished = sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"a", "b"}
    assert all(r.get_finish_reason() == FinishReason.ABORT for r in finished)
    assert sched.finish_requests("a", RequestStatus.FINISHED_ABORTED) == []
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty
    assert sched.schedule().finished_req_ids == set()


def scripted(outputs):
    """A runner whose i-th sampled token of a request is outputs[i] (after the prompt)."""
    prompt_len = {}

    def next_token(token_ids):
        key = token_ids[0]
        prompt_len.setdefault(key, len(token_ids))
        return outputs[len(token_ids) - prompt_len[key]]

    return FakeRunner(next_token=next_token)


@pytest.mark.parametrize(
    "params, eos, expected_tokens, reason, stop_reason",
    [
        (dict(max_tokens=10), 9, [1, 2, 9], FinishReason.STOP, None),
        (dict(max_tokens=10, min_tokens=4), 9, [1, 2, 9, 4, 9], FinishReason.STOP, None),
        (dict(max_tokens=10, ignore_eos=True), 9, [1, 2, 9, 4, 9, 5, 6, 7, 8, 8], FinishReason.LENGTH, None),
        (dict(max_tokens=10, stop_token_ids=[4]), None, [1, 2, 9, 4], FinishReason.STOP, 4),
        (dict(max_tokens=10, stop_token_ids=[4], min_tokens=5), None, [1, 2, 9, 4, 9, 5, 6, 7, 8, 8], FinishReason.LENGTH, None),
        (dict(max_tokens=3), None, [1, 2, 9], FinishReason.LENGTH, None),
        (dict(max_tokens=None), None, [1, 2, 9, 4, 9, 5], FinishReason.LENGTH, None),  # max_model_len 8
    ],
)
def test_stop_conditions(params, eos, expected_tokens, reason, stop_reason):
    sched = make_scheduler(max_model_len=8 if params["max_tokens"] is None else 64)
    sched.add_request(make_request("a", [100, 101], eos=eos, **params))
    tokens, finals = run(sched, scripted([1, 2, 9, 4, 9, 5, 6, 7, 8, 8, 8, 8]))
    assert tokens["a"] == expected_tokens
    assert finals["a"].finish_reason == reason and finals["a"].stop_reason == stop_reason


def test_repetition_detection():
    params = RepetitionDetectionParams(max_pattern_size=3, min_count=3)
    assert _ends_in_repetition([5, 1, 2, 3, 1, 2, 3, 1, 2, 3], params)
    assert not _ends_in_repetition([1, 2, 3, 1, 2, 3], params)
    assert _ends_in_repetition([4, 7, 7, 7], params)
    assert not _ends_in_repetition([4, 7, 7, 7], RepetitionDetectionParams(max_pattern_size=3, min_count=3, min_pattern_size=2))

    sched = make_scheduler()
    sched.add_request(make_request("a", [100], max_tokens=30, repetition_detection=params))
    tokens, finals = run(sched, scripted([5, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]))
    assert tokens["a"] == [5, 1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert finals["a"].finish_reason == FinishReason.REPETITION


def test_prefix_hits_same_step_and_later_with_correct_kv():
    sched = make_scheduler(max_num_batched_tokens=64)
    prompt = list(range(13))
    sched.add_request(make_request("a", prompt, max_tokens=3))
    sched.add_request(make_request("b", prompt, eos=5, max_tokens=3))  # hits blocks "a" registers this step
    runner = FakeRunner()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 13, "b": 1}
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 12]
    assert [n.eos_token_id for n in out.scheduled_new_reqs] == [None, 5]
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("c", prompt + [77], max_tokens=3))
    tokens, finals = run(sched, runner)
    assert tokens["a"] == tokens["b"] == reference_tokens(prompt, 3)[1:]  # first tokens came before run()
    assert tokens["c"] == reference_tokens(prompt + [77], 3)
    assert finals["b"].num_cached_tokens == 12 and finals["c"].num_cached_tokens == 12
    assert finals["a"].num_cached_tokens == 0


def test_prompt_logprobs_are_emitted_mid_prompt():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", list(range(12)), prompt_logprobs=0, max_tokens=1))
    out = sched.schedule()
    lp = LogprobsLists(np.ones((8, 1), np.int64), np.full((8, 1), -0.5, np.float32), np.ones(8, np.int64))
    result = sched.update_from_output(out, ModelRunnerOutput(["a"], [[]], prompt_logprobs={"a": lp}))
    (o,) = result.outputs
    assert o.new_token_ids == [] and o.new_prompt_logprobs is lp and not o.finished


def test_stats():
    sched = make_scheduler(num_blocks=8, max_model_len=32, max_num_seqs=2)
    runner = FakeRunner()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", list(range(9)), max_tokens=14))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 8)  # r0: 3 blocks; r1 shares 2 and adds 1
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert sched.make_stats().prefix_cache_queries == 0
    step_counts = []
    run(sched, runner, on_step=lambda out, res: step_counts.append(sched.make_stats().step_num_preemptions))
    assert sum(step_counts) == sched.num_preemptions > 0
    assert sched.make_stats().num_preemptions == sched.num_preemptions


def check_block_invariants(sched):
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    refs = defaultdict(int)
    for blocks in kv.req_to_blocks.values():
        for block in blocks:
            refs[block.block_id] += 1
    assert set(kv.req_to_blocks) <= {r.request_id for r in sched.running}
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id]
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue)
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_matches_reference(seed):
    import random

    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=rng.choice([10, 16, 40]),
        max_model_len=40,
        max_num_batched_tokens=rng.choice([8, 24, 64]) if seed % 3 else 40,
        max_num_seqs=rng.choice([2, 4, 8]),
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        enable_chunked_prefill=seed % 3 != 0,
        caching=rng.random() < 0.7,
    )
    runner = FakeRunner()
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(2)]
    prompts, max_tokens, aborted = {}, {}, set()
    tokens, finals = defaultdict(list), {}
    for step in range(2000):
        if step < 40 and rng.random() < 0.5:
            req_id = f"r{step}"
            prompts[req_id] = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(100) for _ in range(rng.randrange(0, 10))]
            max_tokens[req_id] = rng.randrange(1, 15)
            sched.add_request(make_request(req_id, prompts[req_id], priority=rng.randrange(3), arrival=step, max_tokens=max_tokens[req_id]))
        if rng.random() < 0.03 and sched.requests:
            req_id = rng.choice(sorted(sched.requests))
            aborted.add(req_id)
            sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for o in sched.update_from_output(out, runner.execute(out)).outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
        check_block_invariants(sched)
        if step >= 40 and not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    for req_id, prompt in prompts.items():
        expected = reference_tokens(prompt, min(max_tokens[req_id], 40 - len(prompt)))
        if req_id in aborted:
            assert tokens[req_id] == expected[: len(tokens[req_id])]
        else:
            assert tokens[req_id] == expected and finals[req_id].finish_reason == FinishReason.LENGTH
    assert sched.kv_cache_manager.usage == 0.0
