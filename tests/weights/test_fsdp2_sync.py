"""FSDP2 trainers: a 2-rank gloo trainer with a fully_shard'ed HF model syncs into a real server, gathering one tensor at a time."""

from __future__ import annotations

import json
import os
import socket
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from weight_transfer.base import ModuleSource, WeightSource

from sync_helpers import assert_engine_serves, trainer_model

pytestmark = pytest.mark.slow

BUCKET_BYTES = 256 << 10  # larger than any tensor of the tiny model (128 KiB), half the model (~0.55 MB)


class PeakTrackingSource(WeightSource):
    """Wraps a source and records the peak bytes of yielded tensors whose storage is still alive (what the sender holds).

    Storage, not the tensor object: a sender that keeps a view or a detached alias keeps the memory.
    """

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner
        self.live = 0
        self.peak = 0
        self.largest = 0

    def _metadata(self):
        return self.inner.metadata

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def iter_full(self):
        for name, tensor in self.inner.iter_full():
            nbytes = tensor.numel() * tensor.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, nbytes)
            weakref.finalize(tensor.untyped_storage(), self._freed, nbytes)
            yield name, tensor
            del tensor

    def iter_local(self):
        return self.inner.iter_local()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_info(backend: str, nccl_port: int):
    if backend == "local":
        from weight_transfer.local import LocalTrainerInitInfo

        return LocalTrainerInitInfo(encoding="b64", max_bytes_per_call=BUCKET_BYTES)
    from weight_transfer.nccl import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=nccl_port, world_size=2, packed=True,
                               packed_buffer_size_bytes=BUCKET_BYTES, packed_num_buffers=2, timeout_s=60)


def _rank_main(rank: int, url: str, path: str, backend: str, ports: tuple[int, int], out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weight_transfer import trainer_init
    from weight_transfer.clients import HTTPWeightSyncClient

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = trainer_model(path)  # same seed on both ranks: identical full weights
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    source = PeakTrackingSource(ModuleSource(model))
    client = HTTPWeightSyncClient(url) if rank == 0 else None
    engine = trainer_init(_init_info(backend, ports[1]), client=client, source=source)
    stats = engine.send_weights(weight_version="fsdp-1")
    engine.shutdown()
    report = {"rank": rank, "peak": source.peak, "largest": source.largest, "num_tensors": stats.num_tensors,
              "metadata_names": [m.name for m in source.metadata],
              "placements": sorted({p for m in source.metadata for p in m.placements})}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["local", "nccl"])
def test_fully_sharded_trainer_syncs_with_bounded_memory(launch_server, tiny_checkpoint, tmp_path, backend):
    path = tiny_checkpoint("llama")
    server = launch_server(path, "--enable-rl-routes")
    ports = (_free_port(), _free_port())
    mp.start_processes(_rank_main, args=(server.url, path, backend, ports, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # metadata is identical on every rank, and it describes sharded parameters
    assert reports[0]["metadata_names"] == reports[1]["metadata_names"]
    assert any(p.startswith("Shard") for p in reports[0]["placements"])
    # the sender never held more than one bucket of gathered tensors
    assert reports[0]["largest"] <= BUCKET_BYTES
    assert reports[0]["peak"] <= BUCKET_BYTES, reports[0]
    assert reports[0]["num_tensors"] == len(reports[0]["metadata_names"])
    assert_engine_serves(server.url, trainer_model(path), weight_version="fsdp-1")
