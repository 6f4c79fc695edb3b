"""GPU tier: the sharded_rdt backend's BAKE and REPLAY with VRAM producer slots and VRAM receive buffers.

Moved from tests/weights/test_sharded_rdt_backend.py (the host-memory cases stay there); `InProcessPair`
and `_replay_in_process` are that module's, reached through tests/gpu/conftest.py's sys.path.
"""

from __future__ import annotations

import threading

import pytest
import torch

# Real NIXL or nothing: its wheel (nixl_cu12, 68 MB) is larger than what a GPU run may carry here.
pytest.importorskip("nixl", reason="NIXL is not installed")

from test_sharded_rdt_backend import InProcessPair, _replay_in_process  # noqa: E402


@pytest.mark.gpu
def test_replay_between_vram_slots_and_vram_receive_buffers():
    gen = torch.Generator().manual_seed(2)
    tensors = {f"model.layers.{i}.w": torch.randn(64, 32, generator=gen).to(torch.bfloat16) for i in range(3)}
    received, bytes_read, stats = _replay_in_process(tensors, None, num_slots=1, device="cuda")
    assert all(received[n].is_cuda and torch.equal(received[n].cpu(), t) for n, t in tensors.items())
    assert bytes_read == 3 * 64 * 32 * 2 and stats["max_groups_held"] == 1


@pytest.mark.gpu
def test_a_receive_buffer_is_read_into_only_after_the_kernels_landing_its_last_pack_ran():
    """The consumer's copies out of a view are queued behind a long kernel; NIXL's READ of a later pack into the
    same buffer (it bypasses torch's streams) must still wait for them, or the copies see the later pack."""
    tensors = {f"model.layers.{i}.w": torch.full((64, 32), float(i), dtype=torch.bfloat16) for i in range(8)}
    pair = InProcessPair(tensors, None, num_slots=2, device="cuda")
    thread = threading.Thread(target=lambda: (pair.publish(), pair.producer.wait_drained(pair.SYNC_ID)))
    thread.start()
    received = {}
    for name, view in pair.consumer.receive_weights(pair.info):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of the copy out of the view
        received[name] = view.clone()
    thread.join()
    pair.close()
    assert len(pair.consumer._recv) < len(tensors)  # buffers are reused: the race is possible
    for name, t in tensors.items():
        assert torch.equal(received[name].cpu(), t), name
