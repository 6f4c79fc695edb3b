"""Frontend-wide RL metrics under vLLM's names: each weight-transfer and sleep-mode call's duration, and how many run.

vLLM 0.33 records these at its HTTP routes, per operation and without engine labels, in one
process-wide registry; so do we. The families live in FRONTEND_REGISTRY (not in an engine's
registry, so a data-parallel group that merges its engines' registries shows them once);
`frontend_metrics_text()` is appended to every /metrics body by the stat loggers.

Use around the call that does the work, failed calls included (vLLM counts those too):

    with weight_operation_metrics().record("update"):
        await engine.update_weights(request)
"""

from __future__ import annotations


import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)

WeightOperation = Literal["init", "shutdown", "start", "start_draft", "update", "finish"]
SleepModeOperation = Literal["sleep", "release_kv_cache_memory", "wake"]

WEIGHT_OPERATIONS: tuple[str, ...] = get_args(WeightOperation)
SLEEP_MODE_OPERATIONS: tuple[str, ...] = get_args(SleepModeOperation)

# Seconds; vLLM's boundaries for both families (a tiny update to a 10-minute cold init).
OPERATION_BUCKETS = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

FRONTEND_REGISTRY = CollectorRegistry()
"""The process's frontend-wide families (this module's); engines' families are in their own registries."""
# prometheus_client's process_*, python_gc_* and python_info families, which vLLM's /metrics has too
# (its default registry carries them): the serving process's CPU time, memory, open fds, GC.
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    FRONTEND_REGISTRY.register(_collector)


class OperationMetrics:
    """A duration histogram and an in-flight gauge, both labelled `operation` only."""

    def __init__(self, prefix: str, what: str, operations: tuple[str, ...], registry: CollectorRegistry) -> None:
        self.operations = operations
        self.duration = Histogram(
            f"vllm:{prefix}_duration_seconds",
            f"Duration of one {what} operation.",
            ["operation"],
            buckets=OPERATION_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            f"vllm:{prefix}s_in_flight",
            f"{what.capitalize()} operations currently awaited.",
            ["operation"],
            registry=registry,
        )

    @contextmanager
    def record(self, operation: str) -> Iterator[None]:
        """Counts `operation` in flight while the block runs, then observes its duration (also when it raises)."""
        if operation not in self.operations:
            raise ValueError(f"operation: {operation!r} is not one of {list(self.operations)}")
        in_flight = self.in_flight.labels(operation)
        in_flight.inc()
        start = time.perf_counter()
        try:
            yield
        finally:
            in_flight.dec()
            self.duration.labels(operation).observe(time.perf_counter() - start)


_lock = threading.Lock()
_families: dict[str, OperationMetrics] = {}  # prefix -> its metrics, registered once (a second would be an error)


def _operations(prefix: str, what: str, operations: tuple[str, ...]) -> OperationMetrics:
    with _lock:
        if prefix not in _families:
            _families[prefix] = OperationMetrics(prefix, what, operations, FRONTEND_REGISTRY)
        return _families[prefix]


def weight_operation_metrics() -> OperationMetrics:
    """vllm:rl_weight_update_operation_duration_seconds and vllm:rl_weight_update_operations_in_flight,
    for the operations init, start, start_draft, update, finish and shutdown (made on first use)."""
    return _operations("rl_weight_update_operation", "weight-transfer", WEIGHT_OPERATIONS)


def sleep_mode_operation_metrics() -> OperationMetrics:
    """vllm:sleep_mode_operation_duration_seconds and vllm:sleep_mode_operations_in_flight, for the
    operations sleep, release_kv_cache_memory and wake (made on first use)."""
    return _operations("sleep_mode_operation", "sleep-mode", SLEEP_MODE_OPERATIONS)


def frontend_metrics_text() -> bytes:
    """FRONTEND_REGISTRY in the Prometheus text format (the RL families appear on first use, as in vLLM)."""
    return generate_latest(FRONTEND_REGISTRY)


# vllm:engine_sleep_state: one series per state name, 1 for the engine's state, 0 for the others.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def sleep_state_values(sleep_level: int) -> dict[str, int]:
    """The vllm:engine_sleep_state values for an engine at `sleep_level` (0 awake, 1 weights
    offloaded, 2 weights discarded), as SchedulerStats.sleep_level reports it. Never raises: it runs
    on the frontend's output path, where a level it does not know shows as no state at all."""
    return {"awake": int(sleep_level == 0), "weights_offloaded": int(sleep_level == 1),
            "discard_all": int(sleep_level == 2)}  # fmt: skip
