"""HTTPWeightSyncClient's connections against a real uvicorn server: a call after a 5xx goes over a new one.

uvicorn (vLLM's server and ours) closes a connection whose handler raised once its 500 is out; a call
reusing that kept-alive connection races the close and can fail with "connection reset by peer".
"""

from __future__ import annotations

import logging
import time

import pytest
from asgi_thread import serve_in_thread
from fastapi import FastAPI, HTTPException, Request

from weight_transfer.clients import HTTPWeightSyncClient, WeightSyncError


@pytest.fixture(scope="module")
def server():
    app = FastAPI()
    seen: list[int] = []  # the client port of each weight_info call

    @app.get("/weight_info")
    async def weight_info(request: Request):
        seen.append(request.client.port)
        return {"weight_version": "v1"}

    @app.post("/start_weight_update")
    async def start_weight_update():
        raise RuntimeError("the worker failed")  # uncaught: 500, then uvicorn closes the connection

    @app.post("/finish_weight_update")
    async def finish_weight_update():
        raise HTTPException(400, "no update in progress")  # handled: the connection stays open

    class SlowErrorLog(logging.Handler):
        """Holds uvicorn between sending the 500 and closing the connection: the race made wide."""

        def emit(self, record):
            time.sleep(0.2)

    log = logging.getLogger("uvicorn.error")
    handler = SlowErrorLog(logging.ERROR)
    log.addHandler(handler)
    log.propagate, log.level = False, logging.ERROR
    with serve_in_thread(app, log_config=None, log_level=None) as url:
        yield url, seen
    log.removeHandler(handler)
    log.propagate = True


def test_a_call_after_a_server_error_goes_over_a_new_connection(server):
    url, seen = server
    client = HTTPWeightSyncClient(url, timeout=10)
    try:
        for _ in range(3):  # each round: a 500, then at once the next call, before uvicorn closes the old connection
            seen.clear()
            assert client.get_weight_version() == "v1"
            with pytest.raises(WeightSyncError, match=r"/start_weight_update: HTTP 500"):
                client.start_weight_update()
            assert client.get_weight_version() == "v1"
            assert seen[0] != seen[1]  # a fresh connection (another client port) after the 500
    finally:
        client.close()


def test_a_client_error_keeps_the_connection(server):
    url, seen = server
    client = HTTPWeightSyncClient(url, timeout=10)
    try:
        seen.clear()
        client.get_weight_version()
        with pytest.raises(WeightSyncError, match=r"/finish_weight_update: HTTP 400: no update in progress"):
            client.finish_weight_update("x")
        client.get_weight_version()
        assert seen[0] == seen[1]
    finally:
        client.close()
