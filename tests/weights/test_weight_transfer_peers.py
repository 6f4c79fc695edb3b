"""Weight-transfer peers: the allowed-hosts check, bounded init_info numbers, and an init that waits on a silent peer
without holding the engine (a real `rollout launch` process, an in-process engine, and the matcher alone)."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import torch

from engine import LLM
from engine.allowed_hosts import AllowedHosts
from engine.config import WeightTransferConfig
from engine.exceptions import PeerTimeoutError, WeightUpdateStateError
from rollout.cli import build_parser
from rollout.cli_args import dataclass_kwargs
from weight_transfer.base import trainer_init
from weight_transfer.clients import HTTPWeightSyncClient
from weight_transfer.nccl import NCCLTrainerInitInfo, NCCLWeightTransferEngine

from sync_helpers import assert_engine_serves, http_greedy, trainer_model

HANG_S = 15.0  # client-side timeouts: hang detection only, never a timing assertion
FLAG = "--weight-transfer-allowed-hosts"


class SilentListener:
    """A TCP listener that accepts connections and never writes (a trainer's store that is not one)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.connected = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.accepted.append(conn)
            self.connected.set()

    def close(self) -> None:
        """Closes every accepted connection (a client stuck reading sees the reset) and the listener."""
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def listener():
    silent = SilentListener()
    yield silent
    silent.close()


def _init_info(host: str, port: int, **overrides) -> dict:
    # Our trainer's init_info (group_generation: our rendezvous, the one a CPU engine joins).
    return {"backend": "nccl", "master_address": host, "master_port": port, "world_size": 2, "device_type": "cpu",
            "timeout_s": 5, "group_generation": 0, **overrides}


# ---------------------------------------------------------------------------------------
# The allowed-hosts matcher and its config field


def test_the_default_allows_loopback_only():
    allowed = AllowedHosts.parse(WeightTransferConfig().weight_transfer_allowed_hosts)
    for host in ("127.0.0.1", "::1", "localhost", "LOCALHOST", "::ffff:127.0.0.1"):
        allowed.check(host, "init_info.master_address")
    allowed.check_resolved("localhost", "init_info.master_address")
    for host in ("10.1.2.3", "127.0.0.2", "0.0.0.0"):
        with pytest.raises(ValueError, match=rf"init_info.master_address: {host} is not in weight_transfer_allowed_hosts .*\({FLAG}\)"):
            allowed.check(host, "init_info.master_address")


def test_networks_names_and_star():
    allowed = AllowedHosts.parse(["10.0.0.0/8", "trainer-0.cluster", "fd00::/8", "192.168.1.7"])
    for host in ("10.1.2.3", "10.255.255.255", "trainer-0.cluster", "TRAINER-0.cluster.", "fd00::1", "192.168.1.7"):
        allowed.check(host, "x")
    for host in ("11.0.0.1", "192.168.1.8", "fe80::1", "::1", "127.0.0.1"):
        with pytest.raises(ValueError, match=f"x: {host} is not in"):
            allowed.check(host, "x")
    # A name not listed itself passes only if every address it resolves to is inside a listed network.
    allowed.check("localhost", "x")  # no DNS here: decided when it is resolved
    with pytest.raises(ValueError, match=r"x: localhost \(which resolves to .*\) is not in"):
        allowed.check_resolved("localhost", "x")
    AllowedHosts.parse(["127.0.0.0/8", "::1"]).check_resolved("localhost", "x")
    anything = AllowedHosts.parse(["*"])
    for host in ("10.1.2.3", "8.8.8.8", "some-host", "::1"):
        anything.check(host, "x")
    nothing = AllowedHosts.parse([])
    with pytest.raises(ValueError, match="is not in weight_transfer_allowed_hosts"):
        nothing.check("127.0.0.1", "x")


@pytest.mark.parametrize("host", ["", "  ", "bad host!", "a..b", "-x.y", 7, None, "x" * 300, "[::1]"])
def test_a_malformed_address_is_a_value_error_naming_the_field(host):
    with pytest.raises(ValueError, match="init_info.master_address: "):
        AllowedHosts.parse(["*"]).check(host, "init_info.master_address")


def test_an_unresolvable_name_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="init_info.master_address: cannot resolve 'no-such-host.invalid'"):
        AllowedHosts.parse(["*"]).check_resolved("no-such-host.invalid", "init_info.master_address")


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "bad host", "", 5, "1.2.3.4/x"])
def test_a_bad_allowed_hosts_entry_is_refused_by_the_config(entry):
    with pytest.raises(ValueError, match="weight_transfer_allowed_hosts"):
        WeightTransferConfig([entry])


def test_the_launch_flag_is_generated_from_the_config():
    args = build_parser().parse_args(["launch", "--model", "m", FLAG, "10.0.0.0/8", "trainer-0", "*"])
    kwargs = dataclass_kwargs(args, WeightTransferConfig)
    assert kwargs == {"weight_transfer_allowed_hosts": ["10.0.0.0/8", "trainer-0", "*"]}
    assert WeightTransferConfig(**kwargs).weight_transfer_allowed_hosts == ["10.0.0.0/8", "trainer-0", "*"]


# ---------------------------------------------------------------------------------------
# init_info numbers: bounded, finite, never booleans


@pytest.mark.parametrize(
    "change,field",
    [
        ({"timeout_s": 1e308}, "init_info.timeout_s"),
        ({"timeout_s": float("nan")}, "init_info.timeout_s"),
        ({"timeout_s": float("inf")}, "init_info.timeout_s"),
        ({"timeout_s": -1}, "init_info.timeout_s"),
        ({"timeout_s": 0}, "init_info.timeout_s"),
        ({"timeout_s": True}, "init_info.timeout_s"),
        ({"timeout_s": 10**400}, "init_info.timeout_s"),
        ({"world_size": 2**64}, "init_info.world_size"),
        ({"world_size": True}, "init_info.world_size"),
        ({"master_port": True}, "init_info.master_port"),
        ({"group_generation": 2**63}, "init_info.group_generation"),
        ({"dp_index": 10**30}, "init_info"),
        ({"packed_num_buffers": 10**6}, "init_info.packed_num_buffers"),
        ({"packed_buffer_size_bytes": 2**64}, "init_info.packed_buffer_size_bytes"),
    ],
)
def test_init_info_numbers_are_bounded(change, field):
    with pytest.raises(ValueError, match=field):
        NCCLWeightTransferEngine(torch.device("cpu")).parse_init_info(_init_info("127.0.0.1", 29500, **change))


def test_trainer_init_info_timeout_is_bounded():
    for timeout_s in (1e308, float("nan"), -1.0, True):
        with pytest.raises(ValueError, match="timeout_s"):
            NCCLTrainerInitInfo("127.0.0.1", 0, 2, timeout_s=timeout_s)


# ---------------------------------------------------------------------------------------
# In process: the blocking form waits, bounded, and a failed init changes nothing


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128)


def test_in_process_init_toward_a_silent_peer_times_out_and_changes_nothing(llm, listener):
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    with pytest.raises(PeerTimeoutError, match=rf"127\.0\.0\.1:{listener.port}.*timeout_s=1"):
        core.init_weight_transfer_engine(_init_info("127.0.0.1", listener.port, timeout_s=1))
    assert listener.connected.is_set()
    worker = core.executor.worker
    assert worker.weight_updater.backend == "local"  # the previous transfer engine is still the one in place
    core.start_weight_update()  # and it works
    core.finish_weight_update()


def test_in_process_allowed_hosts_refuse_before_connecting(llm):
    outside = SilentListener("127.0.0.2")
    try:
        with pytest.raises(ValueError, match=rf"init_info.master_address: 127.0.0.2 is not in .*{FLAG}"):
            llm.engine_core.init_weight_transfer_engine(_init_info("127.0.0.2", outside.port))
        assert not outside.accepted
    finally:
        outside.close()


def test_weight_calls_are_refused_while_an_init_is_pending(llm, listener):
    core = llm.engine_core
    deferred = core.begin_weight_transfer_init(_init_info("127.0.0.1", listener.port, timeout_s=5))
    try:
        assert listener.connected.wait(HANG_S)
        assert not deferred.poll()
        for call in (core.start_weight_update, core.finish_weight_update, core.abort_weight_update,
                     core.shutdown_weight_transfer_engine,
                     lambda: core.init_weight_transfer_engine({"backend": "local"})):
            with pytest.raises(WeightUpdateStateError, match="still waiting for"):
                call()
    finally:
        listener.close()
    with pytest.raises(PeerTimeoutError, match=f"127.0.0.1:{listener.port}"):
        deferred.wait()
    core.init_weight_transfer_engine({"backend": "local"})  # a later init works
    core.start_weight_update()
    core.abort_weight_update()


# ---------------------------------------------------------------------------------------
# A real `rollout launch --enable-rl-routes` process


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(launch_server, checkpoint):
    return launch_server(checkpoint, "--enable-rl-routes")


def _post_init(url: str, init_info: dict, timeout: float = HANG_S) -> httpx.Response:
    return httpx.post(url + "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=timeout)


def _error(response: httpx.Response, status: int, *words: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


@pytest.mark.slow
def test_init_toward_a_silent_listener_answers_504_naming_the_peer(server, listener):
    before = http_greedy(server.url)
    r = _post_init(server.url, _init_info("127.0.0.1", listener.port, timeout_s=5))
    _error(r, 504, f"127.0.0.1:{listener.port}", "timeout_s=5")
    assert listener.connected.is_set()
    assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    assert http_greedy(server.url) == before


@pytest.mark.slow
def test_generation_and_other_calls_go_on_while_an_init_waits(server, listener):
    before = http_greedy(server.url)
    answer: list[httpx.Response] = []
    init = threading.Thread(target=lambda: answer.append(
        _post_init(server.url, _init_info("127.0.0.1", listener.port, timeout_s=8), timeout=60)))
    init.start()
    try:
        assert listener.connected.wait(HANG_S)  # the engine is in the rendezvous now
        with httpx.Client(base_url=server.url, timeout=10) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            r = http.post("/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
            for route in ("/start_weight_update", "/finish_weight_update"):
                _error(http.post(route, json={}), 400, "still waiting for", f"127.0.0.1:{listener.port}")
            _error(http.post("/init_weight_transfer_engine", json={"init_info": {"backend": "local"}}), 400,
                   "still waiting for")
            assert http.get("/health").status_code == 200
        assert init.is_alive()  # the init itself is still waiting
    finally:
        # torch's TCPStore client takes the reset for a peer not up yet and retries until timeout_s:
        # the init ends with its timeout, as against a trainer that never comes.
        listener.close()
        init.join(60)
    _error(answer[0], 504, f"127.0.0.1:{listener.port}")
    assert httpx.get(server.url + "/health", timeout=HANG_S).status_code == 200
    assert http_greedy(server.url) == before


@pytest.mark.slow
def test_a_master_address_outside_the_allowed_hosts_is_a_400_and_no_connection(server):
    outside = SilentListener("127.0.0.2")  # loopback, but not in the default list (127.0.0.1, ::1, localhost)
    try:
        for host in ("127.0.0.2", "10.1.2.3"):
            r = _post_init(server.url, _init_info(host, outside.port))
            _error(r, 400, "init_info.master_address", host, "weight_transfer_allowed_hosts", FLAG)
        _error(_post_init(server.url, _init_info("bad host!", outside.port)), 400, "init_info.master_address")
        assert not outside.accepted
    finally:
        outside.close()


@pytest.mark.slow
@pytest.mark.parametrize("timeout_s", ["1e308", "NaN", "Infinity", "-1", "0", "1e999", "true"])
def test_a_bad_timeout_is_a_400_naming_it(server, timeout_s):
    body = json.dumps({"init_info": _init_info("127.0.0.1", 29500)}).replace('"timeout_s": 5', f'"timeout_s": {timeout_s}')
    r = httpx.post(server.url + "/init_weight_transfer_engine", content=body,
                   headers={"content-type": "application/json"}, timeout=HANG_S)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    if timeout_s in ("NaN", "Infinity"):  # not JSON at all: the strict body parser refuses them first
        assert timeout_s in message
    else:
        assert "init_info.timeout_s" in message


def _sync_over_nccl(url: str, checkpoint: str, info: NCCLTrainerInitInfo, seed: int, version: str) -> None:
    """One real nccl (gloo) sync of a fresh trainer model into the server, checked against what it serves."""
    client = HTTPWeightSyncClient(url)
    model = trainer_model(checkpoint, seed=seed)
    trainer = trainer_init(info, client=client, source=model)
    try:
        trainer.send_weights(weight_version=version)
        assert_engine_serves(url, model, version)
    finally:
        trainer.shutdown()
        client.close()


@pytest.mark.slow
def test_a_real_sync_works_after_all_that(server, checkpoint):
    info = NCCLTrainerInitInfo("127.0.0.1", 0, 2, packed_buffer_size_bytes=32 << 10, timeout_s=20.0)
    _sync_over_nccl(server.url, checkpoint, info, 61, "after-peers")


@pytest.mark.slow
def test_the_flag_lets_another_address_through(launch_server, checkpoint):
    """--weight-transfer-allowed-hosts 127.0.0.0/8: the engine connects to 127.0.0.2, and a real sync runs over it."""
    server = launch_server(checkpoint, "--enable-rl-routes", FLAG, "127.0.0.0/8")
    outside = SilentListener("127.0.0.2")
    try:
        _error(_post_init(server.url, _init_info("127.0.0.2", outside.port, timeout_s=2)), 504, f"127.0.0.2:{outside.port}")
        assert outside.accepted  # allowed: it was tried
    finally:
        outside.close()
    _sync_over_nccl(server.url, checkpoint, NCCLTrainerInitInfo("127.0.0.2", 0, 2, timeout_s=20.0), 62, "via-127.0.0.2")


@pytest.mark.slow
def test_tensor_parallel_ranks_install_together_or_not_at_all(checkpoint):
    """TP=2 in worker processes behind an engine process: a timed-out init installs nothing on any rank, then a real
    sync reaches both ranks (each joins at its own rank, and both commit together)."""
    from rollout import RolloutWorker
    from weight_transfer.clients import LocalWeightSyncClient

    from weight_helpers import engine_greedy, hf_greedy

    with RolloutWorker(model=checkpoint, multiprocess=True, tensor_parallel_size=2, device="cpu", dtype="float32",
                       max_model_len=128, disable_log_stats=True) as worker:
        silent = SilentListener()
        try:
            with pytest.raises(PeerTimeoutError, match=rf"127\.0\.0\.1:{silent.port}"):
                worker.init_weight_transfer_engine(_init_info("127.0.0.1", silent.port, world_size=3, timeout_s=3))
            assert len(silent.accepted) >= 2  # both ranks tried
        finally:
            silent.close()
        with pytest.raises(ValueError, match="no weight transfer engine"):
            worker.start_weight_update()  # nothing was installed on either rank
        model = trainer_model(checkpoint, seed=63)
        trainer = trainer_init(NCCLTrainerInitInfo("127.0.0.1", 0, 3, packed_buffer_size_bytes=32 << 10, timeout_s=20.0),
                               client=LocalWeightSyncClient(worker), source=model)
        try:
            trainer.send_weights(weight_version="tp2")
        finally:
            trainer.shutdown()
        assert [list(o.outputs[0].token_ids) for o in engine_greedy(worker)] == hf_greedy(model)
        assert worker.get_weight_version() == "tp2"


@pytest.mark.parametrize("backend", ["nccl", "sparse_nccl"])
def test_backends_that_connect_out_name_the_address_to_check(backend):
    from weight_transfer.base import get_engine_backend

    engine = get_engine_backend(backend)(torch.device("cpu"))
    rendezvous = engine.rendezvous(engine.parse_init_info(_init_info("10.1.2.3", 29500, backend=backend, timeout_s=7)))
    assert (rendezvous.host, rendezvous.where, rendezvous.timeout_s) == ("10.1.2.3", "init_info.master_address", 7.0)
    assert "10.1.2.3:29500" in rendezvous.peer
    local = get_engine_backend("local")(torch.device("cpu"))
    assert local.rendezvous(local.parse_init_info({"backend": "local"})).host is None  # connects nowhere
