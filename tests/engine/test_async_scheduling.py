"""Async scheduling (one step in flight) gives exactly the outputs of synchronous scheduling."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.config import CacheConfig, SchedulerConfig
from engine.worker.runner_output import ModelRunnerOutput


def make_llm(path, async_scheduling, **kw):
    kw = {"max_model_len": 256, **kw}
    return LLM(path, dtype="float32", device="cpu", async_scheduling=async_scheduling, **kw)


def workload(vocab_size, stop_tokens, with_history=False):
    """Prompts and params covering what a step in flight must get right; with_history adds
    requests whose sampling reads their output so far (no step may be in flight while they run)."""
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(14):
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 40))]})
        kind = i % 7
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True, logprobs=2))
        elif kind == 2:  # stops on a token the sync run produced mid-way: the next step is in flight then
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tokens[i]]))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.8, seed=100 + i, max_tokens=18, min_tokens=4, n=2))
        elif kind == 4:
            params.append(SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
        elif kind == 5:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=16, top_k=5, top_p=0.9))
        elif not with_history:
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        else:  # reads its output so far: the engine steps with no step in flight while it runs
            params.append(SamplingParams(temperature=0, max_tokens=16, repetition_penalty=2.0, frequency_penalty=1.5))
    return prompts, params


PROBE_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def workload_with_stops(llm, with_history=False):
    """(probe prompts, llm's greedy outputs for them, prompts, params): the workload whose stop tokens are
    the 5th greedy token of each prompt, so those requests stop mid-generation."""
    vocab = llm.engine_core.vocab_size
    probe, _ = workload(vocab, [0] * 14)
    greedy = llm.generate(probe, PROBE_PARAMS, use_tqdm=False)
    prompts, params = workload(vocab, [o.outputs[0].token_ids[4] for o in greedy], with_history)
    return probe, greedy, prompts, params


def flatten(outputs):
    rows = []
    for out in outputs:
        for c in out.outputs:
            lps = None if c.logprobs is None else [sorted((k, round(v.logprob, 4)) for k, v in d.items()) for d in c.logprobs]
            rows.append((out.request_id, c.index, list(c.token_ids), c.finish_reason, c.stop_reason, lps))
        plp = None if out.prompt_logprobs is None else [
            None if d is None else sorted((k, round(v.logprob, 4)) for k, v in d.items()) for d in out.prompt_logprobs]
        rows.append((out.request_id, "prompt", plp))
    return rows


@pytest.mark.parametrize("num_blocks, with_history", [(None, False), (10, False), (None, True)])
def test_async_outputs_equal_sync_outputs(tiny_checkpoint, num_blocks, with_history):
    """10 blocks of 16 tokens: running requests get preempted, some with a step in flight."""
    path = tiny_checkpoint("llama")
    kw = {"max_num_seqs": 6}
    if num_blocks:
        kw.update(num_gpu_blocks_override=num_blocks, max_model_len=128)
    sync_llm = make_llm(path, False, **kw)
    probe, _, prompts, params = workload_with_stops(sync_llm, with_history)
    expected = flatten(sync_llm.generate(prompts, params, use_tqdm=False))
    assert sync_llm.engine_core.async_scheduling is False
    sync_llm.engine_core.shutdown()

    async_llm = make_llm(path, True, **kw)
    core = async_llm.engine_core
    assert core.async_scheduling
    launches_with_a_step_in_flight = 0
    launch = core.executor.launch_model

    def counting_launch(sched):
        nonlocal launches_with_a_step_in_flight
        launches_with_a_step_in_flight += core._in_flight is not None
        return launch(sched)

    core.executor.launch_model = counting_launch
    async_llm.generate(probe, PROBE_PARAMS, use_tqdm=False)
    got = flatten(async_llm.generate(prompts, params, use_tqdm=False))
    stopped = [r for r in got if r[1] == 0 and r[3] == "stop"]
    assert stopped, "some requests stop on their stop token"
    assert got == expected
    assert launches_with_a_step_in_flight > 10  # the overlap really happened
    if num_blocks:
        assert core.scheduler.num_preemptions > 0
    assert not core.has_unfinished_requests() and core._in_flight is None
    core.shutdown()


def test_steady_decoding_feeds_the_samples_in_flight_whole_and_equals_sync(tiny_checkpoint):
    """Decode steps whose rows are the step in flight's, in its order, take its sampled ids as their input ids
    whole (a slice, no gather); rows that leave or join in between take the gathered path. Outputs (tokens and
    logprobs of seeded and unseeded sampling, n > 1) equal synchronous scheduling's."""
    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + 2 * i, 4]} for i in range(5)]
    params = [SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=6 + 3 * (i % 2), ignore_eos=True, logprobs=1)
              for i in range(5)]
    sync_llm = make_llm(path, False, max_num_seqs=8)  # 10 rows, 8 at a time: rows join when the first leave
    expected = flatten(sync_llm.generate(prompts, params, use_tqdm=False))
    sync_llm.engine_core.shutdown()

    async_llm = make_llm(path, True, max_num_seqs=8)
    runner = async_llm.engine_core.executor.worker.model_runner
    fills = []
    forward = runner._forward

    def recording_forward(batch, fill):
        fills.append(None if fill is None else type(fill[0]))
        return forward(batch, fill)

    runner._forward = recording_forward
    assert flatten(async_llm.generate(prompts, params, use_tqdm=False)) == expected
    assert slice in fills and torch.Tensor in fills  # both ways of filling the inputs ran
    async_llm.engine_core.shutdown()


def test_a_utility_call_sees_no_step_in_flight(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint("llama"), True)
    core, client = llm.engine_core, llm.engine_client
    for i in range(3):
        client.add_request(llm.processor.process(f"r{i}", {"prompt_token_ids": [5, 6, 7 + i]},
                                                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[1])
    client.get_output()
    assert core._in_flight is not None
    client.call_utility("pause_generation", "keep")
    assert core._in_flight is None  # the step in flight was collected first; its tokens are not lost
    emitted = {o.request_id: len(o.new_token_ids) for o in client.get_output().outputs}
    assert emitted == {"r0": 1, "r1": 1, "r2": 1}
    client.call_utility("resume_generation")
    total = dict(emitted)
    while core.has_unfinished_requests():
        for o in client.get_output().outputs:
            total[o.request_id] += len(o.new_token_ids)
    assert total == {"r0": 8, "r1": 8, "r2": 8}
    core.shutdown()


# ---- the scheduler's side: placeholders ------------------------------------------------------

def _scheduler(max_model_len=64):
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), CacheConfig(block_size=4),
                     max_model_len, num_blocks=64)


def _runner_output(sched_out, tokens: dict[str, int]):
    req_ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[tokens[r]] if r in tokens else [] for r in req_ids])


def test_the_next_step_is_scheduled_before_the_sample_comes_back():
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=0,
                          arrival_time=0.0))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 3}
    second = s.schedule()  # step 1 in flight: its token is a placeholder at position 3
    assert second.num_scheduled_tokens == {"a": 1}
    third = s.schedule()  # two in flight; max_tokens=3 is not reached yet
    assert third.num_scheduled_tokens == {"a": 1}
    assert s.schedule().num_scheduled_tokens == {}  # three tokens in flight reach max_tokens=3
    out1 = s.update_from_output(first, _runner_output(first, {"a": 10}))
    out2 = s.update_from_output(second, _runner_output(second, {"a": 11}))
    out3 = s.update_from_output(third, _runner_output(third, {"a": 12}))
    assert [o.new_token_ids for o in out1.outputs + out2.outputs + out3.outputs] == [[10], [11], [12]]
    assert out3.outputs[0].finish_reason is not None and not s.requests


def test_a_stop_while_the_next_step_is_in_flight_drops_that_steps_token():
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]), eos_token_id=0,
                          arrival_time=0.0))
    first = s.schedule()
    second = s.schedule()
    out1 = s.update_from_output(first, _runner_output(first, {"a": 7}))  # stops here
    assert out1.outputs[0].new_token_ids == [7] and out1.outputs[0].finish_reason is not None
    out2 = s.update_from_output(second, _runner_output(second, {"a": 9}))
    assert out2.outputs == []  # the wasted step's token never reaches the request
    assert s.schedule().finished_req_ids == {"a"}  # the runner forgets it on the next step
