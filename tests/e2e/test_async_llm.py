"""AsyncLLM over a real EngineCore process: streaming kinds, abort on cancel, admission, engine death."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine.async_llm import AsyncLLM
from engine.exceptions import EngineDeadError, QueueOverflowError
from engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture
def make_llm(tiny_checkpoint):
    made = []

    def make(**kwargs):
        llm = AsyncLLM.from_engine_args(model=tiny_checkpoint("llama"), device="cpu", dtype="float32",
                                        max_model_len=1024, disable_log_stats=True, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def test_delta_stream_adds_up_to_the_cumulative_and_final_outputs(make_llm):
    llm = make_llm()

    async def run(kind):
        params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, output_kind=kind)
        return [out async for out in llm.generate("A rollout is", params, f"r-{int(kind)}")]

    async def main():
        return await run(RequestOutputKind.DELTA), await run(RequestOutputKind.CUMULATIVE), await run(RequestOutputKind.FINAL_ONLY)

    delta, cumulative, final = asyncio.run(main())
    assert len(final) == 1 and final[0].finished
    assert len(delta) > 1 and delta[-1].finished and not delta[0].finished
    tokens = [t for out in delta for t in out.outputs[0].token_ids]
    text = "".join(out.outputs[0].text for out in delta)
    assert tokens == cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    assert text == cumulative[-1].outputs[0].text == final[0].outputs[0].text


def test_leaving_the_stream_aborts_the_request_in_the_engine(make_llm):
    llm = make_llm()

    async def main():
        params = SamplingParams(max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        seen = 0
        async for _ in llm.generate("Once upon a time", params, "long"):
            seen += 1
            if seen == 3:
                break  # the consumer goes away mid-request
        await asyncio.sleep(0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not await llm.engine_core.call_utility_async("has_unfinished_requests"):
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main()), "the engine kept generating for a consumer that left"


def test_admission_refuses_beyond_max_num_queued_reqs(make_llm):
    llm = make_llm(max_num_queued_reqs=2, max_num_seqs=1)

    async def one(i):
        params = SamplingParams(max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        try:
            return [o async for o in llm.generate("hello", params, f"q{i}")][-1]
        except QueueOverflowError as e:
            return e

    async def main():
        return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QueueOverflowError)]
    done = [r for r in results if not isinstance(r, Exception)]
    # A request counts as queued from its arrival: of a burst that arrives before any of it is
    # tokenized, exactly the limit gets in (the rest were refused without being tokenized).
    assert len(refused) == 18 and len(done) == 2
    assert all(len(r.outputs[0].token_ids) == 30 for r in done)
    assert QueueOverflowError.http_status == 503


def test_engine_death_fails_every_waiting_caller_within_seconds(make_llm):
    llm = make_llm()

    async def consume(i):
        params = SamplingParams(max_tokens=1000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        try:
            async for _ in llm.generate("The dog", params, f"d{i}"):
                pass
        except EngineDeadError:
            return time.monotonic()
        return None

    async def main():
        tasks = [asyncio.create_task(consume(i)) for i in range(4)]
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(llm.engine_core.engine.proc.pid, signal.SIGKILL)
        ended = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
        return killed_at, ended

    killed_at, ended = asyncio.run(main())
    assert all(t is not None and t - killed_at < 5.0 for t in ended), ended
    assert llm.is_dead
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.check_health())
