"""weight_transfer/sync_trace.py (beside the LoRA sync tests for their adapters): a weight sync's hops marked by the trainer's and the engine's processes, summarized."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weight_transfer import sync_trace


@pytest.fixture
def trace_file(tmp_path, monkeypatch):
    """Tracing on into a fresh file for this test only (the env var and the module's target are restored)."""
    path = str(tmp_path / "trace.log")
    monkeypatch.setattr(sync_trace, "_path", None)
    monkeypatch.setattr(sync_trace, "_fd", None)
    monkeypatch.setenv(sync_trace.ENV, "unset after the test")  # recorded, so enable()'s value is undone too
    sync_trace.enable(path)
    assert os.environ[sync_trace.ENV] == path
    yield path
    if sync_trace._fd is not None:
        os.close(sync_trace._fd)


def test_marks_are_off_by_default_and_summaries_take_each_hops_first_mark_per_sync(trace_file):
    with open(trace_file, "w") as f:  # two syncs, written as the processes would (time pid hop)
        f.write("100.000 1 trainer: sync started\n100.001 2 engine: call received\n100.003 2 engine: answer sent\n"
                "100.004 2 engine: answer sent\n")
        f.write("200.000 1 trainer: sync started\n200.003 2 engine: call received\n200.005 2 engine: answer sent\n")
        f.write("200.007 2 engine: get_weight_version started\n")
    hops = sync_trace.summarize(trace_file)
    assert list(hops) == ["trainer: sync started", "engine: call received", "engine: answer sent",
                          "engine: get_weight_version started"]
    assert hops["engine: call received"] == pytest.approx(2.0, abs=1e-3)  # median of 1 and 3 ms
    assert hops["engine: answer sent"] == pytest.approx(4.0, abs=1e-3)  # the first mark of each sync: 3 and 5 ms
    sync_trace._path = None  # as without WEIGHT_SYNC_TRACE: a mark writes nothing
    sync_trace.mark("trainer: sync started")
    assert Path(trace_file).read_text().count("sync started") == 2


def test_an_ipc_adapter_sync_is_marked_by_both_processes_in_order(base_model, adapters, trace_file):
    """A real engine process (RolloutWorker multiprocess) inherits the trace; one ipc adapter sync in one call."""
    from safetensors.torch import load_file

    from rollout.worker import RolloutWorker
    from weight_transfer import trainer_init
    from weight_transfer.clients import LocalWeightSyncClient
    from weight_transfer.ipc import IPCTrainerInitInfo
    from weight_transfer.lora import adapter_source

    lora = adapters["mixed"]
    worker = RolloutWorker(model=base_model, multiprocess=True, device="cpu", max_model_len=64,
                           num_gpu_blocks_override=16, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        worker.add_lora(lora)
        adapter = load_file(os.path.join(lora.lora_path, "adapter_model.safetensors"))
        source = adapter_source(adapter, lora.lora_name)
        trainer = trainer_init(IPCTrainerInitInfo(timeout_s=30.0), client=LocalWeightSyncClient(worker), source=source)
        try:
            Path(trace_file).write_text("")  # the engine's start-up and the trainer's init are not this sync
            trainer.send_weights(source, weight_version="mixed-1")
        finally:
            trainer.shutdown()
        assert worker.get_weight_version(lora_name=lora.lora_name) == "mixed-1"
    finally:
        worker.shutdown()
    lines = [line.split(" ", 2) for line in Path(trace_file).read_text().splitlines()]
    pids = {hop: int(pid) for _, pid, hop in lines}
    assert pids["trainer: sync started"] == os.getpid()
    assert pids["engine: fill seen"] != os.getpid()  # the engine's process marked its hops into the same file
    hops = list(sync_trace.summarize(trace_file))
    expected = ["trainer: sync started", "trainer: call posted", "engine: apply_weight_update started",
                "engine: fill seen", "engine: tensors landed", "engine: update finished", "engine: answer sent",
                "trainer: answer received"]
    assert [h for h in hops if h in expected] == expected
