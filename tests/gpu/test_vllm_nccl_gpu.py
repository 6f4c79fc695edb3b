"""weight_transfer.vllm_nccl's NCCL group on one GPU: the ctypes bindings, the warm-up, broadcasts through
process_group's packed and unpacked paths, abort and close. One GPU holds one rank (NCCL refuses two ranks
on one device), so this is a world of one; the two-GPU run against vLLM's own trainer is issue #27."""

from __future__ import annotations

import pytest
import torch

from weight_transfer import vllm_nccl
from weight_transfer.process_group import TransferSettings, WeightSyncTransportError, WireSpec, send_items

pytestmark = pytest.mark.gpu


def _group(**kwargs):
    uid = vllm_nccl.get_unique_id()
    assert len(uid) == vllm_nccl.UNIQUE_ID_BYTES and uid != bytes(128)
    return vllm_nccl.VllmNcclGroup(uid, rank=0, world_size=1, device=torch.device("cuda", 0), timeout_s=30.0, **kwargs)


def test_unique_id_round_trips_through_vllms_pickle_and_base64():
    uid = vllm_nccl.get_unique_id()
    assert vllm_nccl.unique_id_from_pickle(vllm_nccl.unique_id_pickle(uid)) == uid
    assert vllm_nccl.decode_unique_id_b64(vllm_nccl.encode_unique_id_b64(uid)) == uid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8,
                                   torch.float8_e4m3fn])
def test_broadcast_of_every_dtype_completes_and_keeps_the_bytes(dtype):
    group = _group()
    try:
        tensor = (torch.arange(4096, device="cuda") % 100).to(dtype)
        before = tensor.clone()
        work = group.broadcast(tensor)
        group.wait(work, "broadcast")
        assert torch.equal(tensor.view(torch.uint8), before.view(torch.uint8))
    finally:
        group.close()


@pytest.mark.parametrize("packed", [True, False])
def test_send_items_runs_on_the_group(packed):
    group = _group()
    try:
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randn(n, 7, generator=gen).to(d) for n, d in
                   [(3, torch.bfloat16), (5, torch.float32), (0, torch.float32), (9, torch.float16)]]
        specs = [WireSpec(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
        sent = send_items(group, specs, iter(t.cuda() for t in tensors), TransferSettings(packed, 64, 2))
        assert sent == sum(t.numel() * t.element_size() for t in tensors)
    finally:
        group.close()


def test_abort_refuses_further_broadcasts():
    group = _group()
    group.abort()
    assert group.aborted
    with pytest.raises(WeightSyncTransportError, match="aborted"):
        group.broadcast(torch.zeros(4, device="cuda"))
    group.close()  # after abort: nothing left to destroy
