"""MultiprocExecutor with real worker processes (gloo on CPU): TP=2 and TP=1 match the in-process engine, errors and deaths surface."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM
from engine.exceptions import EngineDeadError, WeightUpdateStateError
from engine.executor import MultiprocExecutor, UniProcExecutor, WorkerDiedError
from engine.wire import EngineCoreRequest

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, disable_log_stats=True)
MAX_TOKENS = 8
DEATH_TIMEOUT_S = 30.0  # a generous bound on "within seconds", guarding against a hang


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 400, 20).tolist()  # two prompts share a prefix: a prefix-cache hit
    return [shared + [7, 8], shared + [9], rng.integers(3, 400, 45).tolist(), rng.integers(3, 400, 3).tolist()]


def _generate(llm: LLM, prompts, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEATH_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        # A zombie still answers signal 0; its /proc status says so.
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except (ProcessLookupError, FileNotFoundError):
        return True


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_matches_tp1(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    prompts = _prompts()
    uni = LLM(path, **ENGINE_ARGS)
    expected = _generate(uni, prompts, logprobs=2)
    full_size = uni.engine_core.executor.worker.num_parameters()
    _check_in_process_cpu_threads(uni)
    uni.shutdown()

    # Chunked prefill (a 16-token budget) and several requests per step on both ranks.
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="mp", max_num_batched_tokens=16, **ENGINE_ARGS)
    try:
        executor = llm.engine_core.executor
        assert isinstance(executor, MultiprocExecutor) and len(executor.worker_pids) == 2
        _check_cpu_threads(executor)
        _check_weight_views_cover_every_rank(llm)
        shard_sizes = executor.collective_rpc("num_parameters")
        if max(shard_sizes) >= full_size:
            pytest.skip(f"{arch}'s layers are not tensor-parallel yet: each rank holds the whole model")
        got = _generate(llm, prompts, logprobs=2)
        assert _tokens(got) == _tokens(expected)
        for g, e in zip(got, expected):  # the all-reduces sum in another order: close, not equal
            got_lp = [next(iter(step.values())).logprob for step in g.outputs[0].logprobs]
            want_lp = [next(iter(step.values())).logprob for step in e.outputs[0].logprobs]
            np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    finally:
        llm.shutdown()


def _check_in_process_cpu_threads(llm: LLM) -> None:
    """An in-process engine sets the planned thread count but leaves the caller's process unpinned."""
    from engine.executor.cpu_threads import allowed_cpus, plan_cpu_threads

    report = llm.engine_core.executor.worker.cpu_threads()
    assert report["pid"] == os.getpid() and report["cpus"] == allowed_cpus()
    want = plan_cpu_threads(allowed_cpus(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    assert report["num_threads"] == want.num_threads


def _check_cpu_threads(executor) -> None:
    """Each CPU rank runs its own slice of the cores (engine/executor/cpu_threads.py), in its own process."""
    from engine.executor.cpu_threads import allowed_cpus, plan_cpu_threads

    reports = executor.collective_rpc("cpu_threads")
    assert [r["pid"] for r in reports] == executor.worker_pids
    for rank, report in enumerate(reports):
        want = plan_cpu_threads(allowed_cpus(), 2, rank, os.environ.get("OMP_NUM_THREADS"))
        assert report["num_threads"] == want.num_threads
        assert report["cpus"] == (list(want.cpus) if want.cpus is not None else allowed_cpus())


def _check_weight_views_cover_every_rank(llm: LLM) -> None:
    """weight_info / weight_checker of a TP=2 engine: rank 0's view, "ranks" with both, baselines per rank."""
    core = llm.engine_core
    assert core.get_world_size() == 2
    info = core.weight_info()
    assert len(info["ranks"]) == 2 and info["ranks"][0] == info["weights"] and "ranks" not in info["weights"]
    assert info["ranks"][0] != info["ranks"][1]  # each rank names its own slice

    checks = core.weight_checker()
    per_rank = [r["checksums"] for r in checks["ranks"]]
    assert checks["checksums"] == per_rank[0]
    # Per-rank baselines: every rank matches its own.
    both = core.weight_checker({"ranks": per_rank})
    assert both["match"] and all(r["match"] for r in both["ranks"])
    # One dict applies to every rank: "match" needs all of them, so shards that differ fail it.
    one = core.weight_checker(per_rank[0])
    assert one["ranks"][0]["match"]
    assert one["match"] == (per_rank[0] == per_rank[1])
    with pytest.raises(ValueError, match="one per rank"):
        core.weight_checker({"ranks": [per_rank[0]]})


def test_tp1_under_mp_matches_uni_and_reraises_worker_errors(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = _prompts(1)
    uni = LLM(path, **ENGINE_ARGS)
    assert isinstance(uni.engine_core.executor, UniProcExecutor) and uni.engine_core.get_world_size() == 1
    expected = _generate(uni, prompts, logprobs=3)
    uni.shutdown()

    llm = LLM(path, distributed_executor_backend="mp", **ENGINE_ARGS)
    try:
        executor = llm.engine_core.executor
        assert isinstance(executor, MultiprocExecutor)
        assert executor.worker_pids[0] != os.getpid()
        got = _generate(llm, prompts, logprobs=3)
        assert _tokens(got) == _tokens(expected)
        for g, e in zip(got, expected):  # one rank: the same computation, the same numbers
            assert g.outputs[0].logprobs == e.outputs[0].logprobs

        # A worker's exception keeps its type (callers catch ValueError and friends), names the
        # rank and carries the worker's traceback; the engine keeps serving.
        with pytest.raises(WeightUpdateStateError) as caught:
            llm.engine_core.update_weights({"names": []})
        note = "\n".join(caught.value.__notes__)
        assert "worker rank 0" in note and "Traceback" in note and "update_weights" in note
        with pytest.raises(AttributeError, match="private"):
            executor.collective_rpc("_forward")
        assert executor.is_alive()
        assert _tokens(_generate(llm, prompts)) == _tokens(expected)
    finally:
        llm.shutdown()
    assert not executor.is_alive()
    _wait_until(lambda: all(_pid_gone(pid) for pid in executor.worker_pids), "the worker process exited")


def test_killed_worker_makes_the_in_process_engine_dead(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_ARGS)
    try:
        core, executor = llm.engine_core, llm.engine_core.executor
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        core.add_request(EngineCoreRequest("r0", _prompts()[0], params, eos_token_id=None))
        core.step()  # the request is in flight on both ranks
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        # The next step sees the death, whether in its liveness check or while waiting for replies.
        with pytest.raises(WorkerDiedError, match="rank 1 .*SIGKILL"):
            while core.has_unfinished_requests():
                core.step()
        assert not executor.is_alive()
        _wait_until(lambda: _pid_gone(executor.worker_pids[0]), "the surviving rank was stopped")
        with pytest.raises(EngineDeadError, match="rank 1"):  # every later request
            _generate(llm, _prompts())
    finally:
        llm.shutdown()


def test_killed_worker_makes_the_engine_process_report_dead(tiny_checkpoint):
    llm = AsyncLLM.from_engine_args(
        model=tiny_checkpoint("llama"), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_ARGS
    )

    async def run() -> None:
        assert await llm.get_world_size() == 2
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        stream = llm.generate({"prompt_token_ids": _prompts()[0]}, params, "r0")
        first = await anext(stream)
        assert not first.finished
        await llm.pause_generation("keep")  # frozen in flight: the engine idles, so only its liveness check can notice
        pids = await llm.engine_core.call_utility_async("get_worker_pids")
        assert len(pids) == 2 and os.getpid() not in pids
        os.kill(pids[1], signal.SIGKILL)

        async def rest() -> list:
            return [out async for out in stream]

        try:  # the in-flight request ends: an error output, or EngineDeadError once the process is gone
            outs = await asyncio.wait_for(rest(), DEATH_TIMEOUT_S)
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "error"
            assert "rank 1" in outs[-1].outputs[0].stop_reason
        except EngineDeadError:
            pass
        deadline = time.monotonic() + DEATH_TIMEOUT_S
        while (await llm.fault_tolerance_status())["status"] != "dead":
            assert time.monotonic() < deadline, "the engine never reported dead"
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDeadError):  # refused by the dead engine on its way out, or by the frontend
            async for _ in llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "r1"):
                pass
        while not llm.is_dead:  # the engine process exits
            assert time.monotonic() < deadline, "the engine process never exited"
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "r2"):
                pass
        _wait_until(lambda: all(_pid_gone(pid) for pid in pids), "the worker processes exited")

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_a_worker_start_up_error_is_raised_and_leaves_no_process(tiny_checkpoint):
    import psutil

    # Three attention heads do not split over two ranks: every rank refuses the model.
    path = tiny_checkpoint("llama", hidden_size=96, num_attention_heads=3, num_key_value_heads=1)

    def worker_pids() -> set[int]:  # spawned children (not multiprocessing's resource tracker)
        pids = set()
        for child in psutil.Process().children():
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    pids.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        return pids

    before = worker_pids()
    with pytest.raises(ValueError, match="divisible") as caught:
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_ARGS)
    assert re.search(r"worker rank [01]; its traceback", "\n".join(caught.value.__notes__))  # the first to fail

    _wait_until(lambda: all(_pid_gone(pid) for pid in worker_pids() - before), "the worker processes exited")


def test_killed_worker_with_fault_tolerance_is_dead_not_unhealthy(tiny_checkpoint):
    # An unhealthy engine waits for "retry"; a dead worker cannot come back, so retry must not be offered.
    llm = AsyncLLM.from_engine_args(
        model=tiny_checkpoint("llama"), tensor_parallel_size=2, distributed_executor_backend="mp",
        multiprocess=False, enable_fault_tolerance=True, **ENGINE_ARGS,
    )

    async def run() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        stream = llm.generate({"prompt_token_ids": _prompts()[0]}, params, "r0")
        assert not (await anext(stream)).finished
        os.kill(llm.engine_core.engine_core.executor.worker_pids[1], signal.SIGKILL)
        outs = await asyncio.wait_for(_drain(stream), DEATH_TIMEOUT_S)
        assert outs[-1].outputs[0].finish_reason == "error" and "rank 1" in outs[-1].outputs[0].stop_reason
        assert (await llm.fault_tolerance_status())["status"] == "dead"

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


async def _drain(stream) -> list:
    return [out async for out in stream]
