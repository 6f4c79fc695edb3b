"""Lockstep data-parallel engines (expert parallelism over two engine processes): waves, dummy batches,
the DP state sync, two-phase pause and the coordinator process that forwards START_WAVE.

The model is the tiny MoE checkpoint, so every forward pass runs expert-parallel collectives
across the two engines: a step that one engine takes and the other does not would hang.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from unittest import mock

import msgspec
import pytest
import zmq

from engine.dp_core_proc import WaveMessage
from engine.exceptions import EngineNotReadyError
from engine.sampling_params import SamplingParams
from rollout import RolloutWorker
from rollout.dp_coordinator import DPCoordinatorHandle, WaveRouter, free_port_pair

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=256, disable_log_stats=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "A rollout is", "hello world", "one two three", "RL with PPO"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYNC_INTERVAL = 16


@pytest.fixture(scope="module")
def lockstep(tiny_checkpoint):
    # One intra-op thread per engine process (they inherit the variable): two engines whose
    # thread pools each span both cores of a small CI machine step ~8x slower in lockstep.
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        worker = RolloutWorker(model=tiny_checkpoint("qwen3_moe"), multiprocess=True, data_parallel_size=2,
                               enable_expert_parallel=True, dp_sync_interval=SYNC_INTERVAL, **ENGINE_ARGS)
    with worker:
        assert worker.engine.lockstep
        yield worker


def _states(worker: RolloutWorker) -> list[dict]:
    return worker._run(worker.engine.dp_states())


def _wait_idle(worker: RolloutWorker, timeout_s: float = 60.0) -> list[dict]:
    """The engines' states once no wave runs (a wave ends at the first sync after the work is done)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = _states(worker)
        if not any(s["wave_running"] for s in states):
            return states
        assert time.monotonic() < deadline, f"the wave never completed: {states}"
        time.sleep(0.02)


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if isinstance(after[k], int) and not isinstance(after[k], bool)}


async def _finish_reason(stream) -> str:
    """The request's finish reason, or "refused" when the engine turned it away (paused)."""
    last = None
    try:
        async for out in stream:
            last = out
    except EngineNotReadyError:
        return "refused"
    return last.outputs[0].finish_reason


def test_lockstep_outputs_match_one_engine(lockstep, tiny_checkpoint):
    dp_greedy = lockstep.generate(PROMPTS, GREEDY)
    assert all(n > 0 for n in lockstep.engine.balancer.num_routed)
    with RolloutWorker(model=tiny_checkpoint("qwen3_moe"), **ENGINE_ARGS) as single:
        expected = single.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in dp_greedy] == [o.outputs[0].token_ids for o in expected]


def test_work_on_one_engine_steps_the_other_in_lockstep_until_the_wave_completes(lockstep):
    group = lockstep.engine
    before = _wait_idle(lockstep)
    assert before[0]["wave"] == before[1]["wave"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reason = lockstep._run(_finish_reason(group.engines[0].generate("hello world", params, request_id="only-0")))
    assert reason == "length"
    after = _wait_idle(lockstep)
    busy, idle = _delta(after[0], before[0]), _delta(after[1], before[1])
    assert busy["num_real_steps"] == 20 and idle["num_real_steps"] == 0  # one token per step
    # Every step of the wave the idle engine ran a dummy batch; the wave ran on to the first
    # sync (steps 0, 16, 32, ...) that found no work anywhere: step 32, the 33rd forward pass.
    num_forwards = busy["num_real_steps"] + busy["num_dummy_batches"]
    assert idle["num_dummy_batches"] == num_forwards == 2 * SYNC_INTERVAL + 1
    assert busy["num_syncs"] == idle["num_syncs"] == 3
    for d in (busy, idle):
        assert d["wave"] == 1 and d["num_waves_completed"] == 1
    assert after[0]["wave"] == after[1]["wave"]


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_pause_with_one_engine_idle_completes_after_one_dummy_batch(lockstep, mode):
    group = lockstep.engine
    long = SamplingParams(temperature=0.0, max_tokens=2 * SYNC_INTERVAL + 24, ignore_eos=True)

    async def scenario():
        before = await group.dp_states()
        task = asyncio.create_task(_finish_reason(group.engines[0].generate("Once upon a time", long)))
        # Mid-wave, between two syncs: engine 0 decodes, engine 1 runs dummy batches.
        while (await group.dp_states())[0]["num_real_steps"] - before[0]["num_real_steps"] < SYNC_INTERVAL + 4:
            await asyncio.sleep(0.005)
        mid = await group.dp_states()
        await group.pause_generation(mode)
        paused = await group.dp_states()
        await group.resume_generation()
        return before, mid, paused, await asyncio.wait_for(task, 60)

    before, mid, paused, reason = lockstep._run(scenario())
    idle = _delta(paused[1], mid[1])
    assert idle["num_real_steps"] == 0 and idle["num_pauses"] == 1
    # With a sync every 16 steps, the pause still completed one step after it arrived.
    assert paused[1]["last_pause_num_steps"] == 1
    assert paused[0]["last_pause_num_steps"] <= 2  # the busy engine may have seen it one step earlier
    for state in paused:  # the pause ended the wave on both engines at the same step
        assert not state["wave_running"] and not state["pause_pending"]
        assert state["wave"] == mid[0]["wave"] + 1
    assert paused[0]["num_syncs"] - before[0]["num_syncs"] == paused[1]["num_syncs"] - before[1]["num_syncs"]
    assert reason == ("length" if mode == "keep" else "abort")  # keep: resumed where it stopped
    _wait_idle(lockstep)


def test_a_pause_of_an_idle_group_runs_one_dummy_batch(lockstep):
    before = _wait_idle(lockstep)
    lockstep.pause_generation("wait")
    after = _states(lockstep)
    lockstep.resume_generation()
    deltas = [_delta(a, b) for b, a in zip(before, after)]
    for d in deltas:
        assert d == {**d, "num_real_steps": 0, "wave": 1, "num_pauses": 1, "num_syncs": d["num_dummy_batches"]}
    # One dummy batch; two when one engine's START_WAVE (via the coordinator) reaches the other before
    # the group's pause call does: that engine's first sync then sees only one pause pending.
    assert deltas[0]["num_dummy_batches"] == deltas[1]["num_dummy_batches"] in (1, 2), deltas
    assert lockstep.is_paused() is False


def test_sleep_and_wake_up_pause_the_lockstep_group_first(lockstep):
    lockstep.sleep(1)
    states = _states(lockstep)
    assert not any(s["wave_running"] for s in states)
    assert lockstep.is_sleeping() is True
    lockstep.wake_up()
    assert lockstep.is_sleeping() is False and lockstep.is_paused() is False
    assert lockstep.generate("hello", GREEDY)[0].finished


def test_randomized_submit_pause_resume_sequences_never_deadlock(lockstep):
    group = lockstep.engine
    rng = random.Random(1234)
    allowed = {"abort": {"length", "abort", "refused"}, "wait": {"length", "refused"}, "keep": {"length"}}

    async def sequence(i: int) -> None:
        tasks = []
        for j in range(rng.randint(0, 3)):
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True)
            tasks.append(asyncio.create_task(_finish_reason(group.generate(rng.choice(PROMPTS), params, f"r{i}-{j}"))))
        await asyncio.sleep(rng.choice([0, 0, 0.002, 0.01, 0.02]))
        mode = rng.choice(["abort", "wait", "keep"])
        await group.pause_generation(mode)
        if mode == "keep" and rng.random() < 0.5:  # queued while paused, served after resume
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            tasks.append(asyncio.create_task(_finish_reason(group.generate("a b c", params, f"r{i}-late"))))
            await asyncio.sleep(0.005)
        await group.resume_generation()
        reasons = await asyncio.gather(*tasks)
        assert set(reasons) <= allowed[mode], (i, mode, reasons)

    async def run_all() -> None:
        for i in range(100):
            await sequence(i)

    before = _wait_idle(lockstep)
    lockstep._run(asyncio.wait_for(run_all(), timeout=300))
    after = _wait_idle(lockstep)
    assert after[0]["wave"] == after[1]["wave"]
    deltas = [_delta(a, b) for a, b in zip(after, before)]
    for d in deltas:
        assert d["num_pauses"] == 100
    # Lockstep: every forward pass and every sync of one engine had its partner on the other.
    forwards = [d["num_real_steps"] + d["num_dummy_batches"] for d in deltas]
    assert forwards[0] == forwards[1] and deltas[0]["num_syncs"] == deltas[1]["num_syncs"]
    assert group.balancer.outstanding_tokens == [0, 0]


def test_the_coordinator_keeps_a_start_wave_for_an_engine_not_connected_yet():
    router = WaveRouter(3)
    assert router.on_hello(0) == []
    assert router.on_start_wave(0, 5) == []  # engines 1 and 2 have not connected: kept
    assert router.on_start_wave(0, 4) == []  # an older wave does not replace the kept one
    assert router.on_hello(1) == [(1, 5)]
    assert router.on_hello(1) == []  # delivered once
    assert router.on_start_wave(1, 6) == [(0, 6)]  # never back to its sender
    assert router.on_hello(2) == [(2, 6)]


def test_the_coordinator_process_delivers_a_kept_start_wave_on_connect():
    handle = DPCoordinatorHandle(3, "127.0.0.1", free_port_pair())
    ctx = zmq.Context()
    sockets = []

    def dealer(rank: int) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
        sock.connect(handle.waves_address)
        sock.send(msgspec.msgpack.encode(WaveMessage("hello", rank)))
        sockets.append(sock)
        return sock

    def receive(sock: zmq.Socket) -> WaveMessage:
        assert sock.poll(30_000), "no START_WAVE within 30 s"
        return msgspec.msgpack.decode(sock.recv(), type=WaveMessage)

    try:
        engine0, engine2 = dealer(0), dealer(2)
        notify = ctx.socket(zmq.PUSH)
        sockets.append(notify)
        notify.connect(handle.notify_address)
        notify.send(msgspec.msgpack.encode(WaveMessage("start_wave", 0, 3)))
        assert receive(engine2) == WaveMessage("start_wave", 2, 3)  # so the coordinator has it
        engine1 = dealer(1)  # connects after the wave started: it still hears about it
        assert receive(engine1) == WaveMessage("start_wave", 1, 3)
        assert not engine0.poll(100)  # the sender started it itself
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
        handle.shutdown()
    assert not handle.is_alive()


def test_the_dp_sync_group_is_standalone_and_rebuilds_with_a_new_size():
    import datetime
    import threading

    import torch.distributed as dist

    from engine.dp_core_proc import DPSyncGroup

    port = free_port_pair()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    results: dict[int, list] = {}

    def rank_main(rank: int) -> None:
        group = DPSyncGroup("127.0.0.1", port, rank, 2)
        out = [group.all_reduce([1, rank])]
        group.rebuild(rank, 2, generation=1)  # e.g. after a peer was replaced
        out.append(group.all_reduce([rank, 10]))
        if rank == 0:  # the group shrinks to this engine alone
            group.rebuild(0, 1, generation=2)
            out.append(group.all_reduce([5, 6]))
        group.close_group()
        results[rank] = out

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: [[2, 1], [1, 20], [5, 6]], 1: [[2, 1], [1, 20]]}
    assert not dist.is_initialized()  # never the default group
    del store


def test_a_keep_pause_weight_update_resume_cycle_on_a_lockstep_group(lockstep, tmp_path):
    from safetensors.torch import load_file

    from engine.tiny_models import make_tiny_checkpoint

    before = [o.outputs[0].token_ids for o in lockstep.generate(PROMPTS, GREEDY)]
    original = load_file(os.path.join(lockstep.config.model.model, "model.safetensors"))
    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path / "seed1", "qwen3_moe", seed=1), "model.safetensors"))
    lockstep.init_weight_transfer_engine({"backend": "local"})
    for weights, version in ((new, "v1"), (original, "v2")):
        lockstep.pause_generation("keep")
        lockstep.start_weight_update()
        lockstep.update_weights({"weights": dict(weights)})
        lockstep.finish_weight_update(version)
        lockstep.resume_generation()
        outputs = lockstep.generate(PROMPTS, GREEDY)
        assert {v for o in outputs for v, _, _ in o.outputs[0].weight_versions} == {version}
        if version == "v1":
            assert [o.outputs[0].token_ids for o in outputs] != before
    assert [o.outputs[0].token_ids for o in outputs] == before
    states = _wait_idle(lockstep)
    assert states[0]["wave"] == states[1]["wave"]
