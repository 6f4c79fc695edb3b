"""SchedulerStats: the scheduler's per-step numbers that the metrics layer turns into gauges and counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache since the last stats
    prefix_cache_hits: int = 0  # tokens found there since the last stats
    num_preemptions: int = 0  # cumulative since the scheduler started
    step_num_preemptions: int = 0  # since the last stats (one step when read every step)
