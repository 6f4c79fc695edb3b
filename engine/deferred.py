"""DeferredResult: the answer of an engine utility call that is not known yet, so a wait on a peer never holds the busy loop.

A utility whose work waits on someone else (init_weight_transfer_engine's rendezvous with a
trainer) starts that work elsewhere - the workers' background threads - and returns a
DeferredResult. The engine process (engine/core_proc.py) keeps it with the caller's call id,
polls it between steps and sends the answer once it is known, so generation goes on meanwhile;
in-process callers wait on it (wait()).

    poll()   cheap, never blocks: True once the answer is known
    result() the answer, or raises the call's error (after poll() said True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# How often a pending DeferredResult is polled (and how long an idle engine waits for input while
# one is pending), so that its answer goes out within about this long of being known.
POLL_INTERVAL_S = 0.01


class DeferredResult:
    """An answer to come. `poll` (cheap) returns (False, None) until then, then (True, result), or raises the error."""

    def __init__(self, poll: Callable[[], tuple[bool, Any]]) -> None:
        self._poll = poll
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def poll(self) -> bool:
        if not self._done:
            try:
                self._done, self._result = self._poll()
            except Exception as e:  # the call failed: that is its answer
                self._done, self._error = True, e
        return self._done

    def result(self) -> Any:
        if not self._done:
            raise RuntimeError("DeferredResult.result() before poll() returned True")
        if self._error is not None:
            raise self._error
        return self._result

    def wait(self) -> Any:
        """Polls until the answer is known (callers without a loop to get back to), then result()."""
        while not self.poll():
            time.sleep(POLL_INTERVAL_S)
        return self.result()
