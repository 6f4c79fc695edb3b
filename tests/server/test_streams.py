"""Cancel-on-disconnect plumbing of the server routes, without a server."""

from __future__ import annotations

import asyncio

import pytest

from rollout.server.streams import (
    ClientDisconnected,
    first_outputs,
    merge_streams,
    run_until_disconnect,
)


class _FakeRequest:
    def __init__(self, disconnect_after: float | None) -> None:
        self.disconnect_after = disconnect_after

    async def receive(self):
        if self.disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}


def _tracked_gen(events: list, items: list, delay: float = 0.0):
    async def gen():
        try:
            for item in items:
                await asyncio.sleep(delay)
                yield item
            events.append("finished")
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        finally:
            events.append("closed")

    return gen()


async def _drain(gen):
    return [x async for x in gen]


def test_disconnect_cancels_the_work():
    async def main():
        events: list = []
        gen = _tracked_gen(events, list(range(100)), delay=0.05)
        with pytest.raises(ClientDisconnected):
            await run_until_disconnect(_FakeRequest(0.1), [_drain(gen)])
        return events

    assert asyncio.run(main()) == ["cancelled", "closed"]


def test_first_failure_cancels_the_rest():
    async def boom():
        await asyncio.sleep(0.01)
        raise ValueError("top_p must be in (0, 1]")

    async def main():
        events: list = []
        with pytest.raises(ValueError, match="top_p"):
            await run_until_disconnect(_FakeRequest(None), [_drain(_tracked_gen(events, [1] * 50, 0.05)), boom()])
        return events

    assert asyncio.run(main()) == ["cancelled", "closed"]


def test_merge_yields_everything_and_closes_on_early_exit():
    async def main():
        events_a, events_b = [], []
        gens = [_tracked_gen(events_a, ["a1", "a2", "a3"]), _tracked_gen(events_b, ["b1", "b2"])]
        firsts = await first_outputs(gens)
        merged = [x async for x in merge_streams(gens, firsts)]
        assert sorted(merged) == [(0, "a1"), (0, "a2"), (0, "a3"), (1, "b1"), (1, "b2")]
        assert events_a == events_b == ["finished", "closed"]

        events = []
        gens = [_tracked_gen(events, list(range(100)), 0.01)]
        stream = merge_streams(gens, await first_outputs(gens))
        async for _ in stream:
            break
        await stream.aclose()
        assert events == ["closed"]  # closed (GeneratorExit), i.e. aborted, not run to the end

    asyncio.run(main())
