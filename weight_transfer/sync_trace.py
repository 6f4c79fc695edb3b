"""Where a weight sync's time goes across processes: hop timestamps in one file, on when WEIGHT_SYNC_TRACE names it.

Off (the default) a mark is one global check. On, every process that marks appends `time pid hop` lines to the
file (one O_APPEND write each, so the trainer's and the engine's lines interleave whole); summarize() turns
them into each hop's median time after the sync's first mark. The engine's processes inherit the variable, so
it must be set (or enable() called, which sets it) before the engine starts. benchmarks/weight_sync.py --trace.
"""

from __future__ import annotations

import os
import statistics
import time

ENV = "WEIGHT_SYNC_TRACE"
SYNC_STARTED = "trainer: sync started"  # every sync's first mark (TrainerWeightTransferEngine._update)
_path: str | None = os.environ.get(ENV) or None
_fd: int | None = None


def enable(path: str) -> None:
    """Marks go to `path` from now on, in this process and in processes started after this call."""
    global _path, _fd
    os.environ[ENV] = path
    _path, _fd = path, None


def mark(hop: str) -> None:
    """One hop of the sync in progress passed, now."""
    global _fd
    if _path is None:
        return
    if _fd is None:
        _fd = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, f"{time.time():.6f} {os.getpid()} {hop}\n".encode())


def summarize(path: str, first: str = SYNC_STARTED) -> dict[str, float]:
    """Each hop's median milliseconds after the sync's first mark (`first`), in order, over every sync in `path`
    (a sync: the lines from one `first` to the next; a hop counts at its first mark in a sync)."""
    per_hop: dict[str, list[float]] = {}
    start = None
    seen: set[str] = set()
    with open(path) as f:
        for line in f:
            stamp, _pid, hop = line.rstrip("\n").split(" ", 2)
            t = float(stamp)
            if hop == first:
                start, seen = t, set()
            if start is None or hop in seen:
                continue
            seen.add(hop)
            per_hop.setdefault(hop, []).append((t - start) * 1e3)
    medians = {hop: statistics.median(times) for hop, times in per_hop.items()}
    return dict(sorted(medians.items(), key=lambda item: item[1]))
