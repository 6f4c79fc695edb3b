"""The ipc backend's wire against vLLM 0.33's own code, both ways (CPU: the handles are torch's reduce_tensor
layout with made-up bytes, so everything runs except mapping CUDA memory).

- vLLM's trainer -> our engine: the dicts vLLM's IPC trainer builds (its IPCWeightTransferInitInfo /
  IPCWeightTransferUpdateInfo, asdict, then its HTTP client's _json_safe_update_info) are parsed by our
  engine side as vLLM's worker parses them, refused without our flag as vLLM refuses them without
  VLLM_ALLOW_INSECURE_SERIALIZATION=1.
- vLLM's HTTPVLLMWeightSyncClient against `rollout launch --weight-transfer-config '{"backend": "ipc"}'`:
  its init and start are accepted; its update (handles pickled by the client itself) is a 400 naming our
  flag, or with the flag gets as far as needing CUDA.
- our trainer -> vLLM's engine: what our trainer sends with wire "vllm" / "vllm_packed" (ipc_vllm.init_info_of,
  ipc_vllm.update_info) is accepted by vLLM's own IPCWeightTransferInitInfo / IPCWeightTransferUpdateInfo,
  and vLLM reads back the very handles we put in.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weight_transfer import ipc_vllm
from weight_transfer.ipc import IPCWeightTransferEngine

UUID = "GPU-3b4c5d6e-0000-1111-2222-333344445555"
CPU_END = "this worker runs on cpu"  # where a well-formed call stops on a CPU worker: everything before it ran
FLAG = "--weight-transfer-allow-pickled-ipc-handles"
TENSORS = [("model.embed_tokens.weight", torch.bfloat16, (16, 8)), ("model.norm.weight", torch.float32, (8,))]


def rebuild_args(dtype, shape) -> tuple:
    """rebuild_cuda_tensor's arguments in reduce_tensor's layout (made-up handle bytes)."""
    size = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    return (torch.Tensor, size, stride, 0, torch.storage.TypedStorage, dtype, 0, b"\x11" * 64,
            size.numel() * dtype.itemsize, 0, False, b"/torch_1_2_0", 0, b"\x22" * 64, True)


@pytest.fixture(scope="module")
def vllm_ipc(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.ipc_engine")


@pytest.fixture(scope="module")
def vllm_clients(vllm_import):
    return vllm_import("vllm.distributed.weight_transfer.clients")


def our_engine(init_info: dict, allow: bool) -> IPCWeightTransferEngine:
    engine = IPCWeightTransferEngine(torch.device("cpu"))
    engine.allow_pickled_ipc_handles = allow
    engine.init_transfer(engine.parse_init_info(init_info))
    return engine


def vllm_unpacked_payload(vllm_ipc, vllm_clients) -> dict:
    """What vLLM's IPCTrainerWeightTransferEngine._send_unpacked posts over HTTP (its _do_send, then the client)."""
    info = vllm_ipc.IPCWeightTransferUpdateInfo(
        names=[n for n, _, _ in TENSORS], dtype_names=[str(d).split(".")[-1] for _, d, _ in TENSORS],
        shapes=[list(s) for _, _, s in TENSORS], ipc_handles=[{UUID: rebuild_args(d, s)} for _, d, s in TENSORS])
    return vllm_clients._json_safe_update_info(dataclasses.asdict(info))


def vllm_packed_payload(vllm_ipc, vllm_clients) -> dict:
    """vLLM's packed_ipc_producer chunk for TENSORS in a 1 KiB buffer, as _send_packed posts it."""
    sizes = [torch.Size(s).numel() * d.itemsize for _, d, s in TENSORS]
    info = vllm_ipc.IPCWeightTransferUpdateInfo(
        names=[n for n, _, _ in TENSORS], dtype_names=[str(d).split(".")[-1] for _, d, _ in TENSORS],
        shapes=[list(s) for _, _, s in TENSORS], ipc_handles={UUID: rebuild_args(torch.uint8, (1024,))},
        tensor_sizes=sizes)
    return vllm_clients._json_safe_update_info(dataclasses.asdict(info))


# ---- vLLM's trainer -> our engine ----------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
def test_vllm_init_info_is_ours_to_read(vllm_ipc, packed):
    # What vLLM's IPCTrainerWeightTransferEngine.trainer_init posts (init_weight_transfer_engine):
    sent = {"packed": vllm_ipc.IPCTrainerInitInfo(rank=0, packed=packed).packed}
    assert sent == dataclasses.asdict(vllm_ipc.IPCWeightTransferInitInfo(packed=packed))
    parsed = IPCWeightTransferEngine(torch.device("cpu")).parse_init_info(sent)
    assert isinstance(parsed, ipc_vllm.VLLMIPCInitInfo) and parsed.packed is packed


@pytest.mark.parametrize("packed", [False, True])
def test_vllm_update_info_is_parsed_as_vllm_parses_it(vllm_ipc, vllm_clients, monkeypatch, packed):
    payload = (vllm_packed_payload if packed else vllm_unpacked_payload)(vllm_ipc, vllm_clients)
    assert "ipc_handles_pickled" in payload and "ipc_handles" not in payload  # what crosses HTTP
    # Refused by default, as vLLM refuses it without its switch.
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        vllm_ipc.IPCWeightTransferUpdateInfo(**payload)
    with pytest.raises(ValueError, match=f"update_info.ipc_handles_pickled: .*{FLAG}"):
        our_engine({"packed": packed}, allow=False).parse_update_info(payload)
    # Opted in: vLLM's worker unpickles to these handles; ours reads the same, through the allow-list.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    theirs = vllm_ipc.IPCWeightTransferUpdateInfo(**payload)
    ours = ipc_vllm.decode_pickled(payload["ipc_handles_pickled"], allowed=True)
    if packed:
        assert ipc_vllm.check_args(ours[UUID], "x").args == tuple(theirs.ipc_handles[UUID])
    else:
        assert [ipc_vllm.check_args(h[UUID], "x").args for h in ours] == [tuple(h[UUID]) for h in theirs.ipc_handles]
    with pytest.raises(ValueError, match=CPU_END):
        our_engine({"packed": packed}, allow=True).parse_update_info(payload)


def test_vllm_payload_with_a_mismatched_field_is_refused_like_vllm_refuses_it(vllm_ipc, vllm_clients, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    payload = vllm_unpacked_payload(vllm_ipc, vllm_clients)
    payload["shapes"] = payload["shapes"][:1]
    with pytest.raises(ValueError, match="shapes"):
        vllm_ipc.IPCWeightTransferUpdateInfo(**payload)
    with pytest.raises(ValueError, match=r"update_info.shapes: 1 entries for 2 names"):
        our_engine({"packed": False}, allow=True).parse_update_info(payload)


@pytest.fixture(scope="module")
def ipc_servers(launch_server, tiny_checkpoint):
    args = (tiny_checkpoint("llama"), "--enable-rl-routes", "--weight-transfer-config", '{"backend": "ipc"}')
    return {"default": launch_server(*args), "allowed": launch_server(*args, FLAG)}


@pytest.mark.parametrize("server", ["default", "allowed"])
def test_vllms_http_client_drives_rollout_launch_up_to_needing_cuda(vllm_ipc, vllm_clients, ipc_servers, server):
    import requests

    client = vllm_clients.HTTPVLLMWeightSyncClient(ipc_servers[server].url, timeout=60)
    client.init_weight_transfer_engine({"packed": False})  # as IPCTrainerWeightTransferEngine.trainer_init
    client.start_weight_update()
    info = vllm_ipc.IPCWeightTransferUpdateInfo(  # as _do_send: raw handles, the client pickles them
        names=["model.norm.weight"], dtype_names=["float32"], shapes=[[64]],
        ipc_handles=[{UUID: rebuild_args(torch.float32, (64,))}])
    try:
        with pytest.raises(requests.HTTPError) as e:
            client.update_weights(dataclasses.asdict(info))
    finally:
        requests.post(f"{ipc_servers[server].url}/abort_weight_update", timeout=60)
    assert e.value.response.status_code == 400
    message = e.value.response.json()["error"]["message"]
    assert (FLAG in message) if server == "default" else (CPU_END in message), message
    client.shutdown_weight_transfer_engine()


# ---- our trainer -> vLLM's engine -------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
def test_our_init_info_is_vllms(vllm_ipc, packed):
    ours = ipc_vllm.init_info_of(packed)
    assert dataclasses.asdict(vllm_ipc.IPCWeightTransferInitInfo(**ours)) == ours


@pytest.mark.parametrize("pickled", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_our_update_info_is_accepted_by_vllms_dataclass(vllm_ipc, monkeypatch, packed, pickled):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    names, dtypes, shapes = [n for n, _, _ in TENSORS], [d for _, d, _ in TENSORS], [list(s) for _, _, s in TENSORS]
    if packed:
        handles = {UUID: rebuild_args(torch.uint8, (1024,))}
        sizes = [torch.Size(s).numel() * d.itemsize for d, s in zip(dtypes, shapes)]
    else:
        handles, sizes = [{UUID: rebuild_args(d, s)} for d, s in zip(dtypes, shapes)], None
    payload = ipc_vllm.update_info(names, dtypes, shapes, handles, sizes, pickled=pickled)
    theirs = vllm_ipc.IPCWeightTransferUpdateInfo(**payload)
    assert (theirs.names, theirs.dtype_names, theirs.shapes, theirs.tensor_sizes) == (
        names, ["bfloat16", "float32"], shapes, sizes)
    assert theirs.ipc_handles == handles
    # vLLM's worker turns dtype_names back into dtypes by getattr(torch, name): ours are names it knows.
    assert [getattr(torch, n) for n in theirs.dtype_names] == dtypes
