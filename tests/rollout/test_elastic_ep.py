"""Elastic expert parallelism of a lockstep group (rollout/elastic_ep.py): scale 2 -> 3 -> 2 in two phases under a
steady request stream, with no request lost, the same seeded outputs, the group's current weights on every engine;
the bad-input errors; and the HTTP routes of a real `rollout launch` server."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from unittest import mock

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engine.sampling_params import SamplingParams
from rollout import RolloutWorker
from rollout.elastic_ep import ElasticEPStateError
from rollout.group import RolloutGroup
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.local import make_update_info

ENGINE_ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "disable_log_stats": True}
PROMPTS = ["The quick brown fox", "Once upon a time", "A rollout is", "hello world", "one two three", "RL with PPO"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True) for i in range(3)]
NUM_EXPERTS = 8  # the tiny Qwen3-MoE: 8 experts, so 3 engines hold uneven ranges (2, 3, 3)
# Changed by a weight update before any size change: a dense weight and an expert engine 1 holds at size 2.
UPDATED = {"model.norm.weight": 1.5, "model.layers.0.mlp.experts.6.down_proj.weight": -2.0}


def _one_thread_per_engine():
    # Engine processes inherit it: lockstep CPU engines whose thread pools each span every core step ~8x slower.
    return mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def moe_checkpoint(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def lockstep(moe_checkpoint):
    with _one_thread_per_engine():
        worker = RolloutWorker(model=moe_checkpoint, multiprocess=True, data_parallel_size=2,
                               enable_expert_parallel=True, **ENGINE_ARGS)
    with worker:
        yield worker


def _reference(worker: RolloutWorker) -> list[list[int]]:
    outputs = worker.generate(PROMPTS, GREEDY) + [worker.generate(PROMPTS[i], p)[0] for i, p in enumerate(SEEDED)]
    return [o.outputs[0].token_ids for o in outputs]


class _Stream:
    """Background threads that each keep one request in flight (greedy and seeded sampling, in turn) until stopped."""

    def __init__(self, worker: RolloutWorker, num_threads: int = 2) -> None:
        self.worker, self.reasons, self.errors = worker, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def _loop(self, index: int) -> None:
        i = 0
        while not self._stop.is_set():
            params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True)
            try:
                out = self.worker.generate(PROMPTS[(index + i) % len(PROMPTS)], params)[0]
                self.reasons.append(out.outputs[0].finish_reason)
            except Exception as e:  # noqa: BLE001 - every failure is a lost request: the test reports it
                self.errors.append(repr(e))
            i += 1

    def wait_for(self, num_more: int, timeout_s: float = 60.0) -> None:
        target, deadline = len(self.reasons) + num_more, time.monotonic() + timeout_s
        while len(self.reasons) < target and not self.errors:
            assert time.monotonic() < deadline, "the stream stalled"
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _check_group(worker: RolloutWorker, size: int, state: dict[str, torch.Tensor]) -> None:
    group = worker.engine
    assert group.num_engines == size and group.elastic_ep_state()["pending"] is None
    states = worker._run(group.dp_states())
    assert [(s["dp_rank"], s["dp_size"]) for s in states] == [(r, size) for r in range(size)]
    expected = hf_state_checksums(state)
    report = worker._run(group.weight_checker())
    experts_held = []
    for engine_report in report["engines"]:
        checksums = engine_report["checksums"]
        assert checksums == {name: expected[name] for name in checksums}  # the group's current weights
        experts_held += sorted({int(n.split(".")[5]) for n in checksums if ".experts." in n})
    assert experts_held == list(range(NUM_EXPERTS))  # every expert on exactly one engine, in rank order
    assert worker.get_weight_version() == "v1"


@pytest.mark.slow
def test_scale_2_to_3_to_2_under_a_request_stream(lockstep, moe_checkpoint):
    group = lockstep.engine
    state = load_file(os.path.join(moe_checkpoint, "model.safetensors"))
    for name, factor in UPDATED.items():
        state[name] = state[name] * factor
    lockstep.init_weight_transfer_engine({"backend": "local"})
    lockstep.start_weight_update()
    lockstep.update_weights(make_update_info(((n, state[n]) for n in UPDATED), "b64"))
    lockstep.finish_weight_update("v1")
    _check_group(lockstep, 2, state)
    before = _reference(lockstep)

    stream = _Stream(lockstep)
    try:
        stream.wait_for(4)
        prepared = lockstep._run(group.prepare_elastic_ep(3))
        assert prepared["pending"] == {"old_data_parallel_size": 2, "new_data_parallel_size": 3, "generation": 1}
        assert group.num_engines == 2  # nothing routed to the new engine before commit
        with pytest.raises(ElasticEPStateError, match="is prepared"):
            lockstep._run(group.prepare_elastic_ep(2))
        assert lockstep._run(group.commit_elastic_ep())["data_parallel_size"] == 3
        stream.wait_for(8)
        _check_group(lockstep, 3, state)
        new_engine = lockstep._run(group.engines[2].get_dp_state())
        assert _reference(lockstep) == before
        assert group.balancer.num_routed[2] > 0  # the new engine serves requests (6 prompts at once spread over 3)
        stepped = lockstep._run(group.engines[2].get_dp_state())
        assert stepped["num_real_steps"] > new_engine["num_real_steps"]
        assert stepped["num_syncs"] > new_engine["num_syncs"] > 0  # it steps in the group's waves

        lockstep.prepare_elastic_ep(2)  # the RolloutWorker form of the same call
        assert group.num_engines == 2
        lockstep.commit_elastic_ep()
        stream.wait_for(6)
        _check_group(lockstep, 2, state)
        assert _reference(lockstep) == before
    finally:
        stream.stop()
    assert not stream.errors, stream.errors
    assert len(stream.reasons) >= 24 and set(stream.reasons) == {"length"}


def test_bad_elastic_calls_change_nothing(lockstep):
    group = lockstep.engine
    for size, match in [(0, "positive int"), ("3", "positive int"), (True, "positive int"),
                        (2, "has 2 engines already"), (NUM_EXPERTS + 1, "exceed the model's 8 experts")]:
        with pytest.raises(ValueError, match=match):
            lockstep._run(group.prepare_elastic_ep(size))
    with pytest.raises(ValueError, match="drain_timeout_s must be a positive number"):
        lockstep._run(group.prepare_elastic_ep(1, drain_timeout_s=0))
    with pytest.raises(ValueError, match="ready_timeout_s must be a positive number"):
        lockstep._run(group.commit_elastic_ep(ready_timeout_s=-1))
    with pytest.raises(ElasticEPStateError, match="no elastic EP change is prepared"):
        lockstep._run(group.commit_elastic_ep())
    assert group.elastic_ep_state()["pending"] is None and group.num_engines == 2
    not_lockstep = object.__new__(RolloutGroup)
    not_lockstep.elastic = None
    with pytest.raises(ValueError, match="needs a lockstep group"):
        lockstep._run(not_lockstep.prepare_elastic_ep(3))


@pytest.mark.slow
def test_elastic_ep_over_http(launch_server, moe_checkpoint):
    with _one_thread_per_engine():
        server = launch_server(moe_checkpoint, "--data-parallel-size", "2", "--enable-expert-parallel",
                               "--enable-rl-routes")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        def complete() -> list[int]:
            body = {"model": server.served_model, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        before = complete()
        assert http.get("/elastic_ep").json() == {"data_parallel_size": 2, "generation": 0, "pending": None}
        r = http.post("/elastic_ep/commit")
        assert r.status_code == 409 and "no elastic EP change" in r.json()["error"]["message"]
        r = http.post("/elastic_ep/prepare", json={"new_data_parallel_size": "3"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.new_data_parallel_size"  # where it was sent
        r = http.post("/elastic_ep/prepare", json={"new_data_parallel_size": 3})
        assert r.status_code == 200, r.text
        assert r.json()["pending"]["new_data_parallel_size"] == 3
        r = http.post("/elastic_ep/commit")
        assert r.status_code == 200 and r.json() == {"data_parallel_size": 3, "generation": 1, "pending": None}
        assert [complete() for _ in range(3)] == [before] * 3
        assert http.post("/elastic_ep/prepare", json={"new_data_parallel_size": 2}).status_code == 200
        assert http.post("/elastic_ep/commit").json()["data_parallel_size"] == 2
        assert complete() == before
        # vLLM's one-call scale and its status body, over the same two phases
        assert http.post("/is_scaling_elastic_ep").json() == {
            "is_scaling_elastic_ep": False, "phase": "idle", "epoch": 2, "error": None,
            "requested_data_parallel_size": None}
        r = http.post("/scale_elastic_ep", json={"new_data_parallel_size": 3, "drain_timeout": 60})
        assert r.status_code == 200 and r.json() == {"message": "Scaled to 3 data parallel engines"}
        assert http.get("/elastic_ep").json()["data_parallel_size"] == 3
        assert http.post("/is_scaling_elastic_ep").json()["epoch"] == 3
        r = http.post("/scale_elastic_ep", json={"new_data_parallel_size": 3})
        assert r.status_code == 400 and "3 engines already" in r.json()["error"]["message"]
        assert http.post("/is_scaling_elastic_ep").json()["phase"] == "failed"
        assert [complete() for _ in range(3)] == [before] * 3


async def _finish_reason(stream) -> str:
    last = None
    async for out in stream:
        last = out
    return last.outputs[0].finish_reason


def _held_experts(worker: RolloutWorker) -> list[list[int]]:
    report = worker._run(worker.engine.weight_checker())
    return [sorted({int(n.split(".")[5]) for n in r["checksums"] if ".experts." in n}) for r in report["engines"]]


@pytest.mark.slow
def test_scale_down_drains_the_leaving_engine_and_one_engine_scales_back_up(lockstep):
    group = lockstep.engine
    before = _reference(lockstep)
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    async def scale_down_under_load() -> list[str]:
        tasks = [asyncio.create_task(_finish_reason(group.generate(p, long))) for p in PROMPTS[:2]]
        while group.balancer.num_in_flight != [1, 1]:  # one long request on each engine
            await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError, match="did not finish within 0.05 s"):
            await group.prepare_elastic_ep(1, drain_timeout_s=0.05)
        assert group.num_routable == 2 and group.elastic_ep_state()["pending"] is None  # nothing changed
        await group.prepare_elastic_ep(1)  # waits for engine 1's request; engine 0's freezes, then resumes
        assert not tasks[1].done() or tasks[1].result() == "length"
        await group.commit_elastic_ep()
        return list(await asyncio.gather(*tasks))

    assert lockstep._run(scale_down_under_load()) == ["length", "length"]
    assert [s["dp_size"] for s in lockstep._run(group.dp_states())] == [1]
    assert _held_experts(lockstep) == [list(range(NUM_EXPERTS))]
    assert _reference(lockstep) == before
    lockstep.prepare_elastic_ep(2)
    lockstep.commit_elastic_ep()
    assert [(s["dp_rank"], s["dp_size"]) for s in lockstep._run(group.dp_states())] == [(0, 2), (1, 2)]
    assert _held_experts(lockstep) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _reference(lockstep) == before
    deadline = time.monotonic() + 30
    states = lockstep._run(group.dp_states())
    while any(s["wave_running"] for s in states):  # a wave ends at its first sync without work
        assert time.monotonic() < deadline, states
        time.sleep(0.02)
        states = lockstep._run(group.dp_states())
    assert states[0]["wave"] == states[1]["wave"] > 0  # the new engine took the group's wave counter


def test_the_wave_router_resizes():
    from rollout.dp_coordinator import WaveRouter

    router = WaveRouter(2)
    router.on_hello(0)
    router.on_hello(1)
    with pytest.raises(ValueError, match="out of range"):
        router.on_hello(2)
    router.resize(3)
    assert router.on_start_wave(0, 4) == [(1, 4)]  # engine 2 has not said hello: kept for it
    assert router.state()["connected"] == [0, 1]
    assert router.on_hello(2) == [(2, 4)]
    router.resize(2)
    assert router.state() == {"num_engines": 2, "connected": [0, 1], "wave": 4, "num_waves_forwarded": 1}
    router.resize(3)  # a new engine 2 is a new process: it must say hello again
    assert router.state()["connected"] == [0, 1]
    with pytest.raises(ValueError, match="num_engines must be >= 1"):
        router.resize(0)


def test_the_coordinator_process_resizes_and_reports_connected_engines():
    import msgspec
    import zmq

    from engine.dp_core_proc import WaveMessage
    from rollout.dp_coordinator import DPCoordinatorHandle, free_port_pair

    handle = DPCoordinatorHandle(2, "127.0.0.1", free_port_pair())
    ctx = zmq.Context()
    sockets = []

    def hello(rank: int) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        sock.connect(handle.waves_address)
        sock.send(msgspec.msgpack.encode(WaveMessage("hello", rank)))
        sockets.append(sock)
        return sock

    def connected() -> list[int]:
        deadline = time.monotonic() + 30
        while True:
            state = handle.state()
            if len(state["connected"]) == state["num_engines"] or time.monotonic() > deadline:
                return state["connected"]
            time.sleep(0.02)

    try:
        hello(0), hello(1)
        assert connected() == [0, 1]
        assert handle.resize(3)["num_engines"] == 3
        new = hello(2)
        assert connected() == [0, 1, 2]
        notify = ctx.socket(zmq.PUSH)
        sockets.append(notify)
        notify.connect(handle.notify_address)
        notify.send(msgspec.msgpack.encode(WaveMessage("start_wave", 0, 7)))
        assert new.poll(30_000) and msgspec.msgpack.decode(new.recv(), type=WaveMessage).wave == 7
        assert handle.resize(2)["connected"] == [0, 1]
        with pytest.raises(RuntimeError, match="num_engines must be >= 1"):
            handle.resize(0)
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
        handle.shutdown()
