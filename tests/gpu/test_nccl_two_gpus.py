"""GPU tier: the nccl backend over real NCCL between two GPUs (the engine side in its own process), then a dead peer.

Moved from tests/weights/test_nccl_backend.py (its CPU tests over gloo stay there); `_info` and
`_HookedSource` are that module's, reached through tests/gpu/conftest.py's sys.path.
"""

from __future__ import annotations

import threading

import pytest
import torch

from weight_transfer.clients import WeightSyncClient, WeightSyncError
from weight_transfer.nccl import NCCLTrainerWeightTransferEngine, NCCLWeightTransferEngine
from weight_transfer.process_group import WeightSyncTransportError

from test_nccl_backend import _HookedSource, _info


def _engine_process(conn, device: str) -> None:
    """An engine worker's NCCLWeightTransferEngine in its own process, driven over a pipe; lands into a dict."""
    from weight_transfer.checksums import tensor_checksum

    engine = NCCLWeightTransferEngine(torch.device(device))
    landed: dict[str, torch.Tensor] = {}
    while True:
        method, args = conn.recv()
        try:
            result = None
            if method == "init_weight_transfer_engine":
                engine.init_transfer(engine.parse_init_info(args[0]))
            elif method == "update_weights":
                for name, tensor in engine.receive_weights(engine.parse_update_info(args[0])):
                    landed[name] = tensor.clone()
            elif method == "checksums":
                result = {name: tensor_checksum(t) for name, t in landed.items()}
            elif method == "shutdown_weight_transfer_engine":
                engine.shutdown()
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _PipeClient(WeightSyncClient):
    """Drives _engine_process; one call at a time."""

    def __init__(self, conn) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def _call(self, method: str, *args):
        if method == "get_world_size":
            return 1
        if method in ("start_weight_update", "finish_weight_update", "abort_weight_update"):
            return None
        with self.lock:
            try:
                self.conn.send((method, args))
                status, value = self.conn.recv()
            except (EOFError, OSError) as e:
                raise WeightSyncError(f"{method}: the engine process is gone ({type(e).__name__})") from e
        if status == "error":
            raise WeightSyncError(value)
        return value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_between_two_gpus_then_a_dead_peer():
    import multiprocessing

    from weight_transfer.checksums import tensor_checksum

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_engine_process, args=(there, "cuda:1"), daemon=True)
    proc.start()
    client = _PipeClient(here)
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    weights = {f"layers.{i}.w": torch.randn(512, 1024 + i, generator=gen, device="cuda:0").to(torch.bfloat16)
               for i in range(16)}
    weights["embed"] = torch.randn(4096, 1024, generator=gen, device="cuda:0")  # 16 MiB: more than a buffer
    try:
        for packed in (True, False):
            for t in weights.values():
                t.mul_(-1)
            info = _info(packed=packed, packed_buffer_size_bytes=4 << 20, timeout_s=30.0)
            trainer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=weights)
            assert trainer.device == torch.device("cuda", 0)
            assert trainer.send_weights(weight_version="v1").num_tensors == len(weights)
            assert client._call("checksums") == {n: tensor_checksum(t) for n, t in weights.items()}
            trainer.shutdown()

        # The engine process dies mid-sync: NCCL does not say so, the trainer's bounded waits do.
        info = _info(packed_buffer_size_bytes=4 << 20, timeout_s=5.0)
        trainer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=weights)
        with pytest.raises((TimeoutError, WeightSyncTransportError, WeightSyncError)):
            trainer.send_weights(_HookedSource(weights, at=6, hook=proc.kill), weight_version="v2")
        assert trainer.group.aborted
    finally:
        proc.kill()
        proc.join(10)
