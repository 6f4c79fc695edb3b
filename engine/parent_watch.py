"""watch_parent: a daemon thread that acts as soon as this spawned process's parent is gone (even killed by SIGKILL), so no child is orphaned."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable


def watch_parent(on_parent_gone: Callable[[], None], name: str) -> None:
    """Runs on_parent_gone() in a daemon thread named `name` once the parent process has exited; a no-op in a process without one."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        on_parent_gone()

    threading.Thread(target=watch, name=name, daemon=True).start()
