"""Our trainer side against vLLM 0.33's own RL router: our payloads fit a vLLM server's routes shape for shape.

A FastAPI app mounts vLLM's router (vllm.entrypoints.rl.online.api_router, its metrics included) and is served
by uvicorn on a loopback port. Its app.state.engine_client records every call and checks each request as vLLM's
worker does: init_info through the backend engine's own parse_init_info (NCCLWeightTransferInitInfo for nccl and
sparse_nccl, IPCWeightTransferInitInfo for ipc), update_info through its parse_update_info (vLLM's *UpdateInfo
dataclasses); an unknown field is a TypeError there, a ValueError out of the worker, and the request fails (500),
as on a vLLM server. Everything else - route signatures, body parsing, answers - is vLLM's code.

Our code drives it: weight_transfer.clients.HTTPWeightSyncClient, with the init_info / update_info our trainer
engines build for vLLM's wire (nccl and sparse_nccl wire="vllm", ipc wire="vllm" / "vllm_packed"). The NCCL and
CUDA data planes cannot run on CPU, so the nccl payloads come from the trainer's own builders
(_engine_init_info, dtype_names_list over a WeightSource's metadata as _send builds it, vllm_sparse_call) and go
through the client as the trainer sends them; the ipc trainer's trainer_init runs end to end (its init is the
only client call before CUDA is needed), its update_info from ipc_vllm.update_info with torch's handle layout.
Negative: our default wire ("rollout") is refused by vLLM's dataclass at the router.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from asgi_thread import serve_in_thread

from weight_transfer.clients import HTTPWeightSyncClient, WeightSyncError

UUID = "GPU-3b4c5d6e-0000-1111-2222-333344445555"


class RecordingEngineClient:
    """The engine client methods vLLM's RL router calls, checking requests as vLLM's GPU worker does.

    `backend` is the server's --weight-transfer-config backend (vLLM's init_info names none). State follows
    vLLM's worker and AsyncLLM: update_weights and finish need a started update, finish sets the version.
    """

    def __init__(self, vllm) -> None:
        self.vllm = vllm
        self.engines = {
            "nccl": vllm["nccl_engine"].NCCLWeightTransferEngine,
            "sparse_nccl": vllm["sparse"].SparseNCCLWeightTransferEngine,
            "ipc": vllm["ipc"].IPCWeightTransferEngine,
        }
        # get_world_size reads engine_client.vllm_config.parallel_config (one engine, one worker here)
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(world_size=1, world_size_across_dp=1, data_parallel_index=0))
        self.reset("nccl")

    def reset(self, backend: str) -> None:
        # vLLM's own parse_init_info / parse_update_info (base.WeightTransferEngine), on the backend's class.
        self.engine = object.__new__(self.engines[backend])
        self.backend = backend
        self.calls: list[tuple] = []
        self.rejected: list[tuple[str, str]] = []
        self.initialized = self.active = self.paused = False
        self.version = "v0"

    def _worker(self, what: str, fn):
        try:
            return fn()
        except Exception as e:
            self.rejected.append((what, f"{type(e).__name__}: {e}"))
            raise

    async def init_weight_transfer_engine(self, request) -> None:
        assert isinstance(request, self.vllm["base"].WeightTransferInitRequest)
        parsed = self._worker("init", lambda: self.engine.parse_init_info(request.init_info))
        self.calls.append(("init", request.init_info, parsed))
        self.initialized = True

    async def start_weight_update(self) -> None:
        self._worker("start", lambda: self._require(self.initialized, "init_weight_transfer_engine"))
        self.calls.append(("start",))
        self.active = True

    async def start_draft_weight_update(self) -> None:
        raise ValueError("no draft model")

    async def update_weights(self, request) -> None:
        assert isinstance(request, self.vllm["base"].WeightTransferUpdateRequest)
        info = request.update_info

        def parse():
            self._require(self.active, "start_weight_update")
            local = info[0] if isinstance(info, list) else info  # global rank 0: the only worker
            return self.engine.parse_update_info(local)

        try:
            parsed = self._worker("update", parse)
        except Exception:
            self.active = False  # vLLM's worker ends the session on a failed update
            raise
        self.calls.append(("update", info, parsed))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._worker("finish", lambda: self._require(self.active, "start_weight_update"))
        self.active = False
        self.calls.append(("finish", weight_version))
        if weight_version is not None:
            self.version = weight_version

    async def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(("shutdown",))
        self.initialized = False

    async def update_weight_version(self, new_version: str) -> None:
        self.version = new_version

    async def get_weight_version(self) -> str:
        return self.version

    async def pause_generation(self, *, mode="abort", clear_cache=True) -> None:
        self.calls.append(("pause", mode, clear_cache))
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        return [{"dp0:pp0:pcp0:tp0:model.norm.weight": "ab" * 32}]

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        return [None]

    @staticmethod
    def _require(ok: bool, first: str) -> None:
        if not ok:
            raise RuntimeError(f"{first} must be called first")


@pytest.fixture(scope="module")
def vllm(vllm_import):
    return {
        "router": vllm_import("vllm.entrypoints.rl.online.api_router"),
        "base": vllm_import("vllm.distributed.weight_transfer.base"),
        "nccl_common": vllm_import("vllm.distributed.weight_transfer.nccl_common"),
        "nccl_engine": vllm_import("vllm.distributed.weight_transfer.nccl_engine"),
        "sparse": vllm_import("vllm.distributed.weight_transfer.sparse_nccl_engine"),
        "ipc": vllm_import("vllm.distributed.weight_transfer.ipc_engine"),
    }


@pytest.fixture(scope="module")
def vllm_server(vllm):
    """vLLM's RL router on a loopback port, our recording engine client behind it."""
    from fastapi import FastAPI

    app = FastAPI()
    app.include_router(vllm["router"].router)
    recorder = RecordingEngineClient(vllm)
    app.state.engine_client = recorder
    with serve_in_thread(app) as url:
        yield types.SimpleNamespace(url=url, recorder=recorder)


@pytest.fixture
def client(vllm_server):
    c = HTTPWeightSyncClient(vllm_server.url, timeout=30)
    yield c
    c.close()


def _source():
    """A trainer's WeightSource over a small module (bf16, fp32 and fp16 tensors)."""
    from weight_transfer.base import as_source

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(16, 8).to(torch.bfloat16)
    model.up = torch.nn.Linear(8, 24, bias=False)
    model.norm = torch.nn.LayerNorm(8, elementwise_affine=True).to(torch.float16)
    return as_source(model)


def _nccl_trainer(wire: str, sparse: bool = False):
    """Our nccl / sparse_nccl trainer rank 0 as _join leaves it, up to the point NCCL would start."""
    from weight_transfer.nccl import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
    from weight_transfer.process_group import host_store
    from weight_transfer.sparse_nccl import SparseNCCLTrainerInitInfo, SparseNCCLTrainerWeightTransferEngine

    info_cls, cls = ((SparseNCCLTrainerInitInfo, SparseNCCLTrainerWeightTransferEngine) if sparse
                     else (NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine))
    info = info_cls(master_address="127.0.0.1", master_port=0, world_size=2, wire=wire,
                    packed=not sparse, packed_buffer_size_bytes=4096)
    trainer = cls(info, None, None, 0)
    trainer.store = host_store("127.0.0.1", 0, 10.0)
    trainer.device, trainer.generation = torch.device("cuda" if wire == "vllm" else "cpu"), 0
    return trainer


def _sent_fields_are_vllms(vllm, payload: dict, parsed) -> None:
    """No extra field (the dataclass took it) and none missing: vLLM's own serializer of the parsed
    init_info (worker_init_payload: asdict without the unset rendezvous mode) gives back what we sent."""
    assert vllm["nccl_common"].worker_init_payload(parsed) == payload


# ---- nccl and sparse_nccl, wire="vllm" -------------------------------------------------------------------


@pytest.mark.parametrize("sparse", [False, True], ids=["nccl", "sparse_nccl"])
def test_our_nccl_trainer_payloads_go_through_vllms_router(vllm, vllm_server, client, sparse):
    from weight_transfer.packing import dtype_names_list
    from weight_transfer.sparse_nccl import vllm_sparse_call

    rec = vllm_server.recorder
    rec.reset("sparse_nccl" if sparse else "nccl")
    trainer = _nccl_trainer("vllm", sparse)
    assert client.get_world_size() == 1  # what _join checks world_size against: vLLM's /get_world_size
    assert client.get_world_size(include_dp=False) == 1
    client.pause_generation("wait", False)
    init_info = trainer._engine_init_info()
    client.init_weight_transfer_engine(init_info)  # returns: vLLM answered 200 {"message": ...}
    client.start_weight_update()
    metas = _source().metadata
    if sparse:  # _send_chunk_vllm: every entry a patch
        from weight_transfer.base import SparseWeightPatch

        patch = SparseWeightPatch("up.weight", torch.tensor([1, 7, 100], dtype=torch.int32),
                                  torch.tensor([0.5, -1.0, 2.0]), (24, 8))
        update_info, _, _ = vllm_sparse_call([("up.weight", patch), ("norm.weight", torch.ones(8, dtype=torch.float16))])
    else:  # _send: the metadata round, then _send_call_vllm posts it unchanged
        update_info = dtype_names_list([m.name for m in metas], [m.dtype for m in metas], [m.shape for m in metas])
    client.update_weights(update_info)
    client.update_weights([update_info])  # vLLM's per-worker list form, global rank order
    client.finish_weight_update("step-7")
    assert client.get_weight_version() == "step-7"
    assert client.weight_info() == {"weight_version": "step-7"}  # vLLM's body, read as it is
    client.resume_generation()
    client.shutdown_weight_transfer_engine()

    assert rec.rejected == []
    kinds = [c[0] for c in rec.calls]
    assert kinds == ["pause", "init", "start", "update", "update", "finish", "resume", "shutdown"]
    assert rec.calls[0] == ("pause", "wait", False)  # our query flags, parsed by vLLM's signature
    _, sent_init, parsed_init = rec.calls[1]
    assert sent_init == init_info and "backend" not in sent_init
    assert isinstance(parsed_init, vllm["nccl_common"].NCCLWeightTransferInitInfo)
    _sent_fields_are_vllms(vllm, sent_init, parsed_init)
    assert (parsed_init.master_port, parsed_init.rank_offset, parsed_init.world_size, parsed_init.packed) == (
        trainer.store.port, 1, 2, not sparse)
    update_cls = (vllm["sparse"].SparseNCCLWeightTransferUpdateInfo if sparse
                  else vllm["nccl_engine"].NCCLWeightTransferUpdateInfo)
    for (_, sent, parsed), form in zip(rec.calls[3:5], [update_info, [update_info]]):
        assert sent == form
        assert isinstance(parsed, update_cls)
        assert dataclasses.asdict(parsed) == update_info  # every field ours, none extra, none defaulted
        assert "call_id" not in update_info  # our store-keyed extra stays on our own wire
    if sparse:
        assert rec.calls[3][2].num_updates_list == [3, 8]
    else:
        assert [getattr(torch, d) for d in rec.calls[3][2].dtype_names] == [m.dtype for m in metas]
    assert rec.calls[5] == ("finish", "step-7")


def test_our_default_rollout_wire_is_refused_by_vllms_dataclass(vllm, vllm_server, client):
    rec = vllm_server.recorder
    rec.reset("nccl")
    init_info = _nccl_trainer("rollout")._engine_init_info()
    with pytest.raises(WeightSyncError, match=r"/init_weight_transfer_engine: HTTP 500"):
        client.init_weight_transfer_engine(init_info)
    ((what, why),) = rec.rejected
    assert what == "init" and "Invalid init_info for NCCLWeightTransferEngine" in why
    assert "unexpected keyword argument" in why  # vLLM's dataclass: a field it does not have
    assert rec.calls == []
    # vLLM's init_info fields alone (what wire="vllm" sends) are accepted by the same server
    vllm_fields = {k: v for k, v in init_info.items() if k not in {"backend", "timeout_s", "device_type",
                                                                     "group_generation"}}
    client.init_weight_transfer_engine(vllm_fields)
    assert [c[0] for c in rec.calls] == ["init"]
    # and an update before start fails at vLLM's worker, as our engine refuses it
    with pytest.raises(WeightSyncError, match="/update_weights: HTTP 500"):
        client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    assert rec.rejected[-1] == ("update", "RuntimeError: start_weight_update must be called first")


def test_our_rollout_update_info_is_refused_by_vllms_dataclass(vllm, vllm_server, client):
    """wire="rollout" adds call_id to update_info: vLLM's NCCLWeightTransferUpdateInfo has no such field."""
    from weight_transfer.packing import dtype_names_list

    rec = vllm_server.recorder
    rec.reset("nccl")
    client.init_weight_transfer_engine({k: v for k, v in _nccl_trainer("vllm")._engine_init_info().items()})
    client.start_weight_update()
    update = {**dtype_names_list(["w"], [torch.float32], [[2]]), "call_id": 1}  # as _send_call sends it
    with pytest.raises(WeightSyncError, match="/update_weights: HTTP 500"):
        client.update_weights(update)
    assert rec.rejected[-1][0] == "update" and "call_id" in rec.rejected[-1][1]


# ---- ipc, wire="vllm" / "vllm_packed" ---------------------------------------------------------------------


def _rebuild_args(dtype, shape) -> tuple:
    """rebuild_cuda_tensor's arguments in torch's reduce_tensor layout (made-up handle bytes; CPU here)."""
    size = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return (torch.Tensor, size, stride, 0, torch.storage.TypedStorage, dtype, 0, b"\x11" * 64,
            size.numel() * dtype.itemsize, 0, False, b"/torch_1_2_0", 0, b"\x22" * 64, True)


@pytest.mark.parametrize("wire", ["vllm", "vllm_packed"])
def test_our_ipc_trainer_goes_through_vllms_router(vllm, vllm_server, client, monkeypatch, wire):
    from weight_transfer import ipc_vllm, packing
    from weight_transfer.ipc import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    rec = vllm_server.recorder
    rec.reset("ipc")
    packed = wire == "vllm_packed"
    # trainer_init end to end: on vLLM's shape its only client call is init_weight_transfer_engine.
    trainer = IPCTrainerWeightTransferEngine.trainer_init(
        IPCTrainerInitInfo(wire=wire, packed_buffer_size_bytes=1024), client=client)
    assert isinstance(trainer, ipc_vllm.VLLMShapeIPCTrainer)
    metas = _source().metadata
    names, dtypes, shapes = [m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas]
    if packed:  # _send_packed: one buffer's handle, each tensor's bytes
        handles = {UUID: _rebuild_args(torch.uint8, (1024,))}
        sizes = [packing.nbytes_of(d, s) for d, s in zip(dtypes, shapes)]
    else:  # _send_unpacked: one handle per tensor
        handles, sizes = [{UUID: _rebuild_args(d, s)} for d, s in zip(dtypes, shapes)], None
    update_info = ipc_vllm.update_info(names, dtypes, shapes, handles, sizes, pickled=True)
    client.start_weight_update()
    # A vLLM server reads pickled handles only with its switch set, as it refuses them without:
    with pytest.raises(WeightSyncError, match="/update_weights: HTTP 500"):
        client.update_weights(update_info)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" in rec.rejected[-1][1]
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    client.start_weight_update()  # the failed update ended vLLM's session
    client.update_weights(update_info)
    client.finish_weight_update("ipc-1")
    assert client.get_weight_version() == "ipc-1"
    trainer.shutdown()
    client.shutdown_weight_transfer_engine()

    assert [c[0] for c in rec.calls] == ["init", "start", "start", "update", "finish", "shutdown"]
    _, sent_init, parsed_init = rec.calls[0]
    assert sent_init == {"packed": packed}
    assert isinstance(parsed_init, vllm["ipc"].IPCWeightTransferInitInfo)
    assert dataclasses.asdict(parsed_init) == sent_init  # exactly vLLM's fields
    _, sent, parsed = rec.calls[3]
    assert isinstance(parsed, vllm["ipc"].IPCWeightTransferUpdateInfo)
    assert set(sent) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"} | ({"tensor_sizes"} if packed else set())
    assert (parsed.names, parsed.shapes, parsed.tensor_sizes) == (names, shapes, sizes)
    assert [getattr(torch, d) for d in parsed.dtype_names] == dtypes
    assert parsed.ipc_handles == handles  # vLLM's worker unpickles the very handles we put in
    assert rec.calls[4] == ("finish", "ipc-1")


# ---- the rest of our client against vLLM's bodies ----------------------------------------------------------


def test_our_client_reads_vllms_control_bodies(vllm_server, client):
    rec = vllm_server.recorder
    rec.reset("nccl")
    client.pause_generation()  # vLLM's defaults: mode abort, clear_cache true
    assert rec.calls[-1] == ("pause", "abort", True)
    client.resume_generation()
    assert rec.paused is False
    assert client.weight_checker(action="checksum") == {"checksums": {"dp0:pp0:pcp0:tp0:model.norm.weight": "ab" * 32}}
    baseline = {"dp0:pp0:pcp0:tp0:model.norm.weight": "cd" * 32}
    assert client.weight_checker(baseline, action="compare") == {
        "match": False, "mismatches": ["dp0:pp0:pcp0:tp0:model.norm.weight"]}
    assert client.weight_checker(action="reset") == {"status": "reset"}
    assert rec.calls[-1] == ("rpc", "reset_weights")
    # a finish without a start is vLLM's worker error, reaching our client as a WeightSyncError
    with pytest.raises(WeightSyncError, match="/finish_weight_update: HTTP 500"):
        client.finish_weight_update("x")
    assert client.get_weight_version() == "v0"
    # Our extra, which vLLM lacks: a vLLM server answers 404 and our client says so (our trainer only logs it).
    with pytest.raises(WeightSyncError, match=r"/abort_weight_update: HTTP 404: Not Found"):
        client.abort_weight_update()
