"""Fault tolerance of the EngineCore process: a failed step ends in-flight requests with errors, then retry or exit."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engine.async_llm import AsyncLLM
from engine.core_client import EngineUtilityError, InprocClient
from engine.engine_args import create_engine_config
from engine.exceptions import EngineDeadError
from engine.mp_client import SyncMPClient
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest, EngineStatus, FinishReason

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MAX_MODEL_LEN = 256
LONG = 200  # max_tokens that keep requests in flight well past the injected fault
SHORT = 8


def _config(tiny_checkpoint, **overrides):
    args = dict(model=tiny_checkpoint("llama"), max_model_len=MAX_MODEL_LEN, device="cpu", dtype="float32",
                max_num_seqs=8, disable_log_stats=True)
    return create_engine_config(**{**args, **overrides})


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, int(rng.integers(5, 20))).tolist() for _ in range(num)]


def _requests(prompts, prefix: str, max_tokens: int) -> list[EngineCoreRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [EngineCoreRequest(f"{prefix}{i}", p, params, eos_token_id=None) for i, p in enumerate(prompts)]


def _run(client, requests) -> tuple[dict, dict, list]:
    """Adds `requests` and reads until all finish: (tokens, finished output, statuses seen)."""
    for r in requests:
        client.add_request(r)
    tokens, finished, statuses = {r.request_id: [] for r in requests}, {}, []
    while len(finished) < len(requests):
        outputs = client.get_output()
        if outputs.engine_status is not None:
            statuses.append(outputs.engine_status)
        for out in outputs.outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
    return tokens, finished, statuses


def _start_and_fail(client, requests) -> tuple[dict, list]:
    """Starts long requests, injects a fault once they run, reads until every one has finished."""
    for r in requests:
        client.add_request(r)
    finished, statuses, injected = {}, [], False
    while len(finished) < len(requests):
        outputs = client.get_output()
        if outputs.engine_status is not None:
            statuses.append(outputs.engine_status)
        finished.update({o.request_id: o for o in outputs.outputs if o.finished})
        if not injected and outputs.outputs:
            client.call_utility("inject_fault", "step")  # the engine's next step raises
            injected = True
    return finished, statuses


def _assert_failed_by_fault(finished: dict) -> None:
    for req_id, out in finished.items():
        assert out.finish_reason == FinishReason.ERROR, req_id
        assert "InjectedFault" in out.stop_reason, out.stop_reason


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Greedy tokens of a fresh engine."""
    client = InprocClient(_config(tiny_checkpoint))
    tokens, _, _ = _run(client, _requests(_prompts(3), "ok", SHORT))
    client.shutdown()
    return tokens


def test_retry_after_a_fault_serves_again_with_the_same_tokens(tiny_checkpoint, reference):
    client = SyncMPClient(_config(tiny_checkpoint, enable_fault_tolerance=True, enable_fault_injection=True))
    try:
        assert client.fault_tolerance_status() == "healthy"
        finished, statuses = _start_and_fail(client, _requests(_prompts(3, seed=5), "ok", LONG))
        _assert_failed_by_fault(finished)
        assert statuses == [EngineStatus.UNHEALTHY]
        assert client.fault_tolerance_status() == "unhealthy" and client.engine_status == EngineStatus.UNHEALTHY

        # While unhealthy: new requests end at once with an error, utility calls fail fast.
        _, refused, _ = _run(client, _requests(_prompts(1, seed=9), "late", SHORT))
        assert refused["late0"].finish_reason == FinishReason.ERROR and "unhealthy" in refused["late0"].stop_reason
        with pytest.raises(EngineUtilityError, match="unhealthy"):
            client.call_utility("reset_prefix_cache")

        assert client.apply_fault_tolerance_instruction("retry") == "healthy"
        assert client.fault_tolerance_status() == "healthy"
        # The failed requests' ids are free again, and greedy tokens match a fresh engine's.
        tokens, finished, statuses = _run(client, _requests(_prompts(3), "ok", SHORT))
        assert statuses == [EngineStatus.HEALTHY]  # pushed by the recovery, read before these outputs
        assert tokens == reference
        assert all(out.finish_reason == FinishReason.LENGTH for out in finished.values())
        assert client.apply_fault_tolerance_instruction("retry") == "healthy"  # nothing to recover: a no-op
    finally:
        client.shutdown()


def test_no_retry_within_the_timeout_kills_the_engine(tiny_checkpoint):
    config = _config(tiny_checkpoint, enable_fault_tolerance=True, enable_fault_injection=True,
                     engine_recovery_timeout_sec=2.0)
    client = SyncMPClient(config)
    try:
        finished, _ = _start_and_fail(client, _requests(_prompts(2), "r", LONG))
        _assert_failed_by_fault(finished)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                client.get_output()  # the DEAD push, then death
        assert time.monotonic() - start < 30
        assert client.engine_status == EngineStatus.DEAD
        assert client.fault_tolerance_status() == "dead"
        assert client.engine.exitcode not in (0, None)
        with pytest.raises(EngineDeadError):
            client.apply_fault_tolerance_instruction("retry")
    finally:
        client.shutdown()


def test_without_fault_tolerance_a_fault_fails_requests_then_the_engine_exits(tiny_checkpoint):
    client = SyncMPClient(_config(tiny_checkpoint, enable_fault_injection=True))
    try:
        finished, statuses = _start_and_fail(client, _requests(_prompts(3), "r", LONG))
        _assert_failed_by_fault(finished)  # errors first (never a hang) ...
        assert statuses == [EngineStatus.DEAD]
        with pytest.raises(EngineDeadError):  # ... then the death monitor
            client.get_output()
        assert client.engine.exitcode not in (0, None)
    finally:
        client.shutdown()


def test_injection_is_refused_unless_enabled_and_instructions_are_checked(tiny_checkpoint, reference):
    client = SyncMPClient(_config(tiny_checkpoint, enable_fault_tolerance=True))
    try:
        with pytest.raises(EngineUtilityError, match="fault injection is off"):
            client.call_utility("inject_fault", "step")
        with pytest.raises(ValueError, match="instruction"):
            client.apply_fault_tolerance_instruction("reboot")
        assert client.apply_fault_tolerance_instruction("retry") == "healthy"
        tokens, _, statuses = _run(client, _requests(_prompts(3), "ok", SHORT))
        assert tokens == reference and statuses == []
    finally:
        client.shutdown()


def test_inproc_client_recovers_too(tiny_checkpoint, reference):
    client = InprocClient(_config(tiny_checkpoint, enable_fault_tolerance=True, enable_fault_injection=True))
    try:
        finished, statuses = _start_and_fail(client, _requests(_prompts(3, seed=5), "ok", LONG))
        _assert_failed_by_fault(finished)
        assert statuses == [EngineStatus.UNHEALTHY] and client.fault_tolerance_status() == "unhealthy"
        with pytest.raises(RuntimeError, match="unhealthy"):
            client.add_request(_requests(_prompts(1), "late", SHORT)[0])
        with pytest.raises(ValueError, match="instruction"):
            client.apply_fault_tolerance_instruction("reboot")
        assert client.apply_fault_tolerance_instruction("retry") == "healthy"
        tokens, _, _ = _run(client, _requests(_prompts(3), "ok", SHORT))
        assert tokens == reference
    finally:
        client.shutdown()


def test_async_llm_fault_retry_cycle(tiny_checkpoint, reference):
    llm = AsyncLLM(_config(tiny_checkpoint, enable_fault_tolerance=True, enable_fault_injection=True))

    async def generate(prompt, max_tokens, request_id, started=None):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = []
        async for out in llm.generate({"prompt_token_ids": prompt}, params, request_id):
            outputs.append(out)
            if started is not None:
                started.set()
        return outputs

    async def main():
        assert await llm.fault_tolerance_status() == _status("healthy")
        started = [asyncio.Event() for _ in range(3)]
        long = [
            asyncio.create_task(generate(p, LONG, f"long{i}", started[i]))
            for i, p in enumerate(_prompts(3, seed=5))
        ]
        await asyncio.gather(*(e.wait() for e in started))
        await llm.engine_core.call_utility_async("inject_fault", "step")
        for task in long:
            final = (await task)[-1]
            assert final.finished and final.outputs[0].finish_reason == "error"
            assert "InjectedFault" in final.outputs[0].stop_reason
        assert await llm.fault_tolerance_status() == _status("unhealthy")
        assert llm.engine_status == EngineStatus.UNHEALTHY
        refused = (await generate(_prompts(1)[0], SHORT, "late"))[-1]
        assert refused.outputs[0].finish_reason == "error"
        with pytest.raises(ValueError):
            await llm.apply_fault_tolerance_instruction("reboot")
        with pytest.raises(ValueError, match="params"):
            await llm.apply_fault_tolerance_instruction("retry", params=["x"])

        await llm.apply_fault_tolerance_instruction("retry")
        assert await llm.fault_tolerance_status() == _status("healthy")
        results = await asyncio.gather(*(generate(p, SHORT, f"ok{i}") for i, p in enumerate(_prompts(3))))
        assert {f"ok{i}": r[-1].outputs[0].token_ids for i, r in enumerate(results)} == reference
        assert llm.engine_status == EngineStatus.HEALTHY

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def _status(status: str) -> dict:
    """vLLM's /fault_tolerance/status body of one engine, with our worst status and enabled flag."""
    return {"schema_version": 1, "total_engines": 1, "engines": [{"id": 0, "status": status}],
            "status": status, "enabled": True}
