"""Async plumbing for the routes: first outputs, merged streams, and cancel-on-disconnect."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable

from starlette.requests import Request


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was generating (its work was cancelled)."""


async def _gather_or_cancel(aws: list[Awaitable[Any]]) -> list[Any]:
    """Like asyncio.gather, but the first failure (or our own cancellation) cancels the rest.

    Cancelling a task that is inside AsyncLLM.generate aborts that request in the engine.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body was already read, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, aws: list[Awaitable[Any]]) -> list[Any]:
    """Runs `aws` to completion; if the client disconnects first, cancels them and raises ClientDisconnected."""
    work = asyncio.ensure_future(_gather_or_cancel(aws))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientDisconnected()
        return work.result()
    finally:
        for task in (work, watcher):
            task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)


async def _first(gen: AsyncIterator[Any]) -> Any:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        raise RuntimeError("the engine ended a request without any output") from None


async def first_outputs(gens: list[AsyncIterator[Any]]) -> list[Any]:
    """The first item of every iterator; on any failure every iterator is closed (aborting its request)."""
    try:
        if len(gens) == 1:
            return [await _first(gens[0])]
        return await _gather_or_cancel([_first(g) for g in gens])
    except BaseException:
        await _close_all(gens)
        raise


async def _close_all(gens: list[AsyncIterator[Any]]) -> None:
    for gen in gens:
        try:
            await gen.aclose()
        except Exception:
            pass


_END = object()


async def merge_streams(gens: list[AsyncIterator[Any]], firsts: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """Yields (iterator index, item): the already-taken `firsts`, then the rest as they come.

    Leaving early (client disconnect, error) closes every iterator, aborting its request.
    """
    try:
        for i, first in enumerate(firsts):
            yield i, first
        if len(gens) == 1:
            async for item in gens[0]:
                yield 0, item
        else:
            async for i, item in _merge_rest(gens):
                yield i, item
    finally:
        await _close_all(gens)


async def _merge_rest(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item))
        except Exception as e:
            queue.put_nowait((i, e))
            return
        queue.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        num_open = len(tasks)
        while num_open:
            i, item = await queue.get()
            if item is _END:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
