"""A weight update in one engine call (apply_weight_update): an adapter sync of one pack is one round trip.

Start, landing and finish run as one call between two steps: the adapter serves the trainer's tensors under its
own version afterwards, or - a bad call, a failed transfer, another update in progress - everything serves as
before, no update is left open and the next sync works.
"""

from __future__ import annotations

import pytest
import torch

from engine.exceptions import WeightUpdateStateError
from weight_transfer.base import trainer_init
from weight_transfer.checksums import lora_state_checksums
from weight_transfer.clients import LocalWeightSyncClient, RayWeightSyncClient
from weight_transfer.ipc import IPCTrainerInitInfo
from weight_transfer.local import make_update_info
from weight_transfer.lora import AdapterSource, adapter_source
from test_lora_sync import (
    _assert_matches, _bad_syncs, _gen, _lora_sums, _peft_tensors, _run, sync_fixtures,
)


old_refs, trained, llm = sync_fixtures(seed=31, tag="-one-call")


class _CountingClient(LocalWeightSyncClient):
    """A LocalWeightSyncClient that records the engine calls it makes."""

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.calls: list[str] = []

    def _call(self, method: str, *args):
        self.calls.append(method)
        return super()._call(method, *args)


def _no_update_open(core) -> bool:
    return core.abort_weight_update() is False


def test_an_ipc_adapter_sync_of_one_pack_is_one_engine_call(llm, adapters, old_refs, trained):
    qv = adapters["qv"]
    model, new_refs = trained
    generate = _gen(llm)
    _assert_matches(_run(generate, qv), old_refs)
    mixed_before = _lora_sums(llm, "mixed")
    client = _CountingClient(llm)
    trainer = trainer_init(IPCTrainerInitInfo(timeout_s=30.0), client=client, source=adapter_source(model, "qv"))
    try:
        client.calls.clear()
        stats = trainer.send_weights(weight_version="one-1")
        assert client.calls == ["apply_weight_update"]
        assert stats.extra["num_packs"] == 1 and set(stats.extra["phases_s"]) == {"send", "apply"}
        new_tensors = _peft_tensors(model)
        assert _lora_sums(llm, "qv") == lora_state_checksums("qv", new_tensors)
        assert llm.get_weight_version(lora_name="qv") == "one-1" and llm.get_weight_version() == "default"
        assert _lora_sums(llm, "mixed") == mixed_before
        _assert_matches(_run(generate, qv), new_refs)
        # The next sync reuses the exported buffer.
        again = trainer.send_weights(weight_version="one-2")
        assert again.extra["num_exports"] == 0 and client.calls[-1] == "apply_weight_update"
        assert llm.get_weight_version(lora_name="qv") == "one-2"
    finally:
        trainer.shutdown()


def test_bad_one_call_updates_change_nothing_and_leave_no_update_open(llm, adapters, old_refs, trained):
    """Unknown adapter, shape mismatch, a module the adapter lacks, a non-LoRA name, a NaN: a ValueError naming it,
    the adapter's tensors, version and cache as before, and no update left open (a good call then lands)."""
    qv = adapters["qv"]
    model, new_refs = trained
    generate = _gen(llm)
    _run(generate, qv)
    old_sums = _lora_sums(llm, "qv")
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    for update_info, message in _bad_syncs(model):
        with pytest.raises(ValueError, match=message):
            core.apply_weight_update(update_info, "bad")
        assert _no_update_open(core)
    good = {"lora_name": "qv", **make_update_info(_peft_tensors(model).items())}
    with pytest.raises(ValueError, match="weight_version"):
        core.apply_weight_update(good, "")  # refused before the update starts
    assert _no_update_open(core)
    assert _lora_sums(llm, "qv") == old_sums
    assert core.get_weight_version(lora_name="qv") == "default" and core.get_weight_version() == "default"
    after = _run(generate, qv)
    _assert_matches(after, old_refs)
    assert all(cached > 0 for *_, cached in after)  # its prefix cache stayed

    # Inside a three-phase update it is refused, and that update goes on untouched.
    core.start_weight_update()
    assert core.update_weights(good) == len(good["weights"])
    with pytest.raises(WeightUpdateStateError, match="already in progress"):
        core.apply_weight_update(good, "nested")
    core.finish_weight_update("three-phase")
    assert core.get_weight_version(lora_name="qv") == "three-phase"
    _assert_matches(_run(generate, qv), new_refs)

    assert core.apply_weight_update({**good, "weights": dict(good["weights"])}, "one-call") == len(good["weights"])
    assert core.get_weight_version(lora_name="qv") == "one-call" and _no_update_open(core)


class _FailingSource(AdapterSource):
    """An adapter source whose pass fails after its first tensor (a trainer that breaks mid-sync)."""

    def iter_full(self):
        items = super().iter_full()
        yield next(items)
        raise RuntimeError("the trainer broke mid-sync")


def test_a_one_call_sync_whose_transfer_fails_leaves_the_adapter_serving(llm, adapters, old_refs, trained):
    """The engine waits for the pack while the trainer fills it; the fill fails: the engine's call ends, the
    update with it, the old adapter serves; the trainer says why, and its next sync lands."""
    qv = adapters["qv"]
    model, new_refs = trained
    generate = _gen(llm)
    _run(generate, qv)
    old_sums = _lora_sums(llm, "qv")
    source = adapter_source(model, "qv")
    trainer = trainer_init(IPCTrainerInitInfo(timeout_s=30.0), client=LocalWeightSyncClient(llm), source=source)
    try:
        failing = _FailingSource(list(_peft_tensors(model).items()), "qv")
        with pytest.raises(RuntimeError, match="the trainer broke mid-sync"):
            trainer.send_weights(failing, weight_version="broken")
        assert _no_update_open(llm.engine_core)
        assert _lora_sums(llm, "qv") == old_sums and llm.get_weight_version(lora_name="qv") == "default"
        _assert_matches(_run(generate, qv), old_refs)
        trainer.send_weights(weight_version="after-failure")
    finally:
        trainer.shutdown()
    assert llm.get_weight_version(lora_name="qv") == "after-failure"
    _assert_matches(_run(generate, qv), new_refs)


def test_a_ray_client_over_several_engines_applies_in_phases_on_all_or_none(monkeypatch):
    """Each actor's own one call could finish on some engines and fail on others: over several, the client runs
    start, update and finish on all, and aborts on all when any fails."""
    client = RayWeightSyncClient([object(), object()])
    calls: list[tuple] = []
    failing = {"update_weights"}

    def gather(method, *args, per_engine=None):
        calls.append((method, *args))
        if method in failing:
            raise ValueError(f"{method}: engine actor 1: refused")
        return [None, None]

    monkeypatch.setattr(client, "_gather", gather)
    with pytest.raises(ValueError, match="refused"):
        client.apply_weight_update({"weights": {}}, "v1")
    assert calls == [("start_weight_update",), ("update_weights", {"weights": {}}), ("abort_weight_update",)]
    calls.clear()
    failing.clear()
    client.apply_weight_update({"weights": {}}, "v1")
    assert calls == [("start_weight_update",), ("update_weights", {"weights": {}}), ("finish_weight_update", "v1")]
    calls.clear()
    failing.add("start_weight_update")  # one engine refused to start: the others' updates are aborted too
    with pytest.raises(ValueError, match="refused"):
        client.apply_weight_update({"weights": {}}, "v1")
    assert calls == [("start_weight_update",), ("abort_weight_update",)]


def test_a_planned_fill_refuses_a_tensor_whose_shape_changed(llm, adapters, trained):
    """A source's fixed tensor list is planned once; a tensor replaced by one of another shape since (.data) is
    refused by name before anything is copied or asked of the engine, the adapter as before, and the sync after
    it lands."""
    model, _ = trained
    assert llm.add_lora(adapters["qv"])
    tensors = {name: t.clone() for name, t in _peft_tensors(model).items()}
    source = adapter_source(tensors, "qv")
    assert source.plain_tensors() is source.plain_tensors()  # one list, planned once
    posted: list[str] = []

    class _Recording(LocalWeightSyncClient):
        def _submit(self, method, *args):
            posted.append(method)
            return super()._submit(method, *args)

    trainer = trainer_init(IPCTrainerInitInfo(timeout_s=30.0), client=_Recording(llm), source=source)
    try:
        trainer.send_weights(weight_version="planned-1")
        sums = _lora_sums(llm, "qv")
        name = next(iter(tensors))
        original = tensors[name].data
        tensors[name].data = torch.zeros(original.shape[0], original.shape[1] + 1)
        assert "apply_weight_update" in posted  # the good sync's one call went through the recorder
        posted.clear()
        with pytest.raises(RuntimeError, match=rf"'{name}' is now torch.float32 \[4, 65\]"):
            trainer.send_weights(weight_version="changed")
        assert posted == []  # refused before the one call was posted: nothing to abort
        assert _lora_sums(llm, "qv") == sums and llm.get_weight_version(lora_name="qv") == "planned-1"
        assert _no_update_open(llm.engine_core)
        tensors[name].data = original * 2  # back to its shape: the plan holds, and the new values land
        trainer.send_weights(weight_version="planned-2")
    finally:
        trainer.shutdown()
    assert _lora_sums(llm, "qv") == lora_state_checksums("qv", tensors)
    assert llm.get_weight_version(lora_name="qv") == "planned-2"
