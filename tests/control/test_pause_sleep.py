"""Pause modes, sleep levels and wake-up: in-process on the EngineCore, and over a real engine process."""

from __future__ import annotations

import gc
import logging
import queue
import time
import weakref

import pytest
import torch

from engine.config import CacheConfig, SchedulerConfig
from engine.control import PauseState
from engine.control_state import ControlState
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.stats import SchedulerStats
from engine.core_client import EngineCoreClient, EngineUtilityError
from engine.engine_args import create_engine_config
from engine.engine_core import EngineCore
from engine.exceptions import EngineNotReadyError
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest, FinishReason

MAX_MODEL_LEN = 64
MAX_TOKENS = 12
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64, 1, 2, 33, 90, 11], [150, 2, 9]]


@pytest.fixture(scope="module")
def config(tiny_checkpoint):
    # These tests count the steps exactly as synchronous scheduling emits tokens; how control
    # calls meet a step in flight is tested in tests/engine/test_async_scheduling.py.
    return create_engine_config(
        model=tiny_checkpoint("llama"), max_model_len=MAX_MODEL_LEN, device="cpu", dtype="float32", max_num_seqs=8,
        async_scheduling=False,
    )


@pytest.fixture
def core(config):
    core = EngineCore(config)
    yield core
    core.shutdown()


def _request(req_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params, eos_token_id=None)


class Results:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, FinishReason] = {}

    def add(self, outputs) -> int:
        """Records a step's outputs; returns how many tokens it carried."""
        num_tokens = 0
        for out in outputs.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            num_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reasons[out.request_id] = out.finish_reason
        return num_tokens


def _run(core: EngineCore, results: Results | None = None, max_steps: int = 1000) -> Results:
    results = results or Results()
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return results
        results.add(core.step())
    raise AssertionError("the engine did not finish")


def _reference(core: EngineCore, prefix: str = "ref") -> dict[int, list[int]]:
    """Greedy tokens of PROMPTS on an unpaused engine, by prompt index (prefix cache cleared after)."""
    for i, prompt in enumerate(PROMPTS):
        core.add_request(_request(f"{prefix}{i}", prompt))
    results = _run(core)
    core.reset_prefix_cache()
    return {i: results.tokens[f"{prefix}{i}"] for i in range(len(PROMPTS))}


def _add_all(core: EngineCore, prefix: str) -> list[str]:
    for i, prompt in enumerate(PROMPTS):
        core.add_request(_request(f"{prefix}{i}", prompt))
    return [f"{prefix}{i}" for i in range(len(PROMPTS))]


# ---- the scheduler's pause state (no torch needed) -------------------------------------------


def test_the_scheduler_obeys_its_control_state_whose_pause_state_changes_are_logged(caplog):
    control = ControlState()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4), CacheConfig(block_size=4), 32, 64, control=control)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), None))
    with caplog.at_level(logging.INFO, logger="engine.control_state"):
        control.pause("keep")
        control.pause("keep")  # no change: no line
        assert scheduler.pause_state == PauseState.PAUSED_ALL
        out = scheduler.schedule()
        assert out.is_empty and not out.scheduled_new_reqs and not out.num_scheduled_tokens
        scheduler.add_request(Request("b", [4, 5], SamplingParams(max_tokens=4), None))  # queued
        control.pause("wait")
        with pytest.raises(EngineNotReadyError) as refused:
            scheduler.add_request(Request("c", [6], SamplingParams(max_tokens=4), None))
        assert refused.value.reason == "paused" and refused.value.http_status == 503
        assert not scheduler.schedule().is_empty  # already admitted requests still run
        control.resume()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.control_state"]
    assert lines == [
        "EngineCore: pause state UNPAUSED -> PAUSED_ALL",
        "EngineCore: pause state PAUSED_ALL -> PAUSED_NEW",
        "EngineCore: pause state PAUSED_NEW -> UNPAUSED",
    ]
    assert scheduler.make_stats().pause_state == PauseState.UNPAUSED
    assert isinstance(EngineNotReadyError("x"), RuntimeError)


# ---- pause modes -----------------------------------------------------------------------------


def test_pause_abort_ends_in_flight_requests_and_refuses_new_ones(core):
    req_ids = _add_all(core, "a")
    results = Results()
    for _ in range(3):
        results.add(core.step())
    aborted = core.pause_generation("abort")
    assert sorted(aborted) == sorted(req_ids)
    assert core.is_paused()
    assert core.has_unfinished_requests()  # the ABORT outputs are not out yet
    step = core.step()
    assert results.add(step) == 0
    assert {r: results.finish_reasons[r] for r in req_ids} == dict.fromkeys(req_ids, FinishReason.ABORT)
    assert step.scheduler_stats.pause_state == PauseState.PAUSED_NEW
    assert not core.has_unfinished_requests()
    with pytest.raises(EngineNotReadyError) as refused:
        core.add_request(_request("late", PROMPTS[0]))
    assert refused.value.reason == "paused" and refused.value.http_status == 503
    core.resume_generation()
    assert not core.is_paused()
    core.add_request(_request("late", PROMPTS[0]))
    assert len(_run(core).tokens["late"]) == MAX_TOKENS


def test_pause_wait_lets_in_flight_requests_finish_and_refuses_new_ones(core):
    reference = _reference(core)
    req_ids = _add_all(core, "w")
    results = Results()
    results.add(core.step())  # some running, and (after pause) none refused that was admitted
    assert core.pause_generation("wait") == []
    with pytest.raises(EngineNotReadyError, match="paused"):
        core.add_request(_request("late", PROMPTS[0]))
    _run(core, results)  # the frontend's side of wait: poll has_unfinished_requests until False
    assert {r: results.finish_reasons[r] for r in req_ids} == dict.fromkeys(req_ids, FinishReason.LENGTH)
    assert {i: results.tokens[r] for i, r in enumerate(req_ids)} == reference
    assert core.scheduler.pause_state == PauseState.PAUSED_NEW
    core.resume_generation()
    assert core.scheduler.pause_state == PauseState.UNPAUSED


def test_pause_wait_also_drains_requests_not_yet_scheduled(core):
    req_ids = _add_all(core, "q")  # all still waiting: never scheduled
    core.pause_generation("wait")
    results = _run(core)
    assert all(len(results.tokens[r]) == MAX_TOKENS for r in req_ids)


def test_pause_keep_freezes_requests_and_resume_continues_them_exactly(core):
    reference = _reference(core)
    req_ids = _add_all(core, "k")[:2]
    core.abort_requests(["k2"])  # the third prompt comes later, while paused
    results = Results()
    for _ in range(4):
        results.add(core.step())
    tokens_at_pause = {r: list(results.tokens.get(r, [])) for r in req_ids}
    assert core.pause_generation("keep") == []
    assert not core.has_unfinished_requests()  # frozen: the busy loop would idle
    assert core.scheduler.has_unfinished_requests()
    core.add_request(_request("late", PROMPTS[2]))  # queues
    assert core.scheduler.get_num_unfinished_requests() == 3
    for _ in range(3):
        assert results.add(core.step()) == 0  # no tokens while paused
    assert {r: results.tokens.get(r, []) for r in req_ids} == tokens_at_pause
    assert core.make_stats().pause_state == PauseState.PAUSED_ALL
    core.resume_generation()
    _run(core, results)
    assert results.tokens["k0"] == reference[0]
    assert results.tokens["k1"] == reference[1]
    assert results.tokens["late"] == reference[2]


def test_pausing_again_switches_the_mode(core):
    _add_all(core, "s")
    core.step()
    core.pause_generation("keep")
    aborted = core.pause_generation("abort")  # frozen requests end too
    assert len(aborted) == len(PROMPTS)
    _run(core)
    assert not core.scheduler.has_unfinished_requests()
    core.resume_generation()


# ---- sleep / wake-up -------------------------------------------------------------------------


def _storage_refs(tensors) -> list[weakref.ref]:
    return [weakref.ref(t.untyped_storage()) for t in tensors]


def _alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_outputs_after_wake_up_are_unchanged(core, level):
    reference = _reference(core)
    worker = core.executor.worker
    kv_shapes = [layer.kv_cache.shape for layer in worker.attn_layers]
    kv_refs = _storage_refs(layer.kv_cache for layer in worker.attn_layers)
    params = list(worker.model.parameters())
    param_refs = _storage_refs(params)
    buffers = list(worker.model.buffers())
    assert buffers, "the model should have rotary buffers"

    core.sleep(level)
    assert core.is_sleeping()
    assert _alive(kv_refs) == 0  # every KV tensor's memory is released
    if level == 2:
        assert _alive(param_refs) == 0  # and every weight's
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
    else:
        assert _alive(param_refs) == len(params)  # on CPU the weights already live in host memory
    assert all(b.untyped_storage().nbytes() > 0 for b in buffers)  # rotary caches stay
    stats = core.make_stats()
    assert (stats.sleep_level, stats.pause_state) == (level, PauseState.PAUSED_ALL)
    with pytest.raises(EngineNotReadyError) as refused:
        core.add_request(_request("x", PROMPTS[0]))
    assert refused.value.reason == "sleeping"
    core.sleep(level)  # again at the same level: nothing happens

    core.wake_up(reload_weights=level == 2)  # level 2 discarded the weights: read the checkpoint again
    assert not core.is_sleeping()
    assert core.make_stats().sleep_level == 0
    assert [layer.kv_cache.shape for layer in worker.attn_layers] == kv_shapes  # same number of blocks
    assert [id(p) for p in worker.model.parameters()] == [id(p) for p in params]  # the same Parameter objects
    assert _reference(core, "after") == reference


def test_sleep_aborts_requests_in_flight_even_when_frozen_by_keep(core):
    req_ids = _add_all(core, "f")
    core.step()
    core.pause_generation("keep")
    core.sleep(1)
    results = _run(core)
    assert results.finish_reasons == dict.fromkeys(req_ids, FinishReason.ABORT)
    assert not core.scheduler.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.wake_up()
    assert core.is_paused()  # the pause is not sleep's to end
    core.resume_generation()
    core.add_request(_request("after", PROMPTS[0]))
    assert len(_run(core).tokens["after"]) == MAX_TOKENS


def test_rl_order_sleep_2_wake_weights_update_wake_kv_cache(core):
    reference = _reference(core)
    model = core.executor.worker.model
    checkpoint = {n: p.detach().clone() for n, p in model.named_parameters()}
    core.sleep(2)

    core.wake_up(["weights"])  # their memory is back, zero-filled: the trainer's weights come next
    assert core.is_sleeping()
    assert all(not p.any() for p in model.parameters())
    with pytest.raises(EngineNotReadyError, match="asleep"):
        core.add_request(_request("x", PROMPTS[0]))
    with pytest.raises(ValueError, match="tags"):
        core.wake_up(["scheduling"])  # the KV cache still sleeps
    assert core.is_sleeping() and core.executor.worker.sleeper.asleep == {"kv_cache"}

    # The weight update (here the checkpoint's own tensors, pushed as a trainer would).
    from safetensors.torch import load_file

    core.init_weight_transfer_engine({"backend": "local"})
    core.start_weight_update()
    core.update_weights({"weights": load_file(f"{core.config.model.model}/model.safetensors")})
    core.finish_weight_update(weight_version="pushed")
    core.wake_up(["kv_cache"])
    assert not core.is_sleeping()
    assert _reference(core, "after") == reference
    assert all(torch.equal(p, checkpoint[n]) for n, p in model.named_parameters())

    # Without an update, reload_weights reads the checkpoint again.
    core.sleep(2)
    core.wake_up(["weights"], reload_weights=True)
    core.wake_up(["kv_cache"])
    assert _reference(core, "again") == reference


def test_wake_up_order_kv_cache_first_also_works(core):
    reference = _reference(core)
    core.sleep(2)
    core.wake_up(["kv_cache"])
    assert core.is_sleeping()
    core.wake_up(["weights"], reload_weights=True)
    assert not core.is_sleeping()
    assert _reference(core, "after") == reference


def test_sleep_0_freezes_scheduling_only(core):
    reference = _reference(core)
    req_ids = _add_all(core, "z")
    results = Results()
    results.add(core.step())
    kv_refs = _storage_refs(layer.kv_cache for layer in core.executor.worker.attn_layers)
    core.sleep(0, mode="keep")  # vLLM's default mode, "abort", would end them
    assert core.is_sleeping() and _alive(kv_refs) == len(kv_refs)
    assert results.add(core.step()) == 0
    with pytest.raises(EngineNotReadyError, match="asleep"):
        core.add_request(_request("x", PROMPTS[0]))
    core.wake_up(["weights"])  # not asleep: nothing to do
    assert core.is_sleeping()
    core.wake_up(["scheduling"])
    assert not core.is_sleeping()
    _run(core, results)
    assert {i: results.tokens[r] for i, r in enumerate(req_ids)} == reference


def test_sleep_0_in_abort_mode_ends_the_requests_in_flight(core):
    """vLLM's sleep(level=0) default, mode "abort": in-flight requests end (finish reason abort)."""
    _add_all(core, "y")
    core.step()
    core.sleep(0)
    aborted = [o for o in core.step().outputs if o.finish_reason is not None]
    assert aborted and all(o.finish_reason == FinishReason.ABORT for o in aborted)
    assert not core.has_unfinished_requests()
    core.wake_up()
    assert not core.is_sleeping()


def test_bad_arguments_raise_value_error_naming_them_and_change_nothing(core):
    def state():
        return (core.is_paused(), core.is_sleeping(), core.scheduler.pause_state)

    before = state()
    with pytest.raises(ValueError, match="mode"):
        core.pause_generation("pause_everything")
    for level in (3, -1, True, "1"):
        with pytest.raises(ValueError, match="level"):
            core.sleep(level)
    with pytest.raises(ValueError, match="tags"):
        core.wake_up(["weights", "gpu"])
    assert state() == before
    core.sleep(1)
    asleep = set(core.control.asleep)
    with pytest.raises(ValueError, match="tags"):
        core.wake_up(["bogus"])
    for level in (2, 0):  # another level while asleep: the caller's mistake (400 over HTTP), nothing changes
        with pytest.raises(ValueError, match="already asleep at level 1"):
            core.sleep(level)
    assert core.control.asleep == asleep and core.executor.worker.sleeper.asleep == {"weights", "kv_cache"}
    core.wake_up()
    core.add_request(_request("ok", PROMPTS[0]))
    assert len(_run(core).tokens["ok"]) == MAX_TOKENS


def test_prometheus_gauges_show_pause_state_and_sleep_level(config):
    from engine.metrics.prometheus import PrometheusStatLogger

    logger = PrometheusStatLogger(config, "tiny", engine_indexes=(0, 1))
    assert logger.snapshot()["rollout:engine_paused"] == 0
    logger.record(SchedulerStats(pause_state=2, sleep_level=2), None, engine_index=0)
    logger.record(SchedulerStats(pause_state=1, sleep_level=0), None, engine_index=1)
    snapshot = logger.snapshot()
    assert snapshot["rollout:engine_paused"] == 2 and snapshot["rollout:engine_sleep_level"] == 2
    text = logger.prometheus_text().decode()
    assert 'rollout:engine_sleep_level{engine="0",model_name="tiny"} 2.0' in text


# ---- over a real engine process --------------------------------------------------------------


@pytest.fixture(scope="module")
def mp_client(config):
    client = EngineCoreClient.make_client(config, multiprocess=True, asyncio_mode=False)
    yield client
    client.shutdown()


def _drain(client, timeout_s: float = 0.5) -> list:
    """Every message that arrives within timeout_s of the last one (never blocks forever)."""
    messages = []
    while True:
        try:
            messages.append(client._outputs.get(timeout=timeout_s))
        except queue.Empty:
            return messages


def _mp_run(client, requests) -> Results:
    results = Results()
    for r in requests:
        client.add_request(r)
    while len(results.finish_reasons) < len(requests):
        results.add(client.get_output())
    return results


def _mp_reference(client, prefix: str) -> dict[int, list[int]]:
    results = _mp_run(client, [_request(f"{prefix}{i}", p) for i, p in enumerate(PROMPTS)])
    client.call_utility("reset_prefix_cache")
    return {i: results.tokens[f"{prefix}{i}"] for i in range(len(PROMPTS))}


@pytest.mark.slow
def test_mp_pause_modes_over_a_real_engine_process(mp_client):
    client = mp_client
    reference = _mp_reference(client, "ref")
    _drain(client, 0.2)

    # abort: in-flight requests end with ABORT, new ones are refused until resume.
    long = [_request(f"a{i}", p, max_tokens=MAX_MODEL_LEN - 12) for i, p in enumerate(PROMPTS)]
    for r in long:
        client.add_request(r)
    results = Results()
    results.add(client.get_output())
    aborted = client.call_utility("pause_generation", "abort")
    assert sorted(aborted) == sorted(r.request_id for r in long)
    while len(results.finish_reasons) < len(long):
        results.add(client.get_output())
    assert set(results.finish_reasons.values()) == {FinishReason.ABORT}
    client.add_request(_request("refused", PROMPTS[0]))
    refused = next(o for m in _drain(client) for o in m.outputs if o.request_id == "refused")
    assert refused.finish_reason == FinishReason.ERROR and "paused" in refused.stop_reason
    assert client.call_utility("is_paused") is True
    client.call_utility("resume_generation")

    # keep: frozen (no tokens while paused), new requests queue, then the same greedy tokens.
    client.add_request(_request("k0", PROMPTS[0]))
    results = Results()
    while not results.tokens.get("k0"):
        results.add(client.get_output())
    client.call_utility("pause_generation", "keep")
    before = _drain(client, 0.2)  # what was sent up to the pause, and the pause's stats
    for m in before:
        results.add(m)
    assert before[-1].scheduler_stats.pause_state == PauseState.PAUSED_ALL
    at_pause = list(results.tokens["k0"])
    client.add_request(_request("k1", PROMPTS[1]))
    time.sleep(0.5)
    assert sum(len(o.new_token_ids) for m in _drain(client) for o in m.outputs) == 0
    assert results.tokens["k0"] == at_pause
    client.call_utility("resume_generation")
    while len(results.finish_reasons) < 2:
        results.add(client.get_output())
    assert results.tokens["k0"] == reference[0] and results.tokens["k1"] == reference[1]

    # wait: in-flight requests finish, new ones are refused; the frontend polls.
    client.add_request(_request("w0", PROMPTS[2]))
    client.call_utility("pause_generation", "wait")
    results = Results()
    while "w0" not in results.finish_reasons:
        results.add(client.get_output())
    assert results.tokens["w0"] == reference[2]
    assert client.call_utility("has_unfinished_requests") is False
    client.call_utility("resume_generation")

    with pytest.raises(EngineUtilityError, match="mode"):
        client.call_utility("pause_generation", "bogus")
    assert client.call_utility("is_paused") is False


@pytest.mark.slow
def test_mp_sleep_and_partial_wake_up_over_a_real_engine_process(mp_client):
    client = mp_client
    reference = _mp_reference(client, "sref")
    _drain(client, 0.2)
    client.call_utility("sleep", 2)
    assert client.call_utility("is_sleeping") is True
    stats = [m.scheduler_stats for m in _drain(client) if m.scheduler_stats is not None]
    assert stats and stats[-1].sleep_level == 2 and stats[-1].pause_state == PauseState.PAUSED_ALL
    client.add_request(_request("refused", PROMPTS[0]))
    refused = next(o for m in _drain(client) for o in m.outputs if o.request_id == "refused")
    assert refused.finish_reason == FinishReason.ERROR and "asleep" in refused.stop_reason
    with pytest.raises(EngineUtilityError, match="level"):
        client.call_utility("sleep", 3)
    with pytest.raises(EngineUtilityError, match="tags"):
        client.call_utility("wake_up", ["weights", "gpu"])
    client.call_utility("wake_up", ["weights"], True)  # reload_weights: the checkpoint read again
    assert client.call_utility("is_sleeping") is True
    client.call_utility("wake_up", ["kv_cache"])
    assert client.call_utility("is_sleeping") is False
    stats = [m.scheduler_stats for m in _drain(client) if m.scheduler_stats is not None]
    assert stats[-1].sleep_level == 0 and stats[-1].pause_state == PauseState.UNPAUSED
    assert _mp_reference(client, "safter") == reference
    client.call_utility("sleep", 1)
    client.call_utility("wake_up")
    assert _mp_reference(client, "safter1") == reference
