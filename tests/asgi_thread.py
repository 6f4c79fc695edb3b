"""An ASGI app served by uvicorn in a daemon thread on a free loopback port, for tests that need a real HTTP server in-process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serve_in_thread(app, **config) -> Iterator[str]:
    """Yields the server's base URL ("http://127.0.0.1:PORT") once it listens; stops it on exit.
    `config`: more uvicorn.Config arguments (default: quiet logs, no lifespan)."""
    import uvicorn

    config = {"log_level": "critical", "lifespan": "off", **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
