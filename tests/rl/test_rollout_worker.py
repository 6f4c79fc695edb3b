"""RolloutWorker with the engine in this process: generate (sync and async), pause/resume, a local weight update."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from engine.exceptions import EngineNotReadyError
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tiny_models import make_tiny_checkpoint
from rollout import RolloutWorker

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with RolloutWorker(model=tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=256,
                       disable_log_stats=True) as w:
        yield w


def test_generate_batches_and_keeps_prompt_order(worker):
    prompts = ["The quick brown fox", "Once upon a time", "A rollout is"]
    outputs = worker.generate(prompts, GREEDY)
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert outputs[0].outputs[0].finish_reason == "length"
    # Same greedy tokens one at a time.
    assert worker.generate(prompts[1], GREEDY)[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_generate_bad_input_is_a_value_error_and_the_worker_keeps_serving(worker):
    with pytest.raises(ValueError, match="sampling_params"):
        worker.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="top_p"):
        worker.generate("a", SamplingParams(top_p=2.0))
    assert worker.generate("a", GREEDY)[0].finished


def test_agenerate_and_astream_from_the_callers_event_loop(worker):
    expected = worker.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids

    async def main():
        final = await worker.agenerate("Once upon a time", GREEDY)
        delta = GREEDY.clone(output_kind=RequestOutputKind.DELTA)
        streamed = [out async for out in worker.astream("Once upon a time", delta)]
        return final, streamed

    final, streamed = asyncio.run(main())
    assert final.finished and final.outputs[0].token_ids == expected
    assert streamed[-1].finished and len(streamed) > 1
    assert [t for out in streamed for t in out.outputs[0].token_ids] == expected


def test_controls_and_world_size(worker):
    assert worker.get_world_size() == 1
    assert worker.is_paused() is False and worker.is_sleeping() is False
    with pytest.raises(ValueError, match="mode"):
        worker.pause_generation("later")
    assert worker.is_paused() is False
    assert worker.reset_prefix_cache() in (True, False)
    assert worker.abort_requests(["no-such-request"]) == []


def test_pause_refuses_new_requests_until_resume(worker):
    worker.pause_generation("abort")
    try:
        assert worker.is_paused() is True
        with pytest.raises(EngineNotReadyError):
            worker.generate("hello", GREEDY)
    finally:
        worker.resume_generation()
    assert worker.is_paused() is False
    assert worker.generate("hello", GREEDY)[0].finished


def test_pause_abort_ends_an_in_flight_request_with_finish_reason_abort(worker):
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    started, result = threading.Event(), {}

    async def consume():
        outs = []
        async for out in worker.astream("Once upon a time", params):
            outs.append(out)
            started.set()
        return outs

    thread = threading.Thread(target=lambda: result.setdefault("outs", asyncio.run(consume())))
    thread.start()
    assert started.wait(60)
    worker.pause_generation("abort")
    thread.join(60)
    worker.resume_generation()
    outs = result["outs"]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 200


def test_local_weight_update_with_torch_tensors(worker, tmp_path):
    prompt = "The quick brown fox"
    before = worker.generate(prompt, GREEDY)[0].outputs[0].token_ids
    other = make_tiny_checkpoint(tmp_path / "seed1", "llama", seed=1)
    new_weights = load_file(os.path.join(other, "model.safetensors"))
    original = load_file(os.path.join(worker.config.model.model, "model.safetensors"))
    from weight_transfer import hf_state_checksums

    worker.pause_generation("wait")
    worker.init_weight_transfer_engine({"backend": "local"})
    worker.start_weight_update()
    worker.update_weights({"weights": dict(new_weights)})
    worker.finish_weight_update("v1")
    worker.resume_generation()
    assert worker.get_weight_version() == "v1"
    assert worker.weight_info()["weight_version"] == "v1"
    assert worker.weight_checker(hf_state_checksums(new_weights))["match"] is True
    out = worker.generate(prompt, GREEDY)[0].outputs[0]
    assert out.token_ids != before
    assert {v for v, _, _ in out.weight_versions} == {"v1"}

    # A bad update changes nothing; then the original weights come back.
    worker.start_weight_update()
    with pytest.raises(ValueError, match="no.such.weight"):
        worker.update_weights({"weights": {"no.such.weight": torch.zeros(2)}})
    assert worker.weight_checker(hf_state_checksums(new_weights))["match"] is True
    worker.update_weights({"weights": dict(original)})
    worker.finish_weight_update("v0")
    assert worker.weight_checker(hf_state_checksums(original))["match"] is True
    assert worker.generate(prompt, GREEDY)[0].outputs[0].token_ids == before


def test_pause_keep_then_resume_continues_in_flight_requests(worker):
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    expected = worker.generate(prompt, params)[0].outputs[0].token_ids
    started, result = threading.Event(), {}

    async def consume():
        outs = []
        async for out in worker.astream(prompt, params):
            outs.append(out)
            started.set()
        return outs

    thread = threading.Thread(target=lambda: result.setdefault("outs", asyncio.run(consume())))
    thread.start()
    assert started.wait(60)
    worker.pause_generation("keep")
    assert worker.is_paused() is True
    worker.resume_generation()
    thread.join(60)
    assert not thread.is_alive(), "the request did not continue after resume()"
    outs = result["outs"]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert [t for o in outs for t in o.outputs[0].token_ids] == expected


def test_sleep_refuses_requests_and_wake_up_restores_them(worker):
    before = worker.generate("A rollout is", GREEDY)[0].outputs[0].token_ids
    worker.sleep(1)
    try:
        assert worker.is_sleeping() is True
        with pytest.raises(EngineNotReadyError):
            worker.generate("A rollout is", GREEDY)
        with pytest.raises(ValueError, match="tags"):
            worker.wake_up(["gpu"])
        assert worker.is_sleeping() is True
    finally:
        worker.wake_up()
    assert worker.is_sleeping() is False
    assert worker.generate("A rollout is", GREEDY)[0].outputs[0].token_ids == before


@pytest.mark.slow
def test_the_same_api_with_the_engine_in_its_own_process(tiny_checkpoint, tmp_path):
    from weight_transfer import hf_state_checksums

    path = tiny_checkpoint("llama")
    with RolloutWorker(model=path, multiprocess=True, device="cpu", dtype="float32", max_model_len=256,
                       disable_log_stats=True) as mp:
        before = mp.generate(["The quick brown fox", "A rollout is"], GREEDY)
        with RolloutWorker(model=path, device="cpu", dtype="float32", max_model_len=256,
                           disable_log_stats=True) as local:
            assert [o.outputs[0].token_ids for o in local.generate(["The quick brown fox", "A rollout is"], GREEDY)] \
                == [o.outputs[0].token_ids for o in before]
        mp.pause_generation("abort")
        with pytest.raises(EngineNotReadyError):
            mp.generate("hello", GREEDY)
        mp.resume_generation()
        new_weights = load_file(os.path.join(make_tiny_checkpoint(tmp_path / "seed1", "llama", seed=1), "model.safetensors"))
        mp.pause_generation("wait")
        mp.init_weight_transfer_engine({"backend": "local"})
        mp.start_weight_update()
        mp.update_weights({"weights": dict(new_weights)})  # CPU tensors cross the ZMQ socket as frames
        mp.finish_weight_update("v1")
        mp.resume_generation()
        assert mp.weight_checker(hf_state_checksums(new_weights))["match"] is True
        out = mp.generate("The quick brown fox", GREEDY)[0].outputs[0]
        assert out.token_ids != before[0].outputs[0].token_ids and out.weight_versions == [("v1", 0, 8)]
