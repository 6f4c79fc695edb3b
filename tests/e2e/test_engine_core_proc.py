"""The EngineCore in its own process over real ZMQ: same tokens as in-process, errors, several clients, death, shutdown."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import time
from collections import defaultdict

import numpy as np
import pytest
import zmq

from engine.core_client import EngineUtilityError, InprocClient
from engine.engine_args import create_engine_config
from engine.exceptions import EngineDeadError, EngineStartupError
from engine.mp_client import AsyncMPClient, SyncMPClient, make_mp_clients
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest, FinishReason

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def config(tiny_checkpoint):
    return create_engine_config(
        model=tiny_checkpoint("llama"), max_model_len=MAX_MODEL_LEN, device="cpu", dtype="float32", max_num_seqs=8
    )


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 200, int(rng.integers(5, 30))).tolist() for _ in range(num)]


def _requests(prompts, prefix="r", logprobs=None, prompt_logprobs=None, max_tokens=6) -> list[EngineCoreRequest]:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
    return [EngineCoreRequest(f"{prefix}{i}", p, params, eos_token_id=None) for i, p in enumerate(prompts)]


class Results:
    """Everything the engine reported per request."""

    def __init__(self) -> None:
        self.tokens = defaultdict(list)
        self.logprobs = defaultdict(list)  # per request: LogprobsLists per step
        self.prompt_logprobs = defaultdict(list)
        self.finished = {}

    def add(self, outputs) -> None:
        for out in outputs.outputs:
            self.tokens[out.request_id] += out.new_token_ids
            if out.new_logprobs is not None:
                self.logprobs[out.request_id].append(out.new_logprobs)
            if out.new_prompt_logprobs is not None:
                self.prompt_logprobs[out.request_id].append(out.new_prompt_logprobs)
            if out.finished:
                self.finished[out.request_id] = out


def run_sync(client, requests) -> Results:
    results = Results()
    for r in requests:
        client.add_request(r)
    while len(results.finished) < len(requests):
        results.add(client.get_output())
    return results


async def run_async(client, requests) -> Results:
    results = Results()
    for r in requests:
        await client.add_request_async(r)
    while len(results.finished) < len(requests):
        results.add(await client.get_output_async())
    return results


@pytest.fixture(scope="module")
def reference(config):
    """Greedy tokens and logprobs of the same requests from an InprocClient."""
    client = InprocClient(config)
    requests = _requests(_prompts(4), logprobs=3, prompt_logprobs=5) + _requests(_prompts(3, seed=1), prefix="y")
    results = run_sync(client, requests)
    client.shutdown()
    return results


@pytest.fixture(scope="module")
def sync_client(config):
    client = SyncMPClient(config)
    yield client
    client.shutdown()


def _backed_by_zmq_frame(arr: np.ndarray) -> bool:
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return isinstance(arr.base, memoryview) and isinstance(arr.base.obj, zmq.Frame)


def _assert_same(results: Results, reference: Results, req_ids) -> None:
    for req_id in req_ids:
        assert results.tokens[req_id] == reference.tokens[req_id], req_id
        assert results.finished[req_id].finish_reason == FinishReason.LENGTH


def test_sync_client_matches_inproc_tokens_and_logprobs(sync_client, reference):
    results = run_sync(sync_client, _requests(_prompts(4), logprobs=3, prompt_logprobs=5))
    _assert_same(results, reference, [f"r{i}" for i in range(4)])
    for req_id in results.tokens:
        for kind in ("logprobs", "prompt_logprobs"):
            got = [lp for lp in getattr(results, kind)[req_id]]
            want = getattr(reference, kind)[req_id]
            got_ids = np.concatenate([lp.token_ids for lp in got])
            np.testing.assert_array_equal(got_ids, np.concatenate([lp.token_ids for lp in want]))
            np.testing.assert_allclose(
                np.concatenate([lp.logprobs for lp in got]), np.concatenate([lp.logprobs for lp in want]), atol=1e-5
            )
            np.testing.assert_array_equal(
                np.concatenate([lp.ranks for lp in got]), np.concatenate([lp.ranks for lp in want])
            )
    # Prompt logprobs ([P-1, 6] int64 and float32) are large enough to travel as their own frames.
    big = results.prompt_logprobs["r0"][0]
    assert big.token_ids.shape[1] == 6 and big.logprobs.dtype == np.float32
    assert _backed_by_zmq_frame(big.token_ids) and _backed_by_zmq_frame(big.logprobs)


def test_sync_client_utilities(sync_client):
    assert sync_client.call_utility("reset_prefix_cache") is True
    assert sync_client.call_utility("has_unfinished_requests") is False
    with pytest.raises(EngineUtilityError, match="no method 'no_such_method'"):
        sync_client.call_utility("no_such_method", 1, 2)
    with pytest.raises(EngineUtilityError, match="no method '_private'"):
        sync_client.call_utility("_private")
    assert sync_client.num_blocks > 0 and sync_client.max_model_len == MAX_MODEL_LEN


def test_engine_process_runs_the_cpu_thread_plan(sync_client):
    """The engine's own process (uniproc worker inside it) pins itself to the planned cores, as the policy says."""
    from engine.executor.cpu_threads import allowed_cpus, plan_cpu_threads

    # The engine process inherits this one's affinity mask and environment.
    want = plan_cpu_threads(allowed_cpus(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    [report] = sync_client.call_utility("collective_rpc", "cpu_threads")
    assert report["pid"] == sync_client.engine.proc.pid and report["pid"] != os.getpid()
    assert report["num_threads"] == want.num_threads
    assert report["cpus"] == (list(want.cpus) if want.cpus is not None else allowed_cpus())


def test_invalid_request_gets_error_output_while_valid_one_completes(sync_client, reference):
    [good] = _requests(_prompts(1, seed=1), prefix="y")
    bad = EngineCoreRequest("too-long", list(range(1, MAX_MODEL_LEN + 10)), SamplingParams(max_tokens=4), None)
    sync_client.add_request(good)
    sync_client.add_request(bad)
    results = Results()
    while len(results.finished) < 2:
        results.add(sync_client.get_output())
    error = results.finished["too-long"]
    assert error.finish_reason == FinishReason.ERROR and "max_model_len" in error.stop_reason
    assert results.tokens["y0"] == reference.tokens["y0"]
    assert sync_client.call_utility("has_unfinished_requests") is False  # and the engine still serves


def test_abort_over_zmq(sync_client):
    [request] = _requests(_prompts(1), prefix="abort-me", max_tokens=50)
    sync_client.add_request(request)
    sync_client.get_output()  # it is running
    sync_client.abort_requests(["abort-me0", "not-running"])
    results = Results()
    while "abort-me0" not in results.finished:
        results.add(sync_client.get_output())
    assert results.finished["abort-me0"].finish_reason == FinishReason.ABORT
    assert len(results.tokens["abort-me0"]) < 49


def _child_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # still there: a zombie counts as gone once reaped
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def test_two_async_clients_on_one_engine_get_only_their_outputs(config, reference):
    clients = make_mp_clients(config, num_clients=2, asyncio_mode=True)
    assert all(isinstance(c, AsyncMPClient) for c in clients)
    assert clients[0].engine is clients[1].engine
    pid = clients[0].engine.proc.pid
    requests = [_requests(_prompts(4)), _requests(_prompts(3, seed=1), prefix="y")]

    async def main():
        results = await asyncio.gather(*(run_async(c, r) for c, r in zip(clients, requests)))
        assert await clients[1].call_utility_async("reset_prefix_cache") is True
        with pytest.raises(EngineUtilityError):
            await clients[0].call_utility_async("no_such_method")
        return results

    try:
        results = asyncio.run(main())
    finally:
        clients[0].shutdown()
        assert clients[1].engine.is_alive()  # one client left: the engine keeps running
        clients[1].shutdown()
    for result, reqs in zip(results, requests):
        assert set(result.tokens) == {r.request_id for r in reqs}  # nobody else's outputs
        _assert_same(result, reference, [r.request_id for r in reqs])
    # Shutdown leaves no engine process behind.
    assert pid not in _child_pids() and _process_gone(pid)


def test_sigusr1_prints_every_engine_thread_and_the_engine_keeps_serving(config, capfd):
    # The way to see where a stuck engine waits (faulthandler in the engine process). The
    # engine starts inside the test, so that its stderr is the captured one.
    client = SyncMPClient(config)
    try:
        # faulthandler reads the other threads' frames without stopping them, which can crash a thread
        # that is busy (CI saw a SIGSEGV while a non-main thread was still evaluating type hints at start-up);
        # a stuck engine's threads are idle, so the test dumps them idle: after one round trip through
        # both sockets, waiting on their next message.
        assert client.call_utility("reset_prefix_cache") is True
        time.sleep(0.5)
        capfd.readouterr()
        os.kill(client.engine.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        err = ""
        # The main thread is inside run_engine_core (which registered the handler) whatever it is doing.
        while "run_engine_core" not in err and time.monotonic() < deadline:
            time.sleep(0.1)
            err += capfd.readouterr().err
        assert "run_engine_core" in err and err.count("Thread 0x") >= 2  # the main thread and the socket threads
        assert client.call_utility("reset_prefix_cache") is True
    finally:
        client.shutdown()


def test_killed_engine_raises_engine_dead_error_in_waiters(config):
    client = AsyncMPClient(config)
    pid = client.engine.proc.pid

    async def main():
        waiter = asyncio.ensure_future(client.get_output_async())
        await asyncio.sleep(0.1)
        assert not waiter.done()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(waiter, timeout=5)
        with pytest.raises(EngineDeadError):
            await client.get_output_async()
        with pytest.raises(EngineDeadError):
            await client.add_request_async(_requests(_prompts(1))[0])
        assert client.is_dead

    try:
        asyncio.run(main())
    finally:
        client.shutdown()
    assert pid not in _child_pids() and _process_gone(pid)


def test_startup_failure_raises_with_the_reason(config, tmp_path):
    bad = tmp_path / "bad-model"
    shutil.copytree(config.model.model, bad)
    hf_config = json.loads((bad / "config.json").read_text())
    hf_config["architectures"] = ["NoSuchForCausalLM"]
    (bad / "config.json").write_text(json.dumps(hf_config))
    bad_config = create_engine_config(model=str(bad), max_model_len=MAX_MODEL_LEN, device="cpu", dtype="float32")
    before = _child_pids()
    with pytest.raises(EngineStartupError, match="NoSuchForCausalLM"):
        SyncMPClient(bad_config, ready_timeout_s=120)
    assert _child_pids() <= before  # the failed engine process exited and was reaped
