"""The frontend-wide RL families (engine/metrics/rl.py): vLLM's names, its `operation` label and buckets,
durations observed also for calls that fail, and in-flight counts while a call runs."""

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import rl
from engine.metrics.rl import OperationMetrics, sleep_state_values, weight_operation_metrics


def _samples(registry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect() for s in f.samples}


def test_record_counts_in_flight_then_observes_duration():
    registry = CollectorRegistry()
    m = OperationMetrics("rl_weight_update_operation", "weight-transfer", rl.WEIGHT_OPERATIONS, registry)
    key_in_flight = ("vllm:rl_weight_update_operations_in_flight", (("operation", "update"),))
    key_count = ("vllm:rl_weight_update_operation_duration_seconds_count", (("operation", "update"),))
    with m.record("update"):
        assert _samples(registry)[key_in_flight] == 1
        with m.record("update"):
            assert _samples(registry)[key_in_flight] == 2
    assert _samples(registry)[key_in_flight] == 0
    assert _samples(registry)[key_count] == 2
    with pytest.raises(RuntimeError), m.record("update"):
        raise RuntimeError("the transfer failed")
    assert _samples(registry)[key_count] == 3 and _samples(registry)[key_in_flight] == 0


def test_unknown_operation_is_refused_by_name():
    with pytest.raises(ValueError, match="operation: 'upgrade'"):
        with weight_operation_metrics().record("upgrade"):
            pass


def test_process_wide_families_appear_in_frontend_text():
    with weight_operation_metrics().record("init"):
        pass
    with rl.sleep_mode_operation_metrics().record("wake"):
        pass
    families = {f.name: f for f in text_string_to_metric_families(rl.frontend_metrics_text().decode())}
    assert families["process_cpu_seconds"].type == "counter"  # prometheus_client's, as on vLLM's /metrics
    hist = families["vllm:rl_weight_update_operation_duration_seconds"]
    assert hist.type == "histogram"
    bounds = [float(s.labels["le"]) for s in hist.samples if s.name.endswith("_bucket") and s.labels["operation"] == "init"]
    assert bounds == [0.01, 0.1, 1, 10, 30, 60, 120, 300, 600, float("inf")]
    assert families["vllm:rl_weight_update_operations_in_flight"].type == "gauge"
    assert families["vllm:sleep_mode_operation_duration_seconds"].type == "histogram"
    assert families["vllm:sleep_mode_operations_in_flight"].type == "gauge"


@pytest.mark.parametrize("level, state", [(0, "awake"), (1, "weights_offloaded"), (2, "discard_all")])
def test_sleep_state_values_one_hot(level, state):
    values = sleep_state_values(level)
    assert values[state] == 1 and sum(values.values()) == 1


def test_sleep_state_values_of_an_unknown_level_is_no_state():
    assert sleep_state_values(3) == {"awake": 0, "weights_offloaded": 0, "discard_all": 0}


def test_a_controls_gauges_are_recorded_when_its_call_returns(tiny_checkpoint):
    """pause / sleep / wake_up answers carry fresh stats that reach /metrics through the output handler:
    a scrape right after the awaited call (no other await in between) must already see them."""
    import asyncio

    from engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(model=tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=128,
                                    multiprocess=True)

    def gauges() -> dict:
        families = {f.name: f for f in text_string_to_metric_families(llm.prometheus_text().decode())}
        states = {s.labels["sleep_state"]: s.value for s in families["vllm:engine_sleep_state"].samples}
        return {"paused": families["rollout:engine_paused"].samples[0].value, **states}

    async def main():
        seen = []
        for call in (lambda: llm.sleep(1), llm.wake_up, lambda: llm.pause_generation("keep"), llm.resume_generation):
            await call()
            seen.append(gauges())  # no await between the answer and the read
        return seen

    try:
        asleep, awake, paused, resumed = asyncio.run(main())
    finally:
        llm.shutdown()
    assert (asleep["weights_offloaded"], asleep["awake"]) == (1, 0)
    assert (awake["weights_offloaded"], awake["awake"]) == (0, 1)
    assert paused["paused"] > 0 and resumed["paused"] == 0
