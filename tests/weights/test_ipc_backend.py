"""The ipc backend on CPU (POSIX shared memory): a real `rollout launch` server, the pytest process as the trainer over HTTP."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import torch
from sync_helpers import assert_engine_serves, http_greedy, trainer_model

import weight_transfer.base
from weight_transfer.base import ModuleSource, WeightSource
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.clients import HTTPWeightSyncClient, WeightSyncError
from weight_transfer.ipc import SHM_DIR, IPCTrainerInitInfo, IPCTrainerWeightTransferEngine, IPCWeightTransferEngine

SMALL_BUFFER = 64 << 10  # the tiny llama's embedding and lm_head (~128 KiB) do not fit: oversize packs


class RecordingClient(HTTPWeightSyncClient):
    """The HTTP client, keeping a copy of every update_info it sends (update_weights, or apply_weight_update for a
    sync in one call) to look at what crossed the wire."""

    def __init__(self, url: str) -> None:
        super().__init__(url, timeout=120)
        self.update_infos: list[dict] = []

    def _call(self, method: str, *args):
        if method in ("update_weights", "apply_weight_update"):
            self.update_infos.append(copy.deepcopy(args[0]))
        return super()._call(method, *args)


class FaultySource(WeightSource):
    """A module's tensors, with a fault when the pass reaches `at`: a stall of `stall_s` seconds, or an error."""

    def __init__(self, module: torch.nn.Module, at: str, stall_s: float | None = None) -> None:
        self.inner = ModuleSource(module)
        self.at = at
        self.stall_s = stall_s

    def _metadata(self):
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.inner.iter_full():
            if name == self.at:
                if self.stall_s is None:
                    raise OSError("checkpoint shard unreadable")
                time.sleep(self.stall_s)
            yield name, tensor

    def iter_local(self):
        return self.iter_full()


def _my_segments(pid: int | None = None) -> list[str]:
    prefix = f"wt-ipc-{os.getpid() if pid is None else pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def _mapped_by_server(server, exclude_control: bool = False) -> list[str]:
    """Our /dev/shm segments that the server or any of its child processes still maps."""
    prefix = f"{SHM_DIR}/wt-ipc-{os.getpid()}-"
    root = psutil.Process(server.proc.pid)
    found = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            with open(f"/proc/{proc.pid}/maps") as f:
                for line in f:
                    path = line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)")
                    if path.startswith(prefix) and not (exclude_control and path.endswith("-ctl")):
                        found.add(path)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(found)


def _checkpoint_and_version(url: str, baseline: dict) -> tuple[bool, str]:
    with httpx.Client(base_url=url, timeout=120) as http:
        report = http.post("/weight_checker", json={"baseline": baseline}).json()
    return report["match"], report["weight_version"]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(launch_server, checkpoint):
    return launch_server(checkpoint, "--enable-rl-routes")


@pytest.fixture(scope="module")
def models(checkpoint):
    """Three trainer models with different weights (seeds 11, 12, 13)."""
    return [trainer_model(checkpoint, seed=s) for s in (11, 12, 13)]


@pytest.fixture
def trainer(server):
    """trainer(**init_info fields) -> (IPCTrainerWeightTransferEngine, RecordingClient); shut down after the test."""
    started = []

    def start(source=None, **fields):
        client = RecordingClient(server.url)
        fields.setdefault("packed_buffer_size_bytes", SMALL_BUFFER)
        fields.setdefault("timeout_s", 30.0)
        engine = weight_transfer.base.trainer_init(IPCTrainerInitInfo(**fields), client=client, source=source)
        started.append((engine, client))
        return engine, client

    yield start
    for engine, client in started:
        engine.shutdown()
        client.close()
    assert _my_segments() == []  # nothing of ours is left in /dev/shm


# ---------------------------------------------------------------------------------------------------------
# Without a server


def test_init_info_validation_names_the_field():
    with pytest.raises(ValueError, match="packed_buffer_size_bytes"):
        IPCTrainerInitInfo(packed_buffer_size_bytes=10)
    with pytest.raises(ValueError, match="packed_num_buffers"):
        IPCTrainerInitInfo(packed_num_buffers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        IPCTrainerInitInfo(timeout_s=0)
    with pytest.raises(ValueError, match="device"):
        IPCTrainerInitInfo(device="meta")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\]"):
        IPCTrainerWeightTransferEngine.trainer_init({"backend": "ipc", "bogus": 1}, client=None)
    assert weight_transfer.base.backend_of(IPCTrainerInitInfo()) == "ipc"

    engine = IPCWeightTransferEngine(torch.device("cpu"))
    good = {"backend": "ipc", "control": "wt-ipc-1-abc-ctl", "host": "cpu:x", "timeout_s": 1.0, "keep_buffers": True}
    with pytest.raises(ValueError, match=r"init_info.host: .* ipc needs one machine"):
        engine.parse_init_info(good)
    from weight_transfer.ipc import device_key

    good["host"] = device_key(torch.device("cpu"))
    for bad, field in [
        ({"control": "../../etc/passwd"}, "init_info.control"),
        ({"timeout_s": -1}, "init_info.timeout_s"),
        ({"keep_buffers": "yes"}, "init_info.keep_buffers"),
        ({"extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ]:
        with pytest.raises(ValueError, match=field):
            engine.parse_init_info({**good, **bad})
    with pytest.raises(ValueError, match="init_info.control: no shared-memory segment"):
        engine.init_transfer(engine.parse_init_info(good))


def test_a_segment_shorter_than_announced_is_refused_before_anything_moves():
    from weight_transfer.ipc import _Control, _create_segment, _unlink_segment, device_key

    token = f"{os.getpid()}-unit"
    control = _Control.create(f"wt-ipc-{token}-ctl")
    buffer_name = f"wt-ipc-{token}-0-1"
    segment = _create_segment(buffer_name, 1024)
    engine = IPCWeightTransferEngine(torch.device("cpu"))
    try:
        init = {"backend": "ipc", "control": control.name, "host": device_key(torch.device("cpu"))}
        engine.init_transfer(engine.parse_init_info({**init, "timeout_s": 1.0, "keep_buffers": True}))
        update_info = {
            "names": ["w"],
            "dtypes": ["float32"],
            "shapes": [[512]],
            "buffer_size": 4096,
            "slot": 0,
            "seq": 1,
            "buffer": {
                device_key(torch.device("cpu")): {
                    "slot": 0,
                    "gen": 1,
                    "capacity": 2048,
                    "handle": {"kind": "shm", "name": buffer_name},
                }
            },
        }
        with pytest.raises(ValueError, match=r"handle.name: segment '.*-0-1' has 1024 bytes, fewer than the 2048"):
            engine.parse_update_info(update_info)
        with pytest.raises(ValueError, match=r"capacity: the pack spans bytes \[0, 2048\), beyond the buffer's 1024"):
            engine.parse_update_info(
                {**update_info, "buffer": {k: {**v, "capacity": 1024} for k, v in update_info["buffer"].items()}}
            )
        # A well-formed call whose fill never comes: the engine's wait ends at timeout_s, naming the pack.
        update_info["shapes"] = [[256]]
        update_info["buffer"] = {k: {**v, "capacity": 1024} for k, v in update_info["buffer"].items()}
        info = engine.parse_update_info(update_info)
        with pytest.raises(
            TimeoutError, match=r"buffer slot 0 \(pack 1, first tensor 'w'\): not filled within timeout_s=1"
        ):
            list(engine.receive_weights(info))
        assert control.taken(0) == 1 and control.opened(0) == 1
        control.set_ready(0, 1)
        [(name, tensor)] = list(engine.receive_weights(info))
        assert name == "w" and tensor.shape == (256,) and tensor.data_ptr() != 0
    finally:
        engine.shutdown()
        del segment
        _unlink_segment(buffer_name)
        control.close()
    assert _my_segments() == []


# ---------------------------------------------------------------------------------------------------------
# Against a real server


@pytest.mark.slow
def test_sync_with_several_packs_and_an_oversize_tensor(server, trainer, models):
    model = models[0]
    state = dict(model.named_parameters())
    assert max(p.numel() * p.element_size() for p in state.values()) > SMALL_BUFFER  # precondition: oversize tensors
    engine, client = trainer(source=model, packed_num_buffers=2)
    assert isinstance(engine, IPCTrainerWeightTransferEngine)  # dispatched on IPCTrainerInitInfo.backend

    stats = engine.send_weights(weight_version="ipc-1")

    assert_engine_serves(server.url, model, "ipc-1")
    assert stats.num_tensors == len(state)
    assert stats.dense_bytes == stats.bytes_sent == sum(p.numel() * p.element_size() for p in state.values())
    slots = [info["slot"] for info in client.update_infos]
    assert len(slots) == stats.extra["num_packs"] >= 4
    assert {0, 1} <= set(slots) and 2 in slots  # both ring buffers, and the oversize buffer (slot num_buffers)
    sent = [name for info in client.update_infos for name in info["names"]]
    assert sent == list(state)  # every tensor once, in order
    json.dumps(client.update_infos)  # JSON-safe: it crossed HTTP, nothing to unpickle


@pytest.mark.slow
def test_consecutive_syncs_reuse_the_exported_buffers(server, trainer, models):
    engine, client = trainer(packed_num_buffers=2)
    first = engine.send_weights(models[1], weight_version="reuse-1")
    assert_engine_serves(server.url, models[1], "reuse-1")
    descriptors_1 = {(i["slot"], json.dumps(i["buffer"], sort_keys=True)) for i in client.update_infos}
    segments = _my_segments()
    client.update_infos.clear()

    second = engine.send_weights(models[2], weight_version="reuse-2")

    assert_engine_serves(server.url, models[2], "reuse-2")
    assert first.extra["num_exports"] == len(first.extra["buffer_ids"]) == 3  # two ring buffers + the oversize one
    assert second.extra["num_exports"] == 0
    assert second.extra["buffer_ids"] == first.extra["buffer_ids"] == engine.buffer_ids
    descriptors_2 = {(i["slot"], json.dumps(i["buffer"], sort_keys=True)) for i in client.update_infos}
    assert descriptors_2 == descriptors_1  # the very same handles, exported once
    assert _my_segments() == segments  # 3 buffers + the control block, no new segment
    assert len(segments) == 4
    engine.shutdown()
    assert _my_segments() == []


@pytest.mark.slow
def test_keep_buffers_false_frees_the_buffers_after_each_sync(server, trainer, models):
    engine, _ = trainer(packed_num_buffers=1, keep_buffers=False)
    first = engine.send_weights(models[0], weight_version="nokeep-1")
    assert [n for n in _my_segments() if not n.endswith("-ctl")] == []  # freed as soon as the sync ended
    # ...and unmapped in the engine: a mapping kept alive (e.g. by cached views) would hold the memory.
    assert _mapped_by_server(server, exclude_control=True) == []
    second = engine.send_weights(models[1], weight_version="nokeep-2")
    assert_engine_serves(server.url, models[1], "nokeep-2")
    assert first.extra["num_exports"] == second.extra["num_exports"] == 2  # ring + oversize, every sync
    assert set(first.extra["buffer_ids"]).isdisjoint(second.extra["buffer_ids"])
    assert engine.buffer_ids == []


@pytest.mark.slow
def test_bad_update_info_is_a_400_naming_the_field_and_changes_nothing(server, trainer, models):
    engine, client = trainer(source=models[0])
    engine.send_weights(weight_version="valid-1")
    baseline = hf_state_checksums(models[0].state_dict())
    good = client.update_infos[-1]
    [(key, descriptor)] = good["buffer"].items()
    prefix = descriptor["handle"]["name"].rsplit("-", 2)[0]  # wt-ipc-<pid>-<token>
    fake_cuda = {
        "slot": 0,
        "gen": 1,
        "capacity": 1024,
        "handle": {
            "kind": "cuda",
            "handle_b64": "%%%not-base64",
            "storage_size": 1024,
            "storage_offset": 0,
            "ref_counter_b64": "AAAA",
            "ref_counter_offset": 0,
            "event_b64": "",
            "event_sync_required": False,
        },
    }

    def with_descriptor(**changes):
        return {**good, "buffer": {key: {**descriptor, **changes}}}

    def with_handle(**changes):
        return with_descriptor(handle={**descriptor["handle"], **changes})

    cases = [
        (
            {**good, "buffer": {"cuda:GPU-00000000-0000-0000-0000-000000000000": descriptor}},
            r"update_info.buffer: nothing for this worker's device 'cpu:",
        ),
        (with_descriptor(capacity=512), r"update_info.buffer\['cpu:[^']+'\].capacity: the pack spans bytes \[0, \d+\)"),
        (
            {**good, "buffer": {key: descriptor, "cuda:GPU-1": fake_cuda}},
            r"update_info.buffer\['cuda:GPU-1'\].handle.handle_b64: not valid base64",
        ),
        (with_handle(name="../../etc/passwd"), r"update_info.buffer\['cpu:[^']+'\].handle.name: .* not an ipc segment"),
        (with_handle(name="wt-ipc-0-other-0-1"), r"buffer \(slot \d, gen \d+\) came before with another handle"),
        (  # a new buffer of this trainer's that does not exist (yet)
            with_descriptor(gen=10_000, handle={"kind": "shm", "name": f"{prefix}-{descriptor['slot']}-10000"}),
            r"handle.name: no shared-memory segment 'wt-ipc-.*-10000'",
        ),
        (  # a segment that is not one of this trainer's buffers
            with_descriptor(gen=10_001, handle={"kind": "shm", "name": "wt-ipc-0-stranger-0-1"}),
            r"handle.name: 'wt-ipc-0-stranger-0-1', expected 'wt-ipc-.*-10001'",
        ),
        (with_handle(kind="nfs"), r"handle.kind: expected 'shm' or 'cuda'"),
        ({**good, "slot": 99}, r"update_info.slot: 99 is out of range"),
        ({**good, "seq": 0}, r"update_info.seq: 0 is below 1"),
        ({**good, "shapes": [[3, 3]] + good["shapes"][1:]}, r"shape \[3, 3\] does not match"),
        ({**good, "surprise": 1}, r"update_info: unknown field\(s\) \['surprise'\]"),
    ]
    client.start_weight_update()
    try:
        for update_info, message in cases:
            with pytest.raises(WeightSyncError, match="HTTP 400") as error:
                client.update_weights(update_info)
            assert error.match(message)
    finally:
        client.abort_weight_update()
    assert _checkpoint_and_version(server.url, baseline) == (True, "valid-1")
    client.update_infos.clear()
    engine.send_weights(models[1], weight_version="valid-2")  # the engine's cached buffers were not disturbed
    assert_engine_serves(server.url, models[1], "valid-2")


@pytest.mark.slow
def test_a_stalled_trainer_times_out_in_the_engine_and_the_old_weights_serve(server, trainer, models):
    engine, _ = trainer(timeout_s=4.0)  # generous: a loaded 2-core CI machine must not time out the good sync
    engine.send_weights(models[0], weight_version="before-stall")
    stall_at = "model.layers.1.self_attn.k_proj.weight"

    with pytest.raises(RuntimeError) as error:
        engine.send_weights(FaultySource(models[1], stall_at, stall_s=10.0), weight_version="stalled")

    assert "not filled within timeout_s=4" in str(error.value)
    # The engine names the pack it waited for: the one holding the stalled tensor.
    waited_for = re.search(r"first tensor '([^']+)'", str(error.value)).group(1)
    names = list(dict(models[1].named_parameters()))
    assert names.index(waited_for) <= names.index(stall_at)
    assert_engine_serves(server.url, models[0], "before-stall")
    engine.send_weights(models[1], weight_version="after-stall")  # the same trainer recovers
    assert_engine_serves(server.url, models[1], "after-stall")


@pytest.mark.slow
def test_a_failing_source_aborts_the_sync_and_the_old_weights_serve(server, trainer, models):
    engine, _ = trainer(timeout_s=60.0)
    engine.send_weights(models[0], weight_version="before-failure")
    fail_at = "model.layers.0.mlp.up_proj.weight"

    with pytest.raises(RuntimeError, match=rf"reading '{fail_at}' from the source failed: OSError: checkpoint shard"):
        engine.send_weights(FaultySource(models[2], fail_at), weight_version="failed")

    assert_engine_serves(server.url, models[0], "before-failure")


_KILLED_TRAINER = textwrap.dedent(
    """
    import os, sys, time
    sys.path[:0] = [{tests!r}, {root!r}]
    from sync_helpers import trainer_model
    from weight_transfer.clients import HTTPWeightSyncClient
    from weight_transfer.ipc import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    fill = IPCTrainerWeightTransferEngine._fill
    fills = []

    def fill_then_die(self, buffer, pack, metas, items):
        fills.append(1)
        if len(fills) == 3:  # die once the engine waits for this pack: mid-sync, two packs already landed
            seq = self._next_seq - 1
            deadline = time.monotonic() + 60
            while self._control.taken(buffer.slot) != seq and time.monotonic() < deadline:
                time.sleep(0.01)
            print("dying while the engine waits for", metas[pack.slots[0].index].name, flush=True)
            os._exit(17)
        fill(self, buffer, pack, metas, items)

    IPCTrainerWeightTransferEngine._fill = fill_then_die
    info = IPCTrainerInitInfo(packed_buffer_size_bytes={buffer}, timeout_s=3.0)
    engine = IPCTrainerWeightTransferEngine.trainer_init(info, client=HTTPWeightSyncClient({url!r}))
    engine.send_weights(trainer_model({checkpoint!r}, seed=99), weight_version="never")
    """
)


@pytest.mark.slow
def test_a_killed_trainer_leaves_the_previous_weights_serving(server, trainer, models, checkpoint, tmp_path):
    engine, _ = trainer()
    engine.send_weights(models[2], weight_version="before-kill")
    script = tmp_path / "killed_trainer.py"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(tests_dir))
    script.write_text(
        _KILLED_TRAINER.format(tests=tests_dir, root=root, buffer=SMALL_BUFFER, url=server.url, checkpoint=checkpoint)
    )

    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root
    )
    out, err = proc.communicate(timeout=300)

    assert proc.returncode == 17, out + err
    dying_at = out.split("waits for ")[1].strip()
    # The engine gives up after timeout_s, restores the previous weights and says which pack it waited for.
    httpx.post(f"{server.url}/resume", timeout=120).raise_for_status()
    assert http_greedy(server.url)  # served: queued requests wait for the failed update to end, never hang
    assert_engine_serves(server.url, models[2], "before-kill")
    log = server.stderr_tail(20_000)
    assert f"first tensor {dying_at!r}" in log and "not filled within timeout_s=3" in log, log[-3000:]
    # The dead trainer's segments are unlinked by its resource tracker (the engine's mappings stay valid until dropped).
    deadline = time.monotonic() + 30
    while _my_segments(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _my_segments(proc.pid) == []
