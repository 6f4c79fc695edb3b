"""The data-parallel group's parts without engines: the load balancer, the coordinator, per-engine metrics, device placement."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.stats import SchedulerStats
from rollout.balancer import LoadBalancer, prefix_block_hashes
from rollout.coordinator import Coordinator

BLOCK = 4


def _prompt(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + num_tokens))


def test_prefix_block_hashes_chain_full_blocks_only():
    a = prefix_block_hashes(_prompt(0, 10), BLOCK)
    assert len(a) == 2  # the partial third block is not cached by an engine
    b = prefix_block_hashes(_prompt(0, 8) + [99, 98, 97, 96], BLOCK)
    assert b[:2] == a and len(b) == 3
    # Same second block after a different first one: a different chain.
    c = prefix_block_hashes([7, 7, 7, 7] + _prompt(4, 4), BLOCK)
    assert c[0] != a[0] and c[1] != a[1]
    assert prefix_block_hashes([1, 2, 3], BLOCK) == []


def test_least_outstanding_tokens_wins_and_finished_work_is_released():
    lb = LoadBalancer(num_engines=3, block_size=BLOCK)
    picks = []
    for cost in (100, 10, 10, 10):
        engine = lb.pick(None, cost)
        lb.started(engine, cost)
        picks.append(engine)
    # Ties go to the lowest index; the big request keeps engine 0 out of the next picks.
    assert picks == [0, 1, 2, 1]
    assert lb.outstanding_tokens == [100, 20, 10] and lb.num_in_flight == [1, 2, 1]
    lb.finished(0, 100)
    assert lb.pick(None, 10) == 0
    assert lb.num_routed == [1, 2, 1]


def test_secondary_loads_break_ties_and_available_limits_the_choice():
    lb = LoadBalancer(num_engines=3, block_size=BLOCK)
    assert lb.pick(None, 5, secondary_loads=[3, 0, 1]) == 1
    assert lb.pick(None, 5, available=[0, 2]) == 0
    with pytest.raises(ValueError, match="available"):
        lb.pick(None, 5, available=[])


def test_a_shared_prefix_goes_back_to_its_engine_unless_that_one_is_clearly_busier():
    lb = LoadBalancer(num_engines=2, block_size=BLOCK, max_prefix_imbalance=0.25)
    shared = _prompt(0, 12)
    lb.started(1, 50, shared)  # engine 1 served this prefix and is busier than idle engine 0
    cost = 50
    # Within one request's cost of the least loaded: the cached engine.
    assert lb.pick(shared + [5], cost) == 1
    # A prompt sharing only the first block also goes there (the deepest match that fits).
    assert lb.pick(shared[:BLOCK] + [60, 61, 62, 63, 64], cost) == 1
    # No shared full block: least loaded.
    assert lb.pick([90, 91, 92, 93, 94], cost) == 0
    # Clearly busier: load 150 > 1.25 * 0 + 50, so the request spills to the idle engine.
    lb.started(1, 100)
    assert lb.pick(shared, cost) == 0


def test_shared_system_prompt_on_every_engine_does_not_bias_the_choice():
    lb = LoadBalancer(num_engines=2, block_size=BLOCK)
    system = _prompt(0, BLOCK)
    lb.started(0, 10, system + [100, 101, 102, 103])
    lb.started(1, 10, system + [200, 201, 202, 203])
    lb.finished(0, 10)
    # Both engines hold the system block: the less loaded of them.
    assert lb.pick(system + [300, 301, 302, 303], 10) == 0
    # The deeper match wins over the shared first block.
    assert lb.pick(system + [200, 201, 202, 203, 7], 10) == 1


def test_prefix_memory_is_bounded_and_forgettable():
    lb = LoadBalancer(num_engines=2, block_size=BLOCK, max_num_prefix_hashes=3)
    for i in range(5):
        lb.started(1, 1, _prompt(10 * i, BLOCK))
        lb.finished(1, 1)
    assert lb.num_prefix_hashes == 3
    assert lb.pick(_prompt(40, BLOCK), 1) == 1 and lb.pick(_prompt(0, BLOCK), 1) == 0  # oldest evicted
    lb.forget_engine(1)
    assert lb.pick(_prompt(40, BLOCK), 1) == 0
    lb.started(1, 1, _prompt(40, BLOCK))
    lb.finished(1, 1)
    assert lb.pick(_prompt(40, BLOCK), 1) == 1
    lb.forget_prefixes()
    assert lb.pick(_prompt(40, BLOCK), 1) == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_engines": 0}, "num_engines"), ({"block_size": 0}, "block_size"),
     ({"max_prefix_imbalance": -1}, "max_prefix_imbalance"), ({"max_num_prefix_hashes": 0}, "max_num_prefix_hashes")],
)
def test_bad_balancer_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoadBalancer(**{"num_engines": 2, "block_size": BLOCK, **kwargs})


def test_coordinator_keeps_each_engines_latest_scheduler_stats():
    coordinator = Coordinator(2)
    listener = coordinator.listener(1)
    listener.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5), None)
    listener.record(None, None)  # a step without scheduler stats changes nothing
    assert coordinator.num_waiting() == [0, 2]
    assert coordinator.summary()[1] == {"engine": 1, "num_running_reqs": 3, "num_waiting_reqs": 2, "kv_cache_usage": 0.5}
    assert coordinator.loads[1].num_steps == 1 and coordinator.loads[0].num_steps == 0
    with pytest.raises(ValueError, match="num_engines"):
        Coordinator(0)


def test_per_engine_registries_show_as_one_with_engine_labels(tiny_checkpoint):
    from engine.engine_args import create_engine_config
    from engine.metrics.loggers import StatLoggerManager
    from engine.metrics.multi_engine import MultiEngineMetrics

    config = create_engine_config(model=tiny_checkpoint("llama"), device="cpu", disable_log_stats=True)
    managers = [StatLoggerManager(config, "tiny") for _ in range(2)]  # each frontend calls its engine "0"
    coordinator = Coordinator(2)
    for i, manager in enumerate(managers):
        manager.add_stat_logger(coordinator.listener(i), 0)
    managers[0].record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.2), None)
    managers[1].record(SchedulerStats(num_running_reqs=4, num_waiting_reqs=5, kv_cache_usage=0.6), None)
    managers[1].record_admission_rejection("queue_full")
    assert coordinator.num_waiting() == [0, 5]
    with pytest.raises(ValueError, match="engine_index"):
        managers[0].add_stat_logger(coordinator.listener(0), 3)
    with pytest.raises(ValueError, match="stat_logger"):
        managers[0].add_stat_logger(object(), 0)

    metrics = MultiEngineMetrics([m.prometheus_logger.registry for m in managers])
    families = {f.name: f for f in text_string_to_metric_families(metrics.prometheus_text().decode())}
    running = {s.labels["engine"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"0": 1.0, "1": 4.0}
    # Admission is per frontend in vLLM (no engine label): the group shows each reason once, added up.
    managers[0].record_admission_rejection("queue_full")
    families = {f.name: f for f in text_string_to_metric_families(metrics.prometheus_text().decode())}
    rejected = [s for s in families["vllm:admission_rejections"].samples if s.name.endswith("_total")]
    assert sorted((s.labels["reason"], s.value) for s in rejected) == [
        ("max_num_queued_reqs", 2.0), ("max_num_queued_tokens", 0.0)
    ]
    snapshot = metrics.snapshot()
    assert snapshot["vllm:num_requests_running"] == 5.0  # added up over engines
    assert snapshot["vllm:kv_cache_usage_perc"] == pytest.approx(0.4)  # a fraction: averaged


def test_engine_devices_place_each_engine_after_the_previous_ones_ranks():
    from rollout.group import engine_devices

    assert engine_devices("cpu", 2) == ["cpu", "cpu"]
    assert engine_devices("cuda", 3, tensor_parallel_size=2) == ["cuda:0", "cuda:2", "cuda:4"]
    assert engine_devices("cuda:1", 2) == ["cuda:1", "cuda:2"]
    with pytest.raises(ValueError, match="data_parallel_size"):
        engine_devices("cpu", 0)
    with pytest.raises(ValueError, match="device"):
        engine_devices("tpu", 2)
