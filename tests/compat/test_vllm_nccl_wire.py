"""The nccl / sparse_nccl wire against vLLM 0.33's own code, both ways (CPU: everything but the NCCL data plane).

- vLLM's trainer -> our engine: the init_info and update_info dicts vLLM's trainer engines build (their own
  payload builders and request dataclasses, asdict as their send path does) are accepted by our engine side
  and parsed to the same values vLLM's worker parses them to.
- our trainer -> vLLM's engine: what our trainer sends with wire="vllm" is accepted by vLLM's
  NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo; with wire="rollout" it is vLLM's fields plus
  exactly our documented extras.
- packing: our packed buffers are vLLM's pack_tensors output byte for byte, chunk for chunk.
- rendezvous: our engine reads the unique id a real vLLM StatelessProcessGroup publishes (as
  PyNcclCommunicator does) from its TCPStore; vLLM's group reads the one our trainer publishes; hostile
  pickles in the store are refused without running; the base64 mode agrees with vLLM's decoder.
The NCCL communicator itself (ncclCommInitRank against vLLM's PyNcclCommunicator) needs GPUs: issue #27.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import pickle
import threading

import pytest
import torch

from weight_transfer import vllm_nccl
from weight_transfer.messages import parse_message
from weight_transfer.nccl import (
    NCCLInitInfo,
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
)
from weight_transfer.packing import copy_into, dtype_names_list, plan_nccl_packs
from weight_transfer.process_group import connect_store, host_store
from weight_transfer.sparse_nccl import SparseNCCLWeightTransferEngine, vllm_sparse_wire_specs

VLLM_INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
                    "packed_buffer_size_bytes", "packed_num_buffers"}
OUR_INIT_EXTRAS = {"backend", "timeout_s", "device_type", "group_generation"}  # wire="rollout" only
TENSORS = [("model.embed_tokens.weight", torch.bfloat16, (16, 8)), ("model.layers.0.mlp.up_proj.weight",
           torch.float32, (24, 8)), ("model.norm.weight", torch.float16, (8,)), ("model.empty", torch.float32, (0, 4))]


@pytest.fixture(scope="module")
def vllm_nccl_engine(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.nccl_engine")


@pytest.fixture(scope="module")
def vllm_nccl_common(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.nccl_common")


@pytest.fixture(scope="module")
def vllm_sparse(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.sparse_nccl_engine")


def _cuda_engine(cls=NCCLWeightTransferEngine):
    """Our engine side as on a CUDA worker (vLLM's rendezvous needs one); parsing touches no GPU."""
    return cls(torch.device("cuda", 0))


def _vllm_parsed_init(vllm_nccl_common, payload: dict) -> dict:
    return dataclasses.asdict(vllm_nccl_common.NCCLWeightTransferInitInfo(**payload))


def _ours_as_vllm(info: NCCLInitInfo) -> dict:
    return {name: getattr(info, name) for name in VLLM_INIT_FIELDS}


# ---- vLLM's trainer -> our engine ---------------------------------------------------------------------


@pytest.mark.parametrize("packed", [True, False])
def test_vllm_dense_trainer_init_payload_parses_as_vllm_parses_it(vllm_nccl_engine, vllm_nccl_common, packed):
    trainer_info = vllm_nccl_engine.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29511, world_size=3,
                                                        packed=packed, packed_buffer_size_bytes=4096,
                                                        packed_num_buffers=3, rank=0)
    payload = vllm_nccl_engine.NCCLTrainerWeightTransferEngine._build_worker_init_payload(trainer_info)
    assert "backend" not in payload  # vLLM's init_info names no backend: the server picks it
    engine = _cuda_engine()
    ours = engine.parse_init_info(payload)
    assert ours.protocol == "vllm"
    assert _ours_as_vllm(ours) == _vllm_parsed_init(vllm_nccl_common, payload)
    assert engine.rendezvous(ours).host == "127.0.0.1"  # checked against the allowed hosts before connecting


def test_vllm_sparse_trainer_init_payload_parses_as_vllm_parses_it(vllm_sparse, vllm_nccl_common):
    trainer_info = vllm_sparse.SparseNCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29512,
                                                         world_size=2, rank=0)
    payload = vllm_sparse.SparseNCCLTrainerWeightTransferEngine._build_worker_init_payload(trainer_info)
    ours = _cuda_engine(SparseNCCLWeightTransferEngine).parse_init_info(payload)
    assert _ours_as_vllm(ours) == _vllm_parsed_init(vllm_nccl_common, payload)
    assert ours.packed is False  # vLLM's worker default, and sparse is never packed


def _unique_id(ip: str = "127.0.0.1", port: int = 40123) -> bytes:
    """An ncclUniqueId as NCCL lays it out: a magic, then rank 0's bootstrap sockaddr (the rest random)."""
    import ipaddress
    import socket
    import struct

    address = ipaddress.ip_address(ip)
    if address.version == 4:
        sockaddr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + address.packed
    else:
        sockaddr = struct.pack("<H", socket.AF_INET6) + struct.pack(">H", port) + b"\0" * 4 + address.packed
    head = os.urandom(8) + sockaddr
    return head + os.urandom(vllm_nccl.UNIQUE_ID_BYTES - len(head))


def test_unique_id_bootstrap_address_is_checked_against_the_allowed_hosts():
    from engine.allowed_hosts import AllowedHosts

    loopback = AllowedHosts.parse(["127.0.0.1", "::1", "localhost"])
    assert vllm_nccl.unique_id_address(_unique_id("10.1.2.3")) == "10.1.2.3"
    assert vllm_nccl.unique_id_address(_unique_id("fd00::7")) == "fd00::7"
    unknown = b"\0" * 8 + b"\x63\x00" + os.urandom(118)  # family 99
    assert vllm_nccl.unique_id_address(unknown) is None
    where = "the trainer's TCPStore key broadcast_from/0/0"
    vllm_nccl.check_unique_id_address(_unique_id("127.0.0.1"), loopback, where)
    with pytest.raises(ValueError, match=r"broadcast_from/0/0 \(the NCCL bootstrap address it carries\): 10.1.2.3"):
        vllm_nccl.check_unique_id_address(_unique_id("10.1.2.3"), loopback, where)
    with pytest.raises(ValueError, match="cannot read the NCCL unique id's bootstrap address"):
        vllm_nccl.check_unique_id_address(unknown, loopback, where)
    vllm_nccl.check_unique_id_address(unknown, AllowedHosts.parse(["*"]), where)
    # The base64 mode names the address before anything connects: the worker checks Rendezvous.host.
    engine = _cuda_engine()
    payload = {"nccl_unique_id_b64": vllm_nccl.encode_unique_id_b64(_unique_id("10.1.2.3")), "rank_offset": 1,
               "world_size": 2}
    rendezvous = engine.rendezvous(engine.parse_init_info(payload))
    assert (rendezvous.host, rendezvous.where) == ("10.1.2.3", "init_info.nccl_unique_id_b64")
    engine.allowed_hosts = loopback
    payload["nccl_unique_id_b64"] = vllm_nccl.encode_unique_id_b64(unknown)
    with pytest.raises(ValueError, match="init_info.nccl_unique_id_b64: its NCCL bootstrap address cannot be read"):
        engine.rendezvous(engine.parse_init_info(payload))


def test_vllm_unique_id_init_payload_parses_as_vllm_parses_it(vllm_nccl_common):
    uid = _unique_id("127.0.0.1")
    info = vllm_nccl_common.NCCLWeightTransferInitInfo(nccl_unique_id_b64=base64.b64encode(uid).decode(),
                                                       rank_offset=1, world_size=2, packed=True)
    payload = vllm_nccl_common.worker_init_payload(info)
    assert "master_address" not in payload
    engine = _cuda_engine()
    ours = engine.parse_init_info(payload)
    assert _ours_as_vllm(ours) == _vllm_parsed_init(vllm_nccl_common, payload)
    assert vllm_nccl.decode_unique_id_b64(ours.nccl_unique_id_b64) == info.nccl_unique_id_bytes == uid
    assert engine.rendezvous(ours).host == "127.0.0.1"  # no store: NCCL's bootstrap address, checked first


@pytest.mark.parametrize(
    "payload",
    [
        {"rank_offset": 1, "world_size": 2},  # no rendezvous at all
        {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2},  # half a TCP pair
        {"nccl_unique_id_b64": base64.b64encode(b"x" * 128).decode(), "master_address": "127.0.0.1",
         "master_port": 1, "rank_offset": 1, "world_size": 2},  # both modes
        {"nccl_unique_id_b64": base64.b64encode(b"x" * 127).decode(), "rank_offset": 1, "world_size": 2},
        {"nccl_unique_id_b64": base64.urlsafe_b64encode(b"\xfb\xff" * 64).decode(), "rank_offset": 1,
         "world_size": 2},  # URL-safe alphabet
    ],
)
def test_rendezvous_modes_refused_where_vllm_refuses_them(vllm_nccl_common, payload):
    with pytest.raises(ValueError):
        vllm_nccl_common.NCCLWeightTransferInitInfo(**payload)
    with pytest.raises(ValueError, match=r"init_info\.(master_address|master_port|nccl_unique_id_b64)|not both"):
        _cuda_engine().parse_init_info(payload)


def test_vllm_rendezvous_on_a_cpu_engine_is_refused_naming_why(vllm_nccl_engine):
    payload = vllm_nccl_engine.NCCLTrainerWeightTransferEngine._build_worker_init_payload(
        vllm_nccl_engine.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29513, world_size=2, rank=0))
    with pytest.raises(ValueError, match="vLLM's rendezvous .* needs a CUDA engine"):
        NCCLWeightTransferEngine(torch.device("cpu")).parse_init_info(payload)


def _vllm_update_dicts(vllm_nccl_engine):
    """What vLLM's NCCLTrainerWeightTransferEngine.send_weights posts: the metadata round, then an unchanged one."""
    full = vllm_nccl_engine.NCCLWeightTransferUpdateInfo(
        names=[n for n, _, _ in TENSORS], dtype_names=[str(d).split(".")[-1] for _, d, _ in TENSORS],
        shapes=[list(s) for _, _, s in TENSORS])
    return dataclasses.asdict(full), dataclasses.asdict(vllm_nccl_engine.NCCLWeightTransferUpdateInfo())


def _initialized(engine, payload):
    # init_transfer would join NCCL (issue #27); the parsed init_info is all plan_update reads besides the group.
    engine.info = engine.parse_init_info(payload)
    return engine


def test_vllm_dense_update_infos_plan_as_vllm_reads_them(vllm_nccl_engine):
    full, unchanged = _vllm_update_dicts(vllm_nccl_engine)
    assert unchanged == {"names": [], "dtype_names": [], "shapes": []}
    engine = _cuda_engine()
    payload = vllm_nccl_engine.NCCLTrainerWeightTransferEngine._build_worker_init_payload(
        vllm_nccl_engine.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29514, world_size=2, rank=0,
                                             packed_buffer_size_bytes=512))
    _initialized(engine, payload)
    parsed = parse_message(full, engine.update_info_type, "update_info")
    assert parsed.call_id is None
    expected = vllm_nccl_engine.NCCLWeightTransferUpdateInfo(**full)
    want = (expected.names, [getattr(torch, d) for d in expected.dtype_names], [tuple(s) for s in expected.shapes])
    # plan_update needs the group only to be there; an unchanged round repeats the metadata, as vLLM's worker does.
    engine.group = _Joined()
    for update in (full, unchanged, unchanged):
        plan = engine.parse_update_info(update)
        assert (plan.names, plan.dtypes, [tuple(s) for s in plan.shapes]) == want
        assert plan.group_sizes == [len(p.slots) for p in plan_nccl_packs(
            [torch.Size(s).numel() * d.itemsize for _, d, s in TENSORS], 512)]


class _Joined:
    """The state plan_update asks of a joined group: that it is not aborted."""

    aborted = False

    def close(self) -> None:
        pass


def test_vllm_sparse_update_info_plans_as_vllm_reads_it(vllm_sparse):
    update = dataclasses.asdict(vllm_sparse.SparseNCCLWeightTransferUpdateInfo(
        names=["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], dtype_names=["float32", "float16"],
        shapes=[[24, 8], [8]], num_updates_list=[5, 0]))
    payload = vllm_sparse.SparseNCCLTrainerWeightTransferEngine._build_worker_init_payload(
        vllm_sparse.SparseNCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29515, world_size=2, rank=0))
    engine = _initialized(_cuda_engine(SparseNCCLWeightTransferEngine), payload)
    engine.group = _Joined()
    plan = engine.parse_update_info(update)
    assert plan.vllm_wire and plan.nnz == [5, 0] and plan.dtypes == [torch.float32, torch.float16]
    specs = vllm_sparse_wire_specs(plan.names, plan.dtypes, plan.nnz)
    # vLLM's receiver posts, per patch, int32 indices then values of the tensor's dtype, each numel n.
    assert [(s.dtype, s.shape) for s in specs] == [(torch.int32, (5,)), (torch.float32, (5,)),
                                                   (torch.int32, (0,)), (torch.float16, (0,))]
    for bad, field in [({"num_updates_list": [5]}, "num_updates_list"),
                       ({"num_updates_list": [-1, 0]}, "num_updates_list"),
                       ({"num_updates_list": [193, 0]}, r"num_updates_list\[0\]")]:
        with pytest.raises(ValueError, match=field):
            engine.parse_update_info({**update, **bad})


# ---- our trainer -> vLLM's engine ---------------------------------------------------------------------


@pytest.mark.parametrize("wire", ["vllm", "rollout"])
def test_our_trainer_payloads_fit_vllm_dataclasses(vllm_nccl_common, vllm_nccl_engine, wire):
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=2, wire=wire,
                               packed_buffer_size_bytes=4096)
    trainer = NCCLTrainerWeightTransferEngine(info, None, None, 0)
    trainer.store = host_store("127.0.0.1", 0, 10.0)
    trainer.device, trainer.generation = torch.device("cuda" if wire == "vllm" else "cpu"), 0
    payload = trainer._engine_init_info()
    vllm_fields = {k: v for k, v in payload.items() if k not in OUR_INIT_EXTRAS}
    if wire == "vllm":
        assert payload == vllm_fields  # nothing a vLLM server would refuse
    else:
        assert set(payload) - set(vllm_fields) == OUR_INIT_EXTRAS
        with pytest.raises(TypeError):  # which is why wire="rollout" is for our engine only
            vllm_nccl_common.NCCLWeightTransferInitInfo(**payload)
    parsed = vllm_nccl_common.NCCLWeightTransferInitInfo(**vllm_fields)
    assert (parsed.master_port, parsed.rank_offset, parsed.world_size, parsed.packed,
            parsed.packed_buffer_size_bytes) == (trainer.store.port, 1, 2, True, 4096)
    update = dtype_names_list([n for n, _, _ in TENSORS], [d for _, d, _ in TENSORS], [s for _, _, s in TENSORS])
    vllm_update = vllm_nccl_engine.NCCLWeightTransferUpdateInfo(**update)
    assert [getattr(torch, d) for d in vllm_update.dtype_names] == [d for _, d, _ in TENSORS]


# ---- packing, byte for byte ---------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_size", [1, 200, 512, 1 << 20])
def test_our_packs_are_vllm_pack_tensors_byte_for_byte(vllm_import, buffer_size):
    packed_tensor = vllm_import("vllm.distributed.weight_transfer.packed_tensor")
    gen = torch.Generator().manual_seed(0)
    kinds = [(torch.bfloat16, (3, 5)), (torch.float32, (7,)), (torch.float16, (0,)), (torch.int8, (9,)),
             (torch.float32, (11, 4)), (torch.bfloat16, (1,)), (torch.float64, (6,))]  # odd sizes: unaligned offsets
    tensors = [(f"t{i}", (torch.randn(shape, generator=gen) * 10).to(dtype)) for i, (dtype, shape) in enumerate(kinds)]
    tensors.append(("transposed", torch.randn(4, 6, generator=gen).t()))  # not contiguous
    theirs = []
    it = iter(tensors)
    while (chunk := packed_tensor.pack_tensors(it, lambda item: item[1], buffer_size)) is not None:
        theirs.append((chunk.names, chunk.packed_tensor.numpy().tobytes()))
    plan = plan_nccl_packs([t.numel() * t.element_size() for _, t in tensors], buffer_size)
    ours = []
    for pack in plan:
        buffer = torch.full((pack.nbytes,), 0xAB, dtype=torch.uint8)
        for slot in pack.slots:
            copy_into(buffer, slot, tensors[slot.index][1])
        ours.append(([tensors[s.index][0] for s in pack.slots], buffer.numpy().tobytes()))
    assert ours == theirs
    # The receive side cuts the same chunks from metadata alone (vLLM's consumer loop, in its own words).
    sizes = [t.numel() * t.element_size() for _, t in tensors]
    consumer, current, used = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        used += size
        if used > buffer_size:
            consumer.append(current)
            current, used = [], 0
    consumer += [current] if current else []
    assert [[s.index for s in p.slots] for p in plan] == consumer


# ---- the rendezvous: the unique id in the store ----------------------------------------------------------


def _vllm_group(vllm_import, port: int, rank: int, world_size: int, out: list) -> threading.Thread:
    utils = vllm_import("vllm.distributed.utils")

    def run() -> None:
        try:
            out.append(utils.StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank,
                                                          world_size=world_size, store_timeout=20))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_reads_the_unique_id_vllm_trainer_publishes(vllm_import):
    wrapper = vllm_import("vllm.distributed.device_communicators.pynccl_wrapper")
    port = _free_port()
    out: list = []
    thread = _vllm_group(vllm_import, port, 0, 2, out)  # vLLM's rank 0 serves the store, waits for a client
    store = connect_store("127.0.0.1", port, 20.0, world_size=2)  # our engine worker, as init_transfer connects
    thread.join(20)
    (group,) = out
    uid = wrapper.ncclUniqueId()
    raw = os.urandom(128)
    for i, b in enumerate(raw):
        uid.internal[i] = b - 256 if b > 127 else b
    group.broadcast_obj(uid, src=0)  # what PyNcclCommunicator.__init__ does on rank 0
    assert vllm_nccl.read_unique_id(store, 10.0) == bytes(bytearray(uid.internal)) == raw


def test_vllm_worker_reads_the_unique_id_our_trainer_publishes(vllm_import):
    store = host_store("127.0.0.1", 0, 20.0)  # our trainer's rank 0, wire="vllm"
    raw = os.urandom(128)
    store.set(vllm_nccl.UNIQUE_ID_KEY, vllm_nccl.unique_id_pickle(raw))
    out: list = []
    # vLLM's worker as a client counted among the store's members; our trainer's store waits for no one.
    _vllm_group(vllm_import, store.port, 1, 2, out).join(20)
    (group,) = out
    uid = group.broadcast_obj(None, src=0)  # what PyNcclCommunicator.__init__ does on every other rank
    wrapper = vllm_import("vllm.distributed.device_communicators.pynccl_wrapper")
    assert type(uid) is wrapper.ncclUniqueId and bytes(bytearray(uid.internal)) == raw
    assert vllm_nccl.unique_id_from_pickle(vllm_nccl.unique_id_pickle(raw)) == raw


class _Reduce:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _hostile_pickles(tmp_path):
    marker = tmp_path / "pwned"
    return marker, [
        pickle.dumps(_Reduce(os.system, f"touch {marker}")),
        pickle.dumps(_Reduce(eval, f"open({str(marker)!r}, 'w')")),
        # The allowed ctypes hook, handed another class than vLLM's ncclUniqueId.
        b"\x80\x03c_ctypes\n_unpickle\ncos\nsystem\n}C\x80" + b"\x00" * 128 + b"\x86\x86R.",
        # vLLM's class and hook, but a nested reduce in the state.
        pickle.dumps(_Reduce(getattr, "x", "y")),
        pickle.dumps(("just", "a", "tuple")),
        b"\x80\x03c_ctypes\n_unpickle\ncvllm.distributed.device_communicators.pynccl_wrapper\nncclUniqueId\n}C\x10"
        + b"\x00" * 16 + b"\x86\x86R.",  # 16 bytes, not 128
    ]


def test_hostile_store_values_are_refused_without_running(tmp_path):
    store = host_store("127.0.0.1", 0, 10.0)
    client = connect_store("127.0.0.1", store.port, 10.0)
    marker, pickles = _hostile_pickles(tmp_path)
    for data in pickles:
        store.set(vllm_nccl.UNIQUE_ID_KEY, data)
        with pytest.raises(ValueError, match="NCCL unique id"):
            vllm_nccl.read_unique_id(client, 5.0)
    assert not marker.exists()


def test_no_unique_id_in_time_is_a_timeout_naming_the_key():
    store = host_store("127.0.0.1", 0, 10.0)
    with pytest.raises(TimeoutError, match="broadcast_from/0/0"):
        vllm_nccl.read_unique_id(connect_store("127.0.0.1", store.port, 10.0), 0.2)


def test_base64_mode_agrees_with_vllm_decoder(vllm_nccl_common):
    raw = os.urandom(128)
    text = vllm_nccl.encode_unique_id_b64(raw)
    assert vllm_nccl_common.decode_nccl_unique_id(master_address=None, master_port=None, nccl_unique_id_b64=text,
                                                  ctx="t") == raw == vllm_nccl.decode_unique_id_b64(text)


# ---- the server's backend choice ------------------------------------------------------------------------


def test_weight_transfer_config_is_vllms_and_picks_the_backend(vllm_import):
    vllm_config = vllm_import("vllm.config.weight_transfer")
    assert {f.name for f in dataclasses.fields(vllm_config.WeightTransferConfig)} == {"backend"}
    assert vllm_config.WeightTransferConfig().backend == "nccl"
    from rollout.server.app import _backend_check
    from rollout.server.config import ServerConfig

    for given, backend in [({"backend": "sparse_nccl"}, "sparse_nccl"), ({}, "nccl")]:
        config = ServerConfig(weight_transfer_config=given)
        assert config.weight_transfer_backend == backend
        arguments = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}}
        _backend_check(config)(arguments)
        assert arguments["init_info"]["backend"] == backend
        with pytest.raises(ValueError, match="init_info.backend: this server takes"):
            _backend_check(config)({"init_info": {"backend": "ipc"}})
    arguments = {"init_info": {"world_size": 2}}
    _backend_check(ServerConfig())(arguments)  # no flag: nccl, vLLM's default
    assert arguments["init_info"]["backend"] == "nccl"
    with pytest.raises(ValueError, match="contradicts"):
        ServerConfig(weight_transfer_backend="ipc", weight_transfer_config={"backend": "nccl"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['packed'\]"):
        ServerConfig(weight_transfer_config={"backend": "nccl", "packed": True})


def test_our_sparse_trainer_vllm_wire_fits_vllms_dataclass_and_our_engine(vllm_sparse):
    from weight_transfer.base import SparseWeightPatch
    from weight_transfer.sparse_nccl import vllm_sparse_call

    patch = SparseWeightPatch("w", torch.tensor([1, 4], dtype=torch.int32), torch.tensor([0.5, -2.0]), (2, 3))
    dense = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
    update_info, specs, patches = vllm_sparse_call([("w", patch), ("d", dense)])
    theirs = vllm_sparse.SparseNCCLWeightTransferUpdateInfo(**update_info)  # vLLM's own checks pass
    assert theirs.num_updates_list == [2, 6] and theirs.dtype_names == ["float32", "bfloat16"]
    assert [(s.dtype, s.shape) for s in specs] == [(torch.int32, (2,)), (torch.float32, (2,)),
                                                   (torch.int32, (6,)), (torch.bfloat16, (6,))]
    full = torch.zeros(6, dtype=torch.bfloat16)
    full[patches[1].indices.long()] = patches[1].values
    assert torch.equal(full.reshape(3, 2), dense)  # the dense tensor's patch rebuilds it exactly
    engine = _initialized(_cuda_engine(SparseNCCLWeightTransferEngine), {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2})
    engine.group = _Joined()
    assert engine.parse_update_info(update_info).nnz == [2, 6]


@pytest.mark.slow
def test_rollout_launch_takes_vllms_flag_and_payload(launch_server, tiny_checkpoint, vllm_nccl_engine):
    """A real `rollout launch --weight-transfer-config`: vLLM's init_info (no backend) reaches the nccl
    backend and its vLLM rendezvous, which a CPU engine refuses naming why (a 400, nothing changed);
    another backend than the flag's is refused as before."""
    import httpx

    server = launch_server(tiny_checkpoint("llama"), "--enable-rl-routes",
                           "--weight-transfer-config", '{"backend": "nccl"}')
    payload = vllm_nccl_engine.NCCLTrainerWeightTransferEngine._build_worker_init_payload(
        vllm_nccl_engine.NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29516, world_size=2, rank=0))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/init_weight_transfer_engine", json={"init_info": payload})
        assert r.status_code == 400 and "needs a CUDA engine" in r.text, r.text
        r = client.post("/init_weight_transfer_engine", json={"init_info": {**payload, "backend": "ipc"}})
        assert r.status_code == 400 and "this server takes weight_transfer_backend 'nccl'" in r.text, r.text
        bad = {**payload, "nccl_unique_id_b64": base64.b64encode(b"x" * 128).decode()}
        r = client.post("/init_weight_transfer_engine", json={"init_info": bad})
        assert r.status_code == 400 and "not both" in r.text, r.text
