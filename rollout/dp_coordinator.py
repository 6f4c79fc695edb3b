"""The DP coordinator process of a lockstep group: forwards START_WAVE between engines, keeping it for engines not connected yet.

    engine i (idle, gets work) --START_WAVE(N)--> coordinator PULL ("notify")
    coordinator ROUTER ("waves") --START_WAVE(N)--> every other engine (identity = its dp rank)
    engine j --hello--> coordinator ROUTER: delivers the newest START_WAVE kept for j
    frontend --{"op": "resize" | "state"}--> coordinator REP ("control"): elastic EP changes the
        engine count; the frontend polls which engine identities are connected

The frontend side, DPCoordinatorHandle, hosts the group's TCPStore (the rendezvous of the engine
cores' DP sync group, engine/dp_core_proc.py) at data_parallel_master_ip:data_parallel_master_port,
starts the coordinator process and publishes its addresses in the store, where each engine looks
them up. The wave logic is the plain class WaveRouter (tested without sockets).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import weakref

import msgspec
import zmq

from engine.dp_core_proc import DP_COORDINATOR_KEY, WaveMessage
from engine.parent_watch import watch_parent

logger = logging.getLogger(__name__)

_POLL_MS = 200


class WaveRouter:
    """Which engine hears which START_WAVE: all but the sender; a not-yet-connected engine gets it when it connects.

    Each method returns the deliveries to make now, as (engine, wave) pairs. Only the newest
    wave kept for an engine matters: an engine ignores START_WAVE for a wave it has finished.
    """

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.connected: set[int] = set()
        self.kept: dict[int, int] = {}  # engine -> newest wave it must hear once it connects
        self.wave = 0  # the newest wave any engine started
        self.num_waves_forwarded = 0

    def on_hello(self, engine: int) -> list[tuple[int, int]]:
        self._check(engine)
        self.connected.add(engine)
        if engine in self.kept:
            return [(engine, self.kept.pop(engine))]
        return []

    def on_start_wave(self, sender: int, wave: int) -> list[tuple[int, int]]:
        self._check(sender)
        self.wave = max(self.wave, wave)
        self.num_waves_forwarded += 1
        deliveries = []
        for engine in range(self.num_engines):
            if engine == sender:
                continue  # it started the wave itself
            if engine in self.connected:
                deliveries.append((engine, wave))
            else:
                self.kept[engine] = max(self.kept.get(engine, wave), wave)
        return deliveries

    def resize(self, num_engines: int) -> None:
        """Elastic EP: the group now has `num_engines` engines. Engines past the end are forgotten (a
        later engine with the same rank is a new process that must say hello again)."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.connected = {e for e in self.connected if e < num_engines}
        self.kept = {e: w for e, w in self.kept.items() if e < num_engines}

    def state(self) -> dict:
        """{"num_engines", "connected": sorted ranks, "wave", "num_waves_forwarded"}."""
        return {"num_engines": self.num_engines, "connected": sorted(self.connected), "wave": self.wave,
                "num_waves_forwarded": self.num_waves_forwarded}

    def _check(self, engine: int) -> None:
        if not 0 <= engine < self.num_engines:
            raise ValueError(f"engine {engine} is out of range [0, {self.num_engines})")


def _control(router: WaveRouter, request: dict) -> dict:
    """One control request of the frontend: {"op": "resize", "num_engines": N} or {"op": "state"}; answers the state or {"error"}."""
    try:
        if request.get("op") == "resize":
            router.resize(int(request["num_engines"]))
        elif request.get("op") != "state":
            raise ValueError(f"unknown control op {request.get('op')!r}")
    except (KeyError, TypeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return router.state()


def run_dp_coordinator(notify_address: str, waves_address: str, num_engines: int, control_address: str | None = None) -> None:
    """The coordinator process's entry point: route waves until SIGTERM or the parent's death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    watch_parent(lambda: os._exit(0), "dp-coordinator-parent-watch")
    router = WaveRouter(num_engines)
    ctx = zmq.Context()
    notify = ctx.socket(zmq.PULL)
    notify.bind(notify_address)
    waves = ctx.socket(zmq.ROUTER)
    waves.setsockopt(zmq.SNDHWM, 0)
    # A rank that left and came back (elastic EP) is a new process under the old identity: it takes over.
    waves.setsockopt(zmq.ROUTER_HANDOVER, 1)
    waves.bind(waves_address)
    control = ctx.socket(zmq.REP)
    if control_address is not None:
        control.bind(control_address)
    decoder = msgspec.msgpack.Decoder(WaveMessage)
    poller = zmq.Poller()
    poller.register(notify, zmq.POLLIN)
    poller.register(waves, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    try:
        while True:
            for sock, _ in poller.poll(_POLL_MS):
                if sock is control:
                    try:
                        request = json.loads(control.recv())
                    except ValueError:
                        request = {}
                    control.send(json.dumps(_control(router, request if isinstance(request, dict) else {})).encode())
                    continue
                if sock is waves:
                    _identity, payload = waves.recv_multipart()
                else:
                    payload = notify.recv()
                try:
                    message = decoder.decode(payload)
                    if message.kind == "hello":
                        deliveries = router.on_hello(message.dp_rank)
                    elif message.kind == "start_wave":
                        deliveries = router.on_start_wave(message.dp_rank, message.wave)
                    else:
                        raise ValueError(f"unknown message kind {message.kind!r}")
                except (msgspec.DecodeError, ValueError) as e:
                    logger.error("DP coordinator: dropped a bad message: %s", e)
                    continue
                for engine, wave in deliveries:
                    out = msgspec.msgpack.encode(WaveMessage("start_wave", engine, wave))
                    waves.send_multipart([engine.to_bytes(2, "little"), out])
    finally:
        notify.close(linger=0)
        waves.close(linger=0)
        control.close(linger=0)
        ctx.term()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p such that p and p + 1 are free now (the DP sync group's store and the workers' EP group)."""
    for _ in range(100):
        port = free_port(host)
        if port + 1 >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no two adjacent free ports on {host}")


class DPCoordinatorHandle:
    """The frontend's side: the group's TCPStore (hosted in this process) and the coordinator process.

    shutdown() (also at interpreter exit) stops the process and closes the store.
    """

    def __init__(self, num_engines: int, host: str, port: int) -> None:
        import datetime

        import torch.distributed as dist

        self.num_engines = num_engines
        self.host, self.port = host, port
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
        )
        self._tmpdir = tempfile.mkdtemp(prefix="dp-coordinator-")
        self.notify_address = f"ipc://{self._tmpdir}/notify"
        self.waves_address = f"ipc://{self._tmpdir}/waves"
        self.control_address = f"ipc://{self._tmpdir}/control"
        self._control_lock = threading.Lock()
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(
            target=run_dp_coordinator,
            args=(self.notify_address, self.waves_address, num_engines, self.control_address),
            name="DPCoordinator",
            daemon=True,
        )
        self.proc.start()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._tmpdir)
        self.store.set(DP_COORDINATOR_KEY, json.dumps({"notify": self.notify_address, "waves": self.waves_address}))

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def control(self, request: dict, timeout_s: float = 10.0) -> dict:
        """Sends one control request to the coordinator process and returns its answer (blocking; RuntimeError on failure)."""
        with self._control_lock:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.REQ)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.control_address)
                sock.send(json.dumps(request).encode())
                if not sock.poll(int(timeout_s * 1000)):
                    raise RuntimeError(f"the DP coordinator did not answer {request} within {timeout_s} s")
                answer = json.loads(sock.recv())
            finally:
                sock.close(linger=0)
        if "error" in answer:
            raise RuntimeError(f"DP coordinator: {answer['error']}")
        return answer

    def resize(self, num_engines: int) -> dict:
        """Elastic EP: the coordinator routes waves among `num_engines` engines from now on; returns its state."""
        state = self.control({"op": "resize", "num_engines": num_engines})
        self.num_engines = num_engines
        return state

    def state(self) -> dict:
        """The coordinator's {"num_engines", "connected", "wave", "num_waves_forwarded"}."""
        return self.control({"op": "state"})

    def shutdown(self) -> None:
        self._finalizer()
        self.store = None  # the TCPStore server stops with its last reference


def _stop(proc, tmpdir: str) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    shutil.rmtree(tmpdir, ignore_errors=True)
