"""IterationStats from hand-made EngineCoreOutputs with controlled timestamps."""

import pytest

from engine.metrics.iteration_stats import IterationStatsRecorder
from engine.wire import EngineCoreOutput, EngineCoreOutputs, FinishReason


def step(timestamp, *outputs):
    return EngineCoreOutputs(outputs=list(outputs), timestamp=timestamp)


def test_ttft_itl_e2e_and_queue_time():
    rec = IterationStatsRecorder()
    rec.on_request_added("a", arrival_time=100.0, num_prompt_tokens=7)
    rec.on_request_added("b", arrival_time=100.5, num_prompt_tokens=3)

    # An earlier step (another request's) ended at 101.0, so "a"'s first-token step started then.
    it = rec.on_engine_outputs(step(101.0), now=101.0)
    assert it.num_generation_tokens == 0 and it.time_to_first_tokens == []

    it = rec.on_engine_outputs(step(102.0, EngineCoreOutput("a", [5])), now=102.25)
    assert it.num_prompt_tokens == 7 and it.num_generation_tokens == 1
    assert it.time_to_first_tokens == [pytest.approx(2.25)]  # frontend now - arrival
    assert it.inter_token_latencies == []

    it = rec.on_engine_outputs(step(103.0, EngineCoreOutput("a", [6]), EngineCoreOutput("b", [9])), now=103.5)
    assert it.num_prompt_tokens == 3 and it.num_generation_tokens == 2
    assert it.time_to_first_tokens == [pytest.approx(3.0)]  # "b": 103.5 - 100.5
    assert it.inter_token_latencies == [pytest.approx(1.25)]  # "a": 103.5 - 102.25

    it = rec.on_engine_outputs(
        step(104.0, EngineCoreOutput("a", [7, 8], finish_reason=FinishReason.LENGTH)), now=104.5
    )
    assert it.num_generation_tokens == 2 and it.inter_token_latencies == [pytest.approx(1.0)]
    [done] = it.finished_requests
    assert done.req_id == "a" and done.finish_reason == "length"
    assert done.num_prompt_tokens == 7 and done.num_generation_tokens == 4
    assert done.e2e_latency == pytest.approx(4.5)
    assert done.queue_time == pytest.approx(1.0)  # arrival 100 -> step start 101
    assert done.prefill_time == pytest.approx(1.0)  # 101 -> first token at engine time 102
    assert done.decode_time == pytest.approx(2.0)  # engine times 102 -> 104
    assert done.inference_time == pytest.approx(3.0)
    assert done.mean_time_per_output_token == pytest.approx(2.0 / 3)

    # "b"'s first-token step started at 102.0 (the previous outputs), after its arrival.
    it = rec.on_engine_outputs(step(105.0, EngineCoreOutput("b", [1], finish_reason=FinishReason.STOP)), now=105.0)
    [done] = it.finished_requests
    assert (done.queue_time, done.prefill_time, done.decode_time) == pytest.approx((1.5, 1.0, 2.0))
    assert rec.requests == {}


def test_queue_time_never_starts_before_arrival():
    rec = IterationStatsRecorder()
    rec.on_engine_outputs(step(10.0), now=10.0)  # an old step, long before the request
    rec.on_request_added("a", arrival_time=50.0, num_prompt_tokens=2)
    it = rec.on_engine_outputs(step(51.0, EngineCoreOutput("a", [1], finish_reason=FinishReason.LENGTH)), now=51.0)
    [done] = it.finished_requests
    assert done.queue_time == 0.0 and done.prefill_time == pytest.approx(1.0)


def test_frontend_stopped_and_aborted_requests():
    rec = IterationStatsRecorder()
    rec.on_request_added("s", arrival_time=0.0, num_prompt_tokens=2)
    rec.on_request_added("0_p", arrival_time=0.0, num_prompt_tokens=2, parent_req_id="p")
    rec.on_request_added("1_p", arrival_time=0.0, num_prompt_tokens=2, parent_req_id="p")

    # A stop string ends "s" in the frontend; the engine's later abort output is ignored.
    it = rec.on_engine_outputs(step(1.0, EngineCoreOutput("s", [4])), now=1.0, stopped_req_ids=["s"])
    assert [(f.req_id, f.finish_reason) for f in it.finished_requests] == [("s", "stop")]
    it = rec.on_engine_outputs(step(2.0, EngineCoreOutput("s", [], finish_reason=FinishReason.ABORT)), now=2.0)
    assert it.finished_requests == []

    rec.on_requests_aborted(["0_p", "1_p", "unknown"])  # engine ids; unknown ones are ignored
    assert rec.requests == {}


def test_finished_without_tokens_is_all_queue_time():
    rec = IterationStatsRecorder()
    rec.on_request_added("a", arrival_time=1.0, num_prompt_tokens=4)
    it = rec.on_engine_outputs(step(3.0, EngineCoreOutput("a", [], finish_reason=FinishReason.ABORT)), now=3.0)
    [done] = it.finished_requests
    assert done.finish_reason == "abort" and done.queue_time == pytest.approx(2.0)
    assert (done.prefill_time, done.decode_time, done.num_generation_tokens) == (0.0, 0.0, 0)


def test_n_and_max_generation_tokens_once_per_user_request():
    rec = IterationStatsRecorder()
    for child in ("p-0", "p-1", "p-2"):
        rec.on_request_added(child, 0.0, 4, parent_req_id="p", max_tokens=8, n=3)
    rec.on_request_added("solo", 0.0, 5, max_tokens=2)
    it = rec.on_engine_outputs(step(1.0, EngineCoreOutput("p-0", [1, 2], finish_reason=FinishReason.STOP),
                                    EngineCoreOutput("p-1", [1]), EngineCoreOutput("p-2", [1]),
                                    EngineCoreOutput("solo", [1, 2], finish_reason=FinishReason.LENGTH)), now=1.0)  # fmt: skip
    assert it.n_params == [1] and it.max_num_generation_tokens == [2]  # only "solo" is done
    assert [r.max_tokens for r in it.finished_requests] == [8, 2]
    it = rec.on_engine_outputs(step(2.0, EngineCoreOutput("p-1", [2, 3, 4], finish_reason=FinishReason.LENGTH)), now=2.0)
    assert it.n_params == [] and len(it.finished_requests) == 1  # one child of "p" still runs
    rec.on_requests_aborted(["p-2"])  # the last child dropped unreported: "p" is forgotten too
    assert rec.requests == {} and rec.parents == {}


def test_cached_prompt_tokens_and_preemptions_come_from_the_engine_outputs():
    rec = IterationStatsRecorder()
    rec.on_request_added("a", 0.0, num_prompt_tokens=40)
    it = rec.on_engine_outputs(step(1.0, EngineCoreOutput("a", [1], num_cached_tokens=32)), now=1.0)
    assert (it.num_prompt_tokens, it.num_cached_prompt_tokens, it.num_computed_prompt_tokens) == (40, 32, 8)
    rec.on_engine_outputs(step(2.0, EngineCoreOutput("a", [2], num_cached_tokens=32, num_preemptions=1)), now=2.0)
    it = rec.on_engine_outputs(step(3.0, EngineCoreOutput("a", [3], finish_reason=FinishReason.LENGTH,
                                                          num_cached_tokens=32, num_preemptions=2)), now=3.0)  # fmt: skip
    [done] = it.finished_requests
    assert (done.num_cached_tokens, done.num_preemptions, done.max_tokens) == (32, 2, None)
    assert it.num_prompt_tokens == 0  # counted once, with the first token
