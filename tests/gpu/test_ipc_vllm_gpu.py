"""GPU tier: vLLM's shape of the ipc backend over real CUDA IPC - this process is the trainer, an EngineCore process
on the same GPU receives, and the engine's checksums equal the trainer's after each sync.

Two producers of vLLM's payload: our trainer with wire "vllm" / "vllm_packed", and vLLM 0.33's own IPC
trainer code (reduce_tensor per tensor, or its packed_ipc_producer, then IPCWeightTransferUpdateInfo and its
HTTP client's _json_safe_update_info), the latter when the compat tier's vLLM build is there (`make vllm033`).
Either way the handles arrive pickled (ipc_handles_pickled), so the engine is started with
weight_transfer_allow_pickled_ipc_handles; one more test checks that without it the same sync is refused
and the previous weights serve.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.worker import RolloutWorker
from weight_transfer.base import ModuleSource, trainer_init
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.clients import LocalWeightSyncClient, WeightSyncError
from weight_transfer.ipc import IPCTrainerInitInfo

from test_ipc_gpu import _trainer_model as ipc_trainer_model  # tests/gpu: one way to make a changed trainer model

pytestmark = pytest.mark.gpu

BUFFER = 32 << 10  # several packed calls for the tiny llama; its embedding / lm_head (64 KiB bf16) need a larger one
PACKED_BUFFER = 128 << 10


class IPCClient(LocalWeightSyncClient):
    """The worker's calls, with init_info naming the ipc backend: vLLM's init_info ({"packed"}) names none,
    its server picks the backend (--weight-transfer-config); this stands in for that choice."""

    def _call(self, method, *args):
        if method == "init_weight_transfer_engine":
            args = ({**args[0], "backend": "ipc"}, *args[1:])
        return super()._call(method, *args)


def _worker(checkpoint: str, allow: bool) -> RolloutWorker:
    return RolloutWorker(checkpoint, multiprocess=True, device="cuda", dtype="bfloat16", max_model_len=128,
                         kv_cache_memory_bytes=1 << 26, weight_transfer_allow_pickled_ipc_handles=allow)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def worker(checkpoint):
    """A bf16 engine in its own process on cuda:0, the GPU this process trains on, reading pickled ipc handles."""
    worker = _worker(checkpoint, allow=True)
    yield worker
    worker.shutdown()


def _trainer_model(path: str, seed: int) -> torch.nn.Module:
    """bf16 weights on the GPU, every parameter changed (deterministically by seed): test_ipc_gpu's, in bf16."""
    return ipc_trainer_model(path, seed, torch.bfloat16)


def _engine_has(worker: RolloutWorker, model: torch.nn.Module) -> bool:
    return worker.weight_checker(hf_state_checksums(model.state_dict(), dtype=torch.bfloat16))["match"]


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("wire", ["vllm", "vllm_packed"])
def test_our_trainer_in_vllms_shape_lands_with_equal_checksums(worker, checkpoint, wire):
    model = _trainer_model(checkpoint, seed=31)
    baseline = _allocated()
    size = PACKED_BUFFER if wire == "vllm_packed" else BUFFER
    engine = trainer_init(IPCTrainerInitInfo(wire=wire, packed_buffer_size_bytes=size, timeout_s=60),
                          client=IPCClient(worker), source=ModuleSource(model))
    try:
        first = engine.send_weights(weight_version=f"{wire}-1")
        assert _engine_has(worker, model) and worker.get_weight_version() == f"{wire}-1"
        if wire == "vllm_packed":
            assert first.extra["num_calls"] >= 2  # the buffer reused across calls of one sync
        with torch.no_grad():  # the next training step
            for p in model.parameters():
                p.mul_(-0.5)
        engine.send_weights(weight_version=f"{wire}-2")
        assert _engine_has(worker, model)
    finally:
        engine.shutdown()
    # The engine closed what it opened at finish, so nothing exported waits in limbo.
    assert _allocated() == baseline


def test_vllms_own_trainer_code_lands_with_equal_checksums(worker, checkpoint):
    from compat.vllm_modules import import_vllm, unavailable_reason

    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    vllm_ipc = import_vllm("vllm.distributed.weight_transfer.ipc_engine")
    vllm_packed = import_vllm("vllm.distributed.weight_transfer.packed_tensor")
    vllm_clients = import_vllm("vllm.distributed.weight_transfer.clients")
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    client = IPCClient(worker)

    def post(**fields):
        info = vllm_ipc.IPCWeightTransferUpdateInfo(**fields)
        client.update_weights(vllm_clients._json_safe_update_info(dataclasses.asdict(info)))

    for packed, seed in ((False, 41), (True, 42)):
        model = _trainer_model(checkpoint, seed=seed)
        client.init_weight_transfer_engine({"packed": packed})
        client.start_weight_update()
        if packed:
            for chunk in vllm_packed.packed_ipc_producer(ModuleSource(model).iter_full(), uuid, lambda item: item[1],
                                                         buffer_size_bytes=PACKED_BUFFER):
                post(names=chunk.names, dtype_names=chunk.dtype_names, shapes=chunk.shapes,
                     ipc_handles=chunk.ipc_handle, tensor_sizes=chunk.tensor_sizes)
        else:
            held, names, dtype_names, shapes, handles = [], [], [], [], []
            for name, tensor in ModuleSource(model).iter_full():
                weight = tensor.detach().contiguous()
                held.append(weight)
                names.append(name)
                dtype_names.append(str(weight.dtype).split(".")[-1])
                shapes.append(list(weight.shape))
                handles.append({uuid: reduce_tensor(weight)[1]})
            post(names=names, dtype_names=dtype_names, shapes=shapes, ipc_handles=handles)
        client.finish_weight_update(f"vllm-trainer-{packed}")
        assert _engine_has(worker, model)
    torch.cuda.ipc_collect()


def test_without_the_flag_the_pickled_sync_is_refused_and_the_old_weights_serve(checkpoint):
    worker = _worker(checkpoint, allow=False)
    try:
        model = _trainer_model(checkpoint, seed=51)
        engine = trainer_init(IPCTrainerInitInfo(wire="vllm", timeout_s=60), client=IPCClient(worker),
                              source=ModuleSource(model))
        try:
            with pytest.raises((ValueError, WeightSyncError, RuntimeError),
                               match="weight-transfer-allow-pickled-ipc-handles"):
                engine.send_weights(weight_version="refused")
        finally:
            engine.shutdown()
        assert worker.weight_checker(hf_state_checksums(_reference(checkpoint), dtype=torch.bfloat16))["match"]
    finally:
        worker.shutdown()


def _reference(checkpoint: str) -> dict:
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
