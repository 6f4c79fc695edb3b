"""Adapter weight sync over the ipc backend on CPU (POSIX shared memory): a trainer's PEFT tensors into an engine's adapter.

The same promises as tests/lora/test_lora_sync.py makes for local and nccl, through the ring of shared
buffers: the adapter's requests equal HF + PEFT merged with the new tensors, the engine's adapter checksums
are the trainer's, only the adapter's bytes cross (several packs, the buffers reused across syncs), and a bad
tensor is refused by name with nothing staged, the transport still usable for the next sync.
"""

from __future__ import annotations

import os

import pytest

from weight_transfer.base import trainer_init
from weight_transfer.checksums import lora_state_checksums
from weight_transfer.clients import LocalWeightSyncClient, WeightSyncError
from weight_transfer.ipc import SHM_DIR, IPCTrainerInitInfo
from weight_transfer.lora import adapter_source
from test_lora_sync import (
    ENGINE_ARGS, Q_A, _assert_matches, _gen, _lora_sums, _outputs, _peft_tensors, _run, sync_fixtures,
)

# Adapter "qv"'s tensors are at most 1 KiB each (rank 4 x width 64, float32): a few a buffer, so one sync is
# several packs through both ring buffers.
BUFFER_BYTES = 2 << 10


old_refs, trained, llm = sync_fixtures(seed=21, tag="-ipc")


def _segments() -> list[str]:
    """This process's ipc segments in /dev/shm (the trainer names them wt-ipc-<pid>-...)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"wt-ipc-{os.getpid()}-"))


def _ipc_trainer(client, source):
    return trainer_init(IPCTrainerInitInfo(packed_buffer_size_bytes=BUFFER_BYTES, timeout_s=30.0),
                        client=client, source=source)


def test_ipc_sync_into_an_in_process_engine(llm, adapters, old_refs, trained):
    """Refused syncs (a NaN, a wrong shape) change nothing; then two good ones land the trainer's tensors bit for
    bit, move only their bytes in several packs, reuse the buffers, and leave the base model alone."""
    qv, mixed = adapters["qv"], adapters["mixed"]
    model, new_refs = trained
    generate = _gen(llm)
    _assert_matches(_run(generate, qv), old_refs)
    _run(generate, None)
    _run(generate, mixed)
    base_before, mixed_before = _outputs(_run(generate, None)), _outputs(_run(generate, mixed))  # prompts cached
    old_sums = _lora_sums(llm, "qv")
    new_tensors = _peft_tensors(model)

    source = adapter_source(model, "qv")
    trainer = _ipc_trainer(LocalWeightSyncClient(llm), source)
    try:
        # A NaN is seen only once the bytes arrived (after the engine read the pack); a wrong shape before any
        # byte is read (the engine never waits on that buffer). Either way the update is aborted, nothing staged.
        nan = dict(new_tensors)
        nan[Q_A] = nan[Q_A].clone()
        nan[Q_A][1, 2] = float("nan")
        with pytest.raises((RuntimeError, WeightSyncError), match=rf"'{Q_A}': contains NaN or inf"):
            trainer.send_weights(adapter_source(nan, "qv"), weight_version="bad-nan")
        short = {**new_tensors, Q_A: new_tensors[Q_A][:, :-1].contiguous()}
        with pytest.raises((RuntimeError, WeightSyncError), match=rf"'{Q_A}': shape \[4, 63\] does not match"):
            trainer.send_weights(adapter_source(short, "qv"), weight_version="bad-shape")
        assert _lora_sums(llm, "qv") == old_sums
        assert llm.get_weight_version(lora_name="qv") == "default" and llm.get_weight_version() == "default"
        _assert_matches(_run(generate, qv), old_refs)

        stats = trainer.send_weights(weight_version="ipc-1")  # the same trainer, buffers and control block
        adapter_bytes = sum(t.nbytes for t in new_tensors.values())
        assert stats.bytes_sent == adapter_bytes == source.num_bytes and stats.num_tensors == len(new_tensors)
        assert stats.extra["num_packs"] > 2  # more packs than ring buffers: each refilled once its call returned
        model_bytes = sum(p.nbytes for name, p in model.named_parameters() if ".lora_" not in name)
        assert stats.bytes_sent * 20 < model_bytes
        assert _lora_sums(llm, "qv") == lora_state_checksums("qv", new_tensors)
        assert llm.get_weight_version(lora_name="qv") == "ipc-1" and llm.get_weight_version() == "default"
        _assert_matches(_run(generate, qv), new_refs)
        assert _outputs(_run(generate, None)) == base_before and _outputs(_run(generate, mixed)) == mixed_before

        # A second sync of the same tensors reuses the exported buffers: no new export, the same ids.
        buffers = stats.extra["buffer_ids"]
        again = trainer.send_weights(weight_version="ipc-2")
        assert again.extra["num_exports"] == 0 and again.extra["buffer_ids"] == buffers
        assert _lora_sums(llm, "qv") == lora_state_checksums("qv", new_tensors)
        # Each pack's tensors lie end to end in one dtype: the engine landed each call in one copy of its pack
        # (the refused call's [4, 63] tensor left a gap before the next: its pack had no flat view).
        receiver = llm.engine_core.executor.worker.weight_updater.transfer_engine
        view_sets = [entry for mapped in receiver._mapped.values() for entry in mapped.views.values()]
        refused = [flat for views, flat in view_sets if any(v.shape[-1] == 63 for v in views)]
        good = [(views, flat) for views, flat in view_sets if all(v.shape[-1] != 63 for v in views)]
        assert len(good) >= stats.extra["num_packs"] and refused == [None]
        assert all(flat is not None and flat.numel() == sum(v.numel() for v in views) for views, flat in good)
        assert llm.get_weight_version(lora_name="qv") == "ipc-2"
    finally:
        trainer.shutdown()
    assert _segments() == []  # the trainer's buffers and control block are gone
    _assert_matches(_run(generate, qv), new_refs)  # the adapter's host copy does not live in them


@pytest.mark.slow
def test_ipc_sync_into_a_rollout_worker_process(base_model, adapters, old_refs, trained):
    """From this process into a RolloutWorker's engine process: the segments are mapped across processes."""
    from rollout import RolloutWorker

    qv = adapters["qv"]
    model, new_refs = trained
    new_tensors = _peft_tensors(model)
    with RolloutWorker(model=base_model, multiprocess=True, **ENGINE_ARGS) as worker:
        generate = lambda prompts, params, lora_request: worker.generate(prompts, params, lora_request=lora_request)
        assert worker.add_lora(qv) is True
        _assert_matches(_run(generate, qv), old_refs)
        _run(generate, None)
        base_before = _outputs(_run(generate, None))  # with its prompts cached, as after the sync (which keeps them)
        trainer = _ipc_trainer(LocalWeightSyncClient(worker), adapter_source(model, "qv"))
        try:
            stats = trainer.send_weights(weight_version="ipc-proc-1")
        finally:
            trainer.shutdown()
        assert stats.bytes_sent == sum(t.nbytes for t in new_tensors.values())
        assert _lora_sums(worker, "qv") == lora_state_checksums("qv", new_tensors)
        assert worker.get_weight_version(lora_name="qv") == "ipc-proc-1" and worker.get_weight_version() == "default"
        _assert_matches(_run(generate, qv), new_refs)
        assert _outputs(_run(generate, None)) == base_before
