"""AsyncLLM's control calls over an engine process: the gauges an answer moves are recorded when the call
returns, and a call whose answer's stats the output handler already took returns without waiting for it
(a weight sync makes several such calls; each wait cost a few loop turns)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(model=tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=128,
                                    multiprocess=True)
    yield llm
    llm.shutdown()


def _paused(llm) -> float:
    families = {f.name: f for f in text_string_to_metric_families(llm.prometheus_text().decode())}
    return families["rollout:engine_paused"].samples[0].value


def _count_marker_waits(llm, monkeypatch) -> list:
    waits = []
    original = llm.engine_core.outputs_taken

    async def counted():
        waits.append(1)
        await original()

    monkeypatch.setattr(llm.engine_core, "outputs_taken", counted)
    return waits


def test_weight_lifecycle_gauges_are_recorded_when_each_call_returns(llm, monkeypatch):
    waits = _count_marker_waits(llm, monkeypatch)

    async def main():
        await llm.init_weight_transfer_engine({"backend": "local"})
        seen = []
        for _ in range(3):
            await llm.start_weight_update()
            seen.append(_paused(llm))  # no await between the answer and the read
            await llm.finish_weight_update("v")
            seen.append(_paused(llm))
            assert await llm.get_weight_version() == "v"
        return seen

    seen = asyncio.run(main())
    assert seen == [2, 0] * 3  # nothing is scheduled during an update; serving again after it
    # The handler was idle, waiting for outputs: it took every answer's stats before the caller resumed.
    assert waits == []


def test_a_call_whose_stats_are_still_queued_waits_for_the_handler(llm, monkeypatch):
    waits = _count_marker_waits(llm, monkeypatch)
    monkeypatch.setattr(llm.engine_core, "outputs_pending", lambda: True)  # as if the handler lagged behind

    async def main():
        await llm.pause_generation("keep")
        paused = _paused(llm)
        await llm.resume_generation()
        return paused, _paused(llm)

    assert asyncio.run(main()) == (2, 0)
    assert len(waits) >= 2  # every control waited for the marker (pause_generation makes more than one call)


def test_outputs_pending_says_whether_the_consumer_has_taken_everything(llm):
    from engine.wire import EngineCoreOutputs

    client = llm.engine_core

    async def main():
        await llm.get_weight_version()  # the output handler runs and has taken everything
        assert client.outputs_pending() is False
        handler = llm._output_task
        handler.cancel()  # no consumer: what is queued stays queued
        await asyncio.gather(handler, return_exceptions=True)
        client._outputs.put_nowait(EngineCoreOutputs())
        assert client.outputs_pending() is True
        await client.get_output_async()
        assert client.outputs_pending() is False
        await client.outputs_taken()  # nothing queued: returns at once, no consumer needed

    asyncio.run(main())
