"""The sparse_nccl backend and the DeltaTracker: exact bitwise patches, refused bad patches, syncs into a server."""

from __future__ import annotations

import re
import threading

import httpx
import pytest
import torch

from weight_transfer.base import ModuleSource, SparseWeightPatch, trainer_init
from weight_transfer.clients import HTTPWeightSyncClient
from weight_transfer.delta import DeltaTracker, bitwise_patch
from weight_transfer.process_group import (
    StoreKeys,
    TransferSettings,
    WeightSyncGroup,
    host_store,
    send_items,
    wait_for_keys,
)
from weight_transfer.sparse_nccl import (
    SparseNCCLTrainerInitInfo,
    SparseNCCLTrainerWeightTransferEngine,
    SparseNCCLWeightTransferEngine,
    sparse_wire_specs,
)

from sync_helpers import assert_engine_serves, trainer_model

TIMEOUT_S = 20.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _apply(old: torch.Tensor, patch: SparseWeightPatch) -> torch.Tensor:
    out = old.clone()
    out.view(-1)[patch.indices.long()] = patch.values
    return out


# ---------------------------------------------------------------------------------------
# DeltaTracker


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_patches_reproduce_the_new_tensor_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    tracker = DeltaTracker()
    old = torch.randn(30, 40, generator=gen).to(dtype)
    first = tracker.diff("w", old)
    assert isinstance(first, torch.Tensor) and torch.equal(first, old)  # no snapshot yet: dense
    tracker.commit()
    new = old.clone()
    changed = torch.randperm(new.numel(), generator=gen)[:12]
    new.view(-1)[changed] += 1.0
    patch = tracker.diff("w", new)
    assert isinstance(patch, SparseWeightPatch) and patch.indices.dtype == torch.int32
    assert sorted(patch.indices.tolist()) == sorted(changed.tolist())
    patch.validate(dtype)
    assert torch.equal(_bits(_apply(old, patch)), _bits(new))


def test_raw_bits_decide_what_changed():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    new = old.clone()
    new[0] = -0.0  # equal as numbers, different bits
    new_bits = new.view(torch.int32)
    new_bits[2] = new_bits[2] ^ 1  # another NaN payload
    patch = bitwise_patch("w", old, new)
    assert patch.indices.tolist() == [0, 2]
    assert bitwise_patch("w", old, old.clone()).indices.numel() == 0


def test_dense_fallbacks():
    gen = torch.Generator().manual_seed(1)
    tracker = DeltaTracker(max_changed_fraction=0.5)
    base = {"f32": torch.randn(100, generator=gen), "bf16": torch.randn(100, generator=gen).to(torch.bfloat16),
            "int": torch.arange(100), "reshaped": torch.randn(10, 10, generator=gen)}
    for name, t in base.items():
        tracker.diff(name, t)
    tracker.commit()
    f32 = base["f32"].clone()
    f32[:60] += 1  # 60% changed: above max_changed_fraction
    assert isinstance(tracker.diff("f32", f32), torch.Tensor)
    bf16 = base["bf16"].clone()
    bf16[:40] += 1  # 40%: under the fraction, but 40 x (4 + 2) bytes >= 100 x 2 bytes
    assert isinstance(tracker.diff("bf16", bf16), torch.Tensor)
    assert isinstance(tracker.diff("int", base["int"] + 1), torch.Tensor)  # not a floating dtype
    assert isinstance(tracker.diff("reshaped", base["reshaped"].reshape(100)), torch.Tensor)  # new shape
    small = base["f32"].clone()
    small[:5] += 1
    assert isinstance(tracker.diff("f32", small), SparseWeightPatch)


def test_snapshot_advances_only_on_commit_and_is_a_copy():
    tracker = DeltaTracker()
    weight = torch.zeros(50)
    tracker.diff("w", weight)
    tracker.commit()
    weight[3] = 1.0  # the trainer changes its tensor in place: the snapshot must not follow
    first = tracker.diff("w", weight)
    assert first.indices.tolist() == [3]
    tracker.discard()  # that sync failed: the engine still holds zeros
    weight[7] = 2.0
    again = tracker.diff("w", weight)
    assert again.indices.tolist() == [3, 7]
    tracker.commit()
    assert tracker.diff("w", weight).indices.numel() == 0
    tracker.reset()
    assert isinstance(tracker.diff("w", weight), torch.Tensor) and not tracker.has_snapshot("w")


@pytest.mark.parametrize(
    "kwargs,field",
    [({"max_changed_fraction": 1.5}, "max_changed_fraction"), ({"snapshot_device": "nowhere"}, "snapshot_device")],
)
def test_bad_tracker_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DeltaTracker(**kwargs)
    with pytest.raises(ValueError, match=field):
        SparseNCCLTrainerInitInfo("127.0.0.1", 0, 2, **kwargs)


# ---------------------------------------------------------------------------------------
# The wire layout and the engine's checks


def test_wire_puts_the_patch_section_first():
    specs = sparse_wire_specs(
        ["a", "b", "c", "d"], [torch.float32, torch.bfloat16, torch.float32, torch.float32],
        [(4, 5), (3,), (6,), (2, 2)], [3, 2, None, 4],
    )
    assert [(s.label, s.dtype, s.shape) for s in specs] == [
        ("patch indices", torch.int32, (9,)),
        ("patch values (float32)", torch.float32, (7,)),
        ("patch values (bfloat16)", torch.bfloat16, (2,)),
        ("c", torch.float32, (6,)),
    ]
    assert sparse_wire_specs(["c"], [torch.float32], [(6,)], [None])[0].label == "c"


def _update_info(nnz, dtype="float32", call_id=1):
    return {"names": ["a", "w"], "dtype_names": ["float32", dtype], "shapes": [[3], [4, 5]], "nnz": [None, nnz],
            "call_id": call_id}


@pytest.mark.parametrize(
    "update_info,field",
    [
        ({**_update_info(2), "nnz": [None]}, "update_info.nnz: expected a list with one entry per tensor"),
        (_update_info(21), r"update_info.nnz\[1\] \('w'\)"),
        (_update_info(-1), r"update_info.nnz\[1\] \('w'\)"),
        (_update_info(2, dtype="int32"), r"update_info.nnz\[1\] \('w'\): a patch needs a floating-point dtype"),
    ],
)
def test_engine_parse_update_info_names_the_bad_field(update_info, field):
    engine = SparseNCCLWeightTransferEngine(torch.device("cpu"))
    engine.info = engine.parse_init_info({"backend": "sparse_nccl", "master_address": "127.0.0.1", "master_port": 1,
                                          "world_size": 2, "group_generation": 0})  # as init_transfer keeps it
    with pytest.raises(ValueError, match=field):
        engine.parse_update_info(update_info)


@pytest.fixture
def engine_and_sender():
    """A SparseNCCLWeightTransferEngine joined to a sender group, both in this process (the trainer's part by hand)."""
    store = host_store("127.0.0.1", 0, 10.0)
    engine = SparseNCCLWeightTransferEngine(torch.device("cpu"))
    init_info = {"backend": "sparse_nccl", "master_address": "127.0.0.1", "master_port": store.port, "world_size": 2,
                 "device_type": "cpu", "packed": True, "packed_buffer_size_bytes": 4096, "timeout_s": 10.0,
                 "group_generation": 0}
    joining = threading.Thread(target=lambda: engine.init_transfer(engine.parse_init_info(init_info)))
    joining.start()
    sender = WeightSyncGroup(store, prefix=StoreKeys(0).group, rank=0, world_size=2, device=torch.device("cpu"),
                             timeout_s=10.0, address="127.0.0.1")
    joining.join()
    yield engine, sender, store
    engine.shutdown()
    sender.close()


@pytest.mark.parametrize(
    "indices,values,message",
    [
        ([0, 20], [1.0, 2.0], r"sparse patch 'w': indices out of range \[0, 20\)"),
        ([3, 3], [1.0, 2.0], "sparse patch 'w': indices are not unique"),
        ([1, 2], [float("nan"), 2.0], "sparse patch 'w': values contain NaN"),
    ],
)
def test_engine_refuses_a_bad_patch_before_yielding_anything(engine_and_sender, indices, values, message):
    engine, sender, store = engine_and_sender
    update_info = _update_info(len(indices))
    info = engine.parse_update_info(update_info)
    yielded, errors = [], []

    def receive() -> None:
        try:
            for name, _ in engine.receive_weights(info):
                yielded.append(name)
        except ValueError as e:
            errors.append(e)

    receiving = threading.Thread(target=receive)
    receiving.start()
    wait_for_keys(store, [StoreKeys(0).ready(1, 1)], 10.0, "engine ready")
    specs = sparse_wire_specs(info.names, info.dtypes, info.shapes, update_info["nnz"])
    items = [torch.tensor(indices, dtype=torch.int32), torch.tensor(values), torch.ones(3)]
    send_items(sender, specs, iter(items), TransferSettings(True, 4096, 2))
    receiving.join(10.0)
    assert len(errors) == 1 and re.search(message, str(errors[0])), errors
    assert yielded == []  # not even the dense tensor announced before the patch: nothing changed
    assert engine.group.aborted  # the next sync joins a fresh group


def test_send_patches_refuses_bad_patches_before_calling_the_engine():
    info = SparseNCCLTrainerInitInfo("127.0.0.1", 0, 2)
    # No client: refusing must not need the engine.
    trainer = SparseNCCLTrainerWeightTransferEngine(info, client=None, source=None, rank=0)
    bad = SparseWeightPatch("w", torch.tensor([5, 5], dtype=torch.int32), torch.ones(2), (10,))
    with pytest.raises(ValueError, match="sparse patch 'w': indices are not unique"):
        trainer.send_patches([("w", bad)])
    with pytest.raises(ValueError, match="'v': the patch is named 'w'"):
        misnamed = SparseWeightPatch("w", torch.tensor([1], dtype=torch.int32), torch.ones(1), (10,))
        trainer.send_patches([("v", misnamed)])


# ---------------------------------------------------------------------------------------
# End to end: sparse syncs into a real `rollout launch` server


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(launch_server, checkpoint):
    return launch_server(checkpoint, "--enable-rl-routes", "--weight-transfer-backend", "sparse_nccl")


def _perturb(model: torch.nn.Module, fraction: float, seed: int) -> None:
    """Changes `fraction` of the coordinates (at least one) of every parameter, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            k = max(1, round(fraction * p.numel()))
            changed = torch.randperm(p.numel(), generator=gen)[:k]
            p.view(-1)[changed] += 0.1 + torch.rand(k, generator=gen)


def _info(**overrides) -> SparseNCCLTrainerInitInfo:
    return SparseNCCLTrainerInitInfo(**{"master_address": "127.0.0.1", "master_port": 0, "world_size": 2,
                                        "timeout_s": TIMEOUT_S, **overrides})


@pytest.mark.slow
def test_a_sparse_sync_sends_a_few_percent_and_lands_bit_identical(server, checkpoint):
    client = HTTPWeightSyncClient(server.url)
    model = trainer_model(checkpoint, seed=61)
    trainer = trainer_init(_info(packed_buffer_size_bytes=64 << 10), client=client, source=model)
    try:
        first = trainer.send_weights(weight_version="dense")
        assert first.extra["num_patches"] == 0 and first.bytes_sent >= first.dense_bytes
        assert_engine_serves(server.url, model, "dense")

        _perturb(model, 0.01, seed=62)
        second = trainer.send_weights(weight_version="sparse")
        assert second.extra["num_dense"] == 0 and second.num_tensors == first.num_tensors
        assert second.dense_bytes == first.dense_bytes
        assert second.bytes_sent <= 0.03 * second.dense_bytes, second
        # Checksums equal the trainer's tensors bit for bit: exactly what a dense sync lands.
        assert_engine_serves(server.url, model, "sparse")

        # A patch made by hand lands through the same path (and the tracker starts over).
        name = "model.layers.0.self_attn.k_proj.weight"
        param = model.get_parameter(name)
        patch = SparseWeightPatch(name, torch.tensor([0, 63, 2047], dtype=torch.int32), torch.tensor([1.5, -2.0, 0.25]),
                                  tuple(param.shape))
        trainer.send_patches([(name, patch)], weight_version="by-hand")
        with torch.no_grad():
            param.view(-1)[patch.indices.long()] = patch.values
        assert_engine_serves(server.url, model, "by-hand")
    finally:
        trainer.shutdown()
        client.close()


@pytest.mark.slow
def test_a_failed_sparse_sync_is_resent_whole_by_the_next(server, checkpoint):
    client = HTTPWeightSyncClient(server.url)
    model = trainer_model(checkpoint, seed=71)
    # 1 KiB buffers: a sync is many update_weights calls, so the failure below lands after some of them.
    trainer = trainer_init(_info(packed_buffer_size_bytes=1024), client=client, source=model)
    try:
        trainer.send_weights(weight_version="base")
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
            before = http.post("/weight_checker", json={}).json()["checksums"]

        class Failing(ModuleSource):
            def iter_full(self):
                for i, pair in enumerate(super().iter_full()):
                    if i == 18:
                        raise RuntimeError("the source failed")
                    yield pair

        _perturb(model, 0.01, seed=72)
        with pytest.raises(RuntimeError, match="the source failed"):
            trainer.send_weights(Failing(model), weight_version="failed")
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
            report = http.post("/weight_checker", json={}).json()
        assert report["checksums"] == before and report["weight_version"] == "base"

        stats = trainer.send_weights(weight_version="resent")  # diffs against what the engine still holds
        assert stats.extra["num_dense"] == 0 and stats.extra["num_calls"] > 1
        assert_engine_serves(server.url, model, "resent")
    finally:
        trainer.shutdown()
        client.close()
