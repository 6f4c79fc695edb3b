"""The nccl backend over gloo on CPU: packed and unpacked syncs into a real server, bad init info, failing peers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from functools import cached_property

import httpx
import psutil
import pytest
import torch

from weight_transfer.base import ParamMeta, Replicate, Shard, StateDictSource, WeightSource, as_source, trainer_init
from weight_transfer.clients import HTTPWeightSyncClient, WeightSyncClient, WeightSyncError
from weight_transfer.nccl import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine, NCCLWeightTransferEngine
from weight_transfer.packing import plan_nccl_packs
from weight_transfer.process_group import (
    WeightSyncGroup,
    WeightSyncTransportError,
    connect_store,
    host_store,
)

from sync_helpers import assert_engine_serves, http_greedy, trainer_model

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 20.0  # the backend's timeout_s in these tests: every wait gives up after this


def _info(**overrides) -> NCCLTrainerInitInfo:
    fields = dict(master_address="127.0.0.1", master_port=0, world_size=2, timeout_s=TIMEOUT_S)
    return NCCLTrainerInitInfo(**{**fields, **overrides})


def _engine_core_pid(server) -> int:
    [pid] = [p for p in server.child_pids if "spawn_main" in " ".join(psutil.Process(p).cmdline())]
    return pid


def _checksums(url: str) -> dict:
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        return http.post("/weight_checker", json={}).json()


class _HookedSource(WeightSource):
    """A source (or module) whose iter_full() runs `hook` just before it yields its tensor number `at`."""

    def __init__(self, source, at: int, hook) -> None:
        self.inner, self.at, self.hook = as_source(source), at, hook

    def _metadata(self):
        return self.inner.metadata

    def iter_full(self):
        for i, pair in enumerate(self.inner.iter_full()):
            if i == self.at:
                self.hook()
            yield pair

    def iter_local(self):
        return self.inner.iter_local()


# ---------------------------------------------------------------------------------------
# init_info validation (no engine needed)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"master_address": ""}, "master_address"),
        ({"master_port": 70000}, "master_port"),
        ({"world_size": 1}, "world_size"),
        ({"packed": "yes"}, "packed"),
        ({"packed_buffer_size_bytes": 0}, "packed_buffer_size_bytes"),
        ({"packed_num_buffers": 0}, "packed_num_buffers"),
        ({"rank": -1}, "rank"),
        ({"timeout_s": 0}, "timeout_s"),
    ],
)
def test_trainer_init_info_names_the_bad_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        _info(**overrides)


GOOD_ENGINE_INIT = {
    "backend": "nccl", "master_address": "127.0.0.1", "master_port": 29500, "world_size": 2, "device_type": "cpu",
}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"colour": "red"}, r"unknown field\(s\) \['colour'\]"),
        ({"master_port": None}, "init_info.master_port"),
        ({"master_port": 0}, "init_info.master_port"),
        ({"world_size": 1}, "init_info.world_size"),
        ({"rank_offset": 2}, "init_info.world_size: 2 leaves no rank"),
        ({"rank_offset": 0}, "init_info.rank_offset"),
        ({"dp_index": -1}, "init_info.dp_index"),
        ({"packed": 1}, "init_info.packed"),
        ({"packed_buffer_size_bytes": 0}, "init_info.packed_buffer_size_bytes"),
        ({"packed_num_buffers": 0}, "init_info.packed_num_buffers"),
        ({"timeout_s": -1}, "init_info.timeout_s"),
        ({"device_type": "cuda"}, "init_info.device_type: the trainer sends from cuda"),
        ({"device_type": "tpu"}, "init_info.device_type"),
        ({"group_generation": "x"}, "init_info.group_generation"),
    ],
)
def test_engine_parse_init_info_names_the_bad_field(change, field):
    init_info = {k: v for k, v in {**GOOD_ENGINE_INIT, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=field):
        NCCLWeightTransferEngine(torch.device("cpu")).parse_init_info(init_info)


@pytest.mark.parametrize(
    "update_info,field",
    [
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]}, "update_info.call_id"),
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]], "call_id": 1, "x": 0},
         r"unknown field\(s\) \['x'\]"),
        ({"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "call_id": 1}, r"unknown field\(s\) \['dtypes'\]"),
        ({"names": ["a"], "dtype_names": ["floaty"], "shapes": [[2]], "call_id": 1}, "update_info.dtype_names"),
        ({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[2]], "call_id": 1}, "must match"),
        ({"names": [], "dtype_names": [], "shapes": [], "call_id": 1}, "repeats the previous call's tensors"),
    ],
)
def test_engine_parse_update_info_names_the_bad_field(update_info, field):
    engine = NCCLWeightTransferEngine(torch.device("cpu"))
    engine.info = engine.parse_init_info({**GOOD_ENGINE_INIT, "group_generation": 0})  # as init_transfer keeps it
    with pytest.raises(ValueError, match=field):
        engine.parse_update_info(update_info)


# ---------------------------------------------------------------------------------------
# The transport in one process: a trainer and two engine-side receivers on threads


class _InProcessEngines(WeightSyncClient):
    """Engine-side NCCLWeightTransferEngine objects on threads, landing into dicts (a unit-test stand-in for
    engine workers: it consumes each yielded view before pulling the next, as the worker does)."""

    def __init__(self, num: int) -> None:
        self.engines = [NCCLWeightTransferEngine(torch.device("cpu")) for _ in range(num)]
        self.landed: list[dict[str, torch.Tensor]] = [{} for _ in range(num)]

    def _on_all(self, fn) -> None:
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                fn(i, self.engines[i])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.engines))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _call(self, method: str, *args):
        if method == "get_world_size":
            return len(self.engines)
        if method == "init_weight_transfer_engine":
            self._on_all(lambda i, e: e.init_transfer(e.parse_init_info({**args[0], "rank_offset": 1 + i})))
        elif method == "update_weights":
            def land(i: int, e: NCCLWeightTransferEngine) -> None:
                for name, tensor in e.receive_weights(e.parse_update_info(args[0])):
                    self.landed[i][name] = tensor.clone()
            self._on_all(land)
        elif method == "shutdown_weight_transfer_engine":
            self._on_all(lambda i, e: e.shutdown())
        elif method not in ("start_weight_update", "finish_weight_update", "abort_weight_update"):
            raise AssertionError(f"unexpected call {method}")


@pytest.mark.parametrize("packed", [True, False])
def test_broadcast_reaches_every_worker_bit_exact(packed):
    gen = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.w": torch.randn(3 + i, 40 + 9 * i, generator=gen) for i in range(12)}
    weights["big"] = torch.randn(64, 64, generator=gen)  # 16 KiB: larger than one 4 KiB buffer
    weights["half"] = torch.randn(7, 5, generator=gen).to(torch.bfloat16)
    weights["empty"] = torch.zeros(0, 4)
    weights["transposed"] = torch.randn(6, 9, generator=gen).t()  # not contiguous
    plan = plan_nccl_packs([t.numel() * t.element_size() for t in weights.values()], 4096)
    assert len(plan) > 4 and max(p.nbytes for p in plan) > 4096  # buffers rotate, one tensor gets its own pack

    engines = _InProcessEngines(2)
    info = _info(world_size=3, packed=packed, packed_buffer_size_bytes=4096, packed_num_buffers=2)
    trainer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=engines, source=weights)
    try:
        for version in ("v1", "v2"):  # the group serves repeated syncs
            for name in weights:
                weights[name].mul_(-1)
            stats = trainer.send_weights(weight_version=version)
            for landed in engines.landed:
                assert list(landed) == list(weights)
                for name, tensor in weights.items():
                    assert landed[name].dtype == tensor.dtype and torch.equal(landed[name], tensor), name
        dense = sum(t.numel() * t.element_size() for t in weights.values())
        assert stats.num_tensors == len(weights) and stats.dense_bytes == dense
        assert stats.bytes_sent >= dense and stats.weight_version == "v2"
        assert trainer.generation == 0  # no re-join was needed
    finally:
        trainer.shutdown()


def _group_pair(store, prefix: str, timeout_s: float) -> dict[int, WeightSyncGroup]:
    """Ranks 0 and 1 of a weight-sync group, both in this process."""
    groups: dict[int, WeightSyncGroup] = {}

    def join(rank: int) -> None:
        s = store if rank == 0 else connect_store("127.0.0.1", store.port, 5.0)
        groups[rank] = WeightSyncGroup(s, prefix=prefix, rank=rank, world_size=2, device=torch.device("cpu"),
                                       timeout_s=timeout_s, address="127.0.0.1")

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups


class _VllmStyleSource(WeightSource):
    """A WeightSource written for vLLM's base: metadata a cached_property, owners left None, no iter_local."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

    def iter_full(self):
        yield from self.tensors.items()


def test_a_source_written_for_vllms_base_syncs_as_ours():
    gen = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.w": torch.randn(5, 7 + i, generator=gen) for i in range(4)}
    source = _VllmStyleSource(tensors)
    assert [m.owners for m in source.metadata] == [None] * 4 and source.owned_names(3) == list(tensors)
    assert source.implements_iter_full() and not source.implements_iter_local()
    engines = _InProcessEngines(1)
    trainer = NCCLTrainerWeightTransferEngine.trainer_init(_info(world_size=2, packed_buffer_size_bytes=256),
                                                           client=engines, source=source)
    try:
        trainer.send_weights(weight_version="v1")
        assert list(engines.landed[0]) == list(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(engines.landed[0][name], tensor)
    finally:
        trainer.shutdown()


def test_param_meta_takes_vllms_layout_arguments():
    meta = ParamMeta("w", torch.float32, [4, 6], owners=(0, 1, 2, 3), mesh_shape=(2, 2),
                     placements=(Shard(0), Replicate()))
    assert meta.shape == (4, 6) and meta.mesh_shape == (2, 2) and meta.sharded and not meta.owned_by(5)
    assert ParamMeta("w", torch.float32, (4,), owners=(0, 1), placements=(Replicate(),)).placements is None
    assert ParamMeta("w", torch.float32, (4,), owners=(0,)).mesh_shape == (1,)
    for kwargs, message in [
        ({"mesh_shape": (2,)}, "need owners"),
        ({"owners": (0, 0)}, "distinct non-negative"),
        ({"owners": (0, 1, 2), "mesh_shape": (2, 2)}, "does not cover"),
        ({"owners": (0, 1), "placements": (Shard(2),)}, r"Shard\(dim=2\) of a 2-D tensor"),
        ({"owners": (0, 1), "placements": (Shard(0), Shard(1))}, "2 placements for a 1-D mesh"),
    ]:
        with pytest.raises(ValueError, match=message):
            ParamMeta("w", torch.float32, (4, 6), **kwargs)
    with pytest.raises(TypeError, match="must be a functools.cached_property"):
        class _Plain(WeightSource):  # noqa: F841 - the class statement itself raises
            @property
            def metadata(self):
                return []

            def iter_full(self):
                return iter(())


def test_a_silent_peer_gives_a_timeout_not_a_hang():
    store = host_store("127.0.0.1", 0, 5.0)
    groups = _group_pair(store, "silent/", timeout_s=1.0)
    work = groups[1].broadcast(torch.empty(8))  # rank 0 never sends
    with pytest.raises((TimeoutError, WeightSyncTransportError)):
        groups[1].wait(work, "receiving x")
    groups[1].abort()
    with pytest.raises(WeightSyncTransportError, match="aborted"):
        groups[1].broadcast(torch.empty(8))  # an aborted group is never used again

    def trainer_gave_up() -> None:
        raise WeightSyncTransportError("the trainer gave up")

    groups = _group_pair(store, "told/", timeout_s=60.0)
    work = groups[1].broadcast(torch.empty(8))  # a check that raises ends the wait long before the timeout
    with pytest.raises(WeightSyncTransportError, match="gave up"):
        groups[1].wait(work, "receiving x", trainer_gave_up)
    for group in groups.values():
        group.close()


def test_trainer_init_rejects_a_wrong_world_size():
    with pytest.raises(ValueError, match="world_size: 3, but the engine has 1 worker"):
        NCCLTrainerWeightTransferEngine.trainer_init(_info(world_size=3), client=_InProcessEngines(1))


# ---------------------------------------------------------------------------------------
# End to end: the pytest process is the trainer of a real `rollout launch` server


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(launch_server, checkpoint):
    return launch_server(checkpoint, "--enable-rl-routes", "--weight-transfer-backend", "nccl")


@pytest.mark.slow
@pytest.mark.parametrize("packed", [True, False])
def test_sync_serves_the_trainer_weights(server, checkpoint, packed):
    client = HTTPWeightSyncClient(server.url)
    # 32 KiB buffers: the 128 KiB embeddings get packs of their own, the rest rotates through two buffers.
    info = _info(packed=packed, packed_buffer_size_bytes=32 << 10, packed_num_buffers=2)
    model = trainer_model(checkpoint, seed=11 if packed else 12)
    trainer = trainer_init(info, client=client, source=model)
    try:
        stats = trainer.send_weights(weight_version=f"packed-{packed}")
        assert stats.backend == "nccl" and stats.num_tensors == len(list(model.parameters()))
        assert_engine_serves(server.url, model, f"packed-{packed}")
    finally:
        trainer.shutdown()
        client.close()


@pytest.mark.slow
def test_bad_init_info_is_a_400_naming_the_field(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        r = http.post("/init_weight_transfer_engine", json={"init_info": {**GOOD_ENGINE_INIT, "packed_num_buffers": 0}})
        assert r.status_code == 400 and "init_info.packed_num_buffers" in r.text
        r = http.post("/init_weight_transfer_engine", json={"init_info": {**GOOD_ENGINE_INIT, "device_type": "cuda"}})
        assert r.status_code == 400 and "init_info.device_type" in r.text


@pytest.mark.slow
def test_failed_syncs_keep_the_old_weights_and_the_next_sync_recovers(server, checkpoint):
    client = HTTPWeightSyncClient(server.url)
    model = trainer_model(checkpoint, seed=21)
    trainer = trainer_init(_info(packed_buffer_size_bytes=32 << 10), client=client, source=model)
    try:
        trainer.send_weights(weight_version="good")
        before = _checksums(server.url)

        # The engine refuses the metadata (a wrong shape): an error naming the tensor at once, no timeout.
        bad = StateDictSource({"model.norm.weight": torch.ones(65)})
        with pytest.raises(WeightSyncError, match=r"model.norm.weight.*shape \[65\]"):
            trainer.send_weights(bad, weight_version="bad-shape")

        # The trainer's own source fails halfway: the engine is told, restores, and serves the old weights.
        def boom() -> None:
            raise RuntimeError("the source failed")

        newer = trainer_model(checkpoint, seed=22)
        with pytest.raises(RuntimeError, match="the source failed"):
            trainer.send_weights(_HookedSource(newer, at=12, hook=boom), weight_version="half")
        after = _checksums(server.url)
        assert after["checksums"] == before["checksums"] and after["weight_version"] == "good"

        trainer.send_weights(newer, weight_version="recovered")  # joins a fresh group
        assert trainer.generation >= 1
        assert_engine_serves(server.url, newer, "recovered")
    finally:
        trainer.shutdown()
        client.close()


DYING_TRAINER = """
import os, sys
from sync_helpers import trainer_model
from weight_transfer.base import ModuleSource, trainer_init
from weight_transfer.clients import HTTPWeightSyncClient
from weight_transfer.nccl import NCCLTrainerInitInfo

url, path, die_at, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])

class Dying(ModuleSource):
    def iter_full(self):
        for i, pair in enumerate(super().iter_full()):
            if i == die_at:
                os._exit(3)  # mid-sync: some packs are out, the rest never come
            yield pair

info = NCCLTrainerInitInfo("127.0.0.1", 0, 2, packed_buffer_size_bytes=32 << 10, timeout_s=timeout_s)
engine = trainer_init(info, client=HTTPWeightSyncClient(url), source=Dying(trainer_model(path, seed=31)))
engine.send_weights(weight_version="never")
"""


@pytest.mark.slow
def test_a_trainer_that_dies_mid_sync_leaves_the_old_weights_serving(server, checkpoint):
    before_greedy, before = http_greedy(server.url), _checksums(server.url)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO_ROOT, "tests", "weights"), REPO_ROOT]))
    proc = subprocess.run(
        [sys.executable, "-c", DYING_TRAINER, server.url, checkpoint, "12", str(TIMEOUT_S)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    # The engine's update_weights failed on its own (the trainer is gone): the server answers
    # within timeout_s (utility calls run in order, so this waits for that failure).
    after = _checksums(server.url)
    assert after["checksums"] == before["checksums"]
    assert after["weight_version"] == before["weight_version"]
    httpx.post(server.url + "/resume", timeout=TIMEOUT_S).raise_for_status()
    assert http_greedy(server.url) == before_greedy


@pytest.mark.slow
def test_a_stalled_engine_gives_the_trainer_a_timeout_and_keeps_old_weights(server, checkpoint):
    client = HTTPWeightSyncClient(server.url)
    model = trainer_model(checkpoint, seed=41)
    trainer = trainer_init(_info(timeout_s=3.0), client=client, source=model)
    before = _checksums(server.url)
    engine_core = psutil.Process(_engine_core_pid(server))

    def stall() -> None:
        engine_core.suspend()  # SIGSTOP: alive, holding its sockets, receiving nothing

    try:
        with pytest.raises((TimeoutError, WeightSyncTransportError)):
            trainer.send_weights(_HookedSource(model, at=5, hook=stall), weight_version="stalled")
    finally:
        engine_core.resume()  # psutil: SIGCONT
    # Whatever the engine makes of the transfer when it wakes, the trainer's abort_weight_update
    # (queued behind it) restores the weights of before.
    deadline = time.monotonic() + 4 * TIMEOUT_S
    while _checksums(server.url)["checksums"] != before["checksums"] and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _checksums(server.url)
    assert after["checksums"] == before["checksums"] and after["weight_version"] == before["weight_version"]
    trainer.shutdown()
    client.close()


@pytest.mark.slow
def test_an_engine_that_dies_mid_sync_gives_the_trainer_an_error(launch_server, checkpoint):
    server = launch_server(checkpoint, "--enable-rl-routes")
    client = HTTPWeightSyncClient(server.url, timeout=TIMEOUT_S)
    model = trainer_model(checkpoint, seed=51)
    trainer = trainer_init(_info(packed_buffer_size_bytes=32 << 10), client=client, source=model)
    engine_core = _engine_core_pid(server)
    try:
        with pytest.raises((WeightSyncTransportError, WeightSyncError, TimeoutError)):
            trainer.send_weights(
                _HookedSource(model, at=8, hook=lambda: os.kill(engine_core, signal.SIGKILL)), weight_version="x"
            )
    finally:
        trainer.shutdown()
        client.close()
        server.stop()  # its engine is gone; the server's own exit code is not what this test is about
