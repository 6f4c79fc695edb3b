"""How an adapter sync is staged and committed (engine/worker/lora_weight_update.py): batched, on the slots' device.

A call's tensors are copied group by group into one float32 staging buffer (a backend may overwrite its
buffer as soon as the next group is pulled), checked finite once, and at commit written into the adapter's
slot where they are. The slot must then hold exactly what paging the adapter's host copy in would write
(B scaled, rows and columns past the rank zero), the host copy exactly the synced values, and a rejected or
discarded call must change nothing. The backend here is a stand-in that reuses one buffer per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.lora_weight_update import LoRAWeightUpdater, _CallPlan
from weight_transfer.base import WeightUpdateInfo
from weight_transfer.checksums import lora_state_checksums

ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, enable_lora=True, max_loras=2,
                   max_lora_rank=16, disable_log_stats=True)


@dataclass
class _Info(WeightUpdateInfo):
    tensors: list[torch.Tensor] | None = None
    delivered_shapes: list[tuple[int, ...]] | None = None  # what the backend really sends, when not as announced


class _ReusingEngine:
    """A transfer engine whose views of a group live in one buffer it fills with NaN once the next group is pulled."""

    views_stable_per_call = False

    def __init__(self, group: int) -> None:
        self.group = group
        self.drained = 0  # calls whose stream was read to its end

    def parse_update_info(self, update_info: dict) -> _Info:
        tensors = update_info["tensors"]
        names = list(update_info["names"])
        sizes = [min(self.group, len(names) - i) for i in range(0, len(names), self.group)]
        return _Info(names, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors], group_sizes=sizes,
                     tensors=tensors, delivered_shapes=update_info.get("delivered_shapes"))

    def receive_weights(self, info: _Info):
        shapes = info.delivered_shapes or info.shapes
        start = 0
        for size in info.group_sizes:
            group = info.tensors[start:start + size]
            buffer = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype)
            offset = 0
            for name, t, shape in zip(info.names[start:], group, shapes[start:]):
                view = buffer[offset:offset + t.numel()]
                view.copy_(t.reshape(-1))
                offset += t.numel()
                yield name, view.view(shape) if tuple(shape) == tuple(t.shape) else torch.zeros(shape, dtype=t.dtype)
            buffer.fill_(float("nan"))  # the next group's pull: the views above are gone
            start += size
        self.drained += 1


class _Target:
    """The model's WeightUpdater as LoRAWeightUpdater uses it: its transfer engine and update state."""

    def __init__(self, engine) -> None:
        self.transfer_engine, self.updating, self.backend, self.consistent = engine, True, "reusing", True

    def abort_update(self) -> bool:
        self.updating = False
        return True


@pytest.fixture(scope="module")
def llm(base_model, adapters):
    llm = LLM(base_model, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for name in ("mixed", "all"):  # both in slots (max_loras=2): every sync below rewrites one
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False, lora_request=adapters[name])
    yield llm
    llm.shutdown()


@pytest.fixture
def manager(llm):
    return llm.engine_core.executor.worker.lora_manager


def _slots(manager) -> list[torch.Tensor]:
    return [t.clone() for layer in manager.layers.values() for t in (layer.lora_a_stacked, layer.lora_b_stacked)]


def _call(manager, lora, seed: int, dtype=torch.bfloat16, only=None) -> dict:
    """New random values for the adapter's tensors (or those whose name contains `only`), as a trainer sends them."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(t.shape, generator=generator).to(dtype)
               for name, t in manager.host_adapter(lora).tensors().items() if only is None or only in name}
    return {"names": list(tensors), "tensors": list(tensors.values())}


def _assert_slot_is_the_host_copys(manager, lora) -> None:
    """The adapter's slot equals what paging its host copy in writes (set_slot), bit for bit, padding included."""
    slot = manager._slot_ids.index(lora.lora_int_id)
    synced = _slots(manager)
    manager._write_slot(slot, lora.lora_int_id, manager._host[lora.lora_int_id])
    for got, want in zip(synced, _slots(manager)):
        assert torch.equal(got[slot], want[slot])


def _host_values(manager, lora) -> dict[str, torch.Tensor]:
    return manager._host[lora.lora_int_id].ready().tensors()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def bf16_manager(base_model, adapters):
    """A bfloat16 engine's adapter slots: B cannot be scaled where it lands (the scales 0.5 and 8/sqrt(8) round
    differently after the cast), so the rewrite scales it in its float32 scratch first."""
    llm = LLM(base_model, **{**ENGINE_ARGS, "dtype": "bfloat16"})
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for name in ("mixed", "all"):
        llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False, lora_request=adapters[name])
    yield llm.engine_core.executor.worker.lora_manager
    llm.shutdown()


@pytest.mark.parametrize("name", ["mixed", "all"])  # rank 8 < max_lora_rank with rslora; rank 16, fused q/k/v
def test_a_sync_lands_in_the_slot_as_the_host_copy_would(manager, adapters, name):
    _sync_twice_and_check_the_slots(manager, adapters, name)


@pytest.mark.parametrize("name", ["mixed", "all"])
def test_a_bfloat16_slot_gets_b_scaled_in_float32_as_the_host_copy_would(bf16_manager, adapters, name):
    _sync_twice_and_check_the_slots(bf16_manager, adapters, name)
    updater = LoRAWeightUpdater(bf16_manager, _Target(_ReusingEngine(group=3)))
    updater.update(_call(bf16_manager, adapters[name], seed=9), adapters[name])
    updater.commit()
    slot = bf16_manager._slot_ids.index(adapters[name].lora_int_id)
    rewrites = [plan for key, plan in bf16_manager._rewrites.items() if key[0] == slot]
    assert rewrites and all(not plan.scale_in_place and plan._b_scratch is not None for plan in rewrites)


def _sync_twice_and_check_the_slots(manager, adapters, name) -> None:
    lora = adapters[name]
    other = adapters["all" if name == "mixed" else "mixed"]
    engine = _ReusingEngine(group=3)
    updater = LoRAWeightUpdater(manager, _Target(engine))
    slots_before = _slots(manager)
    other_slot = manager._slot_ids.index(other.lora_int_id)
    for seed in (1, 2):  # the second sync is a repeat: planned once
        call = _call(manager, lora, seed)
        assert updater.update(call, lora) == len(call["names"])
        assert updater.commit() == [lora.lora_int_id]
        host = _host_values(manager, lora)
        assert all(torch.equal(host[n], t.float()) for n, t in zip(call["names"], call["tensors"]))
        assert all(host[n].dtype == torch.float32 for n in call["names"])
        want = lora_state_checksums(name, dict(zip(call["names"], (t.float() for t in call["tensors"]))))
        assert {k: v for k, v in manager.checksums().items() if k.startswith(f"lora:{name}:")} == want
        _assert_slot_is_the_host_copys(manager, lora)
    assert len(updater._plans) == 1 and engine.drained == 2
    slot = manager._slot_ids.index(lora.lora_int_id)
    assert any(not torch.equal(a[slot], b[slot]) for a, b in zip(slots_before, _slots(manager)))
    assert all(torch.equal(a[other_slot], b[other_slot]) for a, b in zip(slots_before, _slots(manager)))


def test_calls_of_one_update_add_up_and_a_rejected_or_discarded_one_changes_nothing(manager, adapters):
    lora = adapters["mixed"]
    engine = _ReusingEngine(group=4)
    updater = LoRAWeightUpdater(manager, _Target(engine))
    host_before, slots_before = _host_values(manager, lora), _slots(manager)

    first = _call(manager, lora, seed=3, dtype=torch.float32)
    updater.update(first, lora)
    bad = _call(manager, lora, seed=4, only="lora_B")
    bad["tensors"][2] = bad["tensors"][2].clone()
    bad["tensors"][2][0, 1] = float("inf")
    with pytest.raises(ValueError, match=rf"nothing was changed: '{bad['names'][2]}': contains NaN or inf$"):
        updater.update(bad, lora)
    wrong = dict(_call(manager, lora, seed=5))
    wrong["delivered_shapes"] = [(1, 1), *[tuple(t.shape) for t in wrong["tensors"][1:]]]
    with pytest.raises(ValueError, match=rf"'{wrong['names'][0]}': shape \[1, 1\] does not match"):
        updater.update(wrong, lora)
    assert engine.drained == 3  # each stream read to its end: the transport stays usable
    assert _same(_host_values(manager, lora), host_before) and all(
        torch.equal(a, b) for a, b in zip(slots_before, _slots(manager)))  # nothing serves a staged call

    second = _call(manager, lora, seed=6, only="lora_B")
    updater.update(second, lora)
    updater.commit()
    host = _host_values(manager, lora)
    want = dict(zip(first["names"], first["tensors"]))
    want |= {n: t.float() for n, t in zip(second["names"], second["tensors"])}
    assert host.keys() == want.keys() and all(torch.equal(host[n], t) for n, t in want.items())
    _assert_slot_is_the_host_copys(manager, lora)

    host_before, slots_before = _host_values(manager, lora), _slots(manager)
    updater.update(_call(manager, lora, seed=7), lora)
    assert updater.discard() is True and updater.commit() == []
    assert _same(_host_values(manager, lora), host_before)
    assert all(torch.equal(a, b) for a, b in zip(slots_before, _slots(manager)))


def test_a_call_plan_lays_the_tensors_end_to_end_in_the_calls_order():
    names = [f"base_model.model.m{i}.lora_{'AB'[i % 2]}.weight" for i in range(5)]
    shapes = [(2, 3), (4, 2), (2, 3), (0, 2), (4, 2)]
    plan = _CallPlan.build(names, shapes)
    assert plan.numel == 2 * 6 + 2 * 8
    flat = torch.arange(plan.numel, dtype=torch.float32)
    views = plan.views(flat)
    assert [tuple(v.shape) for v in views] == shapes
    assert torch.equal(torch.cat([v.flatten() for v in views]), flat)  # as a packing backend lays them out
    assert plan.targets[1] == ("m1", "B")


class _StableEngine:
    """A transfer engine whose views last the call and recur (ipc's): the same view objects every call of one
    layout, filled with the call's values; reuse_key says so."""

    views_stable_per_call = True

    def __init__(self) -> None:
        self.views: dict[tuple, list[torch.Tensor]] = {}

    def parse_update_info(self, update_info: dict) -> _Info:
        tensors = update_info["tensors"]
        names, shapes = list(update_info["names"]), [tuple(t.shape) for t in tensors]
        layout = (tuple(names), tuple(shapes))
        return _Info(names, [t.dtype for t in tensors], shapes, reuse_key=layout, tensors=tensors)

    def receive_weights(self, info: _Info):
        views = self.views.setdefault(info.reuse_key, [torch.empty(s) for s in info.shapes])
        for name, view, t in zip(info.names, views, info.tensors):
            view.copy_(t)
            yield name, view


def test_a_repeated_call_is_checked_for_values_and_huge_finite_values_pass(manager, adapters):
    """A backend's repeat of the same views skips their shape checks, never the values: a NaN in the third call is
    refused. Values whose sum overflows float32 are finite, and land."""
    lora = adapters["mixed"]
    updater = LoRAWeightUpdater(manager, _Target(_StableEngine()))
    for seed in (8, 9):
        updater.update(_call(manager, lora, seed=seed, dtype=torch.float32), lora)
    assert len(updater._checked) == 1  # the layout's views passed once; the second call was a trusted repeat
    host_before = _host_values(manager, lora)
    bad = _call(manager, lora, seed=10, dtype=torch.float32)
    bad["tensors"][1][0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"nothing was changed: '{bad['names'][1]}': contains NaN or inf$"):
        updater.update(bad, lora)
    huge = _call(manager, lora, seed=11, dtype=torch.float32)
    huge["tensors"] = [torch.full_like(t, 1e38) for t in huge["tensors"]]
    updater.update(huge, lora)
    assert _same(_host_values(manager, lora), host_before)  # staged, not serving yet
    updater.commit()
    host = _host_values(manager, lora)
    assert all(torch.equal(host[n], t) for n, t in zip(huge["names"], huge["tensors"]))


def test_recurring_syncs_take_turns_in_two_buffers_and_never_touch_what_serves(manager, adapters):
    """A call carrying the whole adapter stages into buffers made once, in turn: whatever is staged (then committed,
    discarded, or joined by a second call of the same update) the serving host copy and slot change only at commit."""
    lora = adapters["all"]
    updater = LoRAWeightUpdater(manager, _Target(_ReusingEngine(group=5)))
    sent = {}
    for seed in (12, 13, 14):
        call = _call(manager, lora, seed=seed, dtype=torch.float32)
        updater.update(call, lora)
        updater.commit()
        sent = dict(zip(call["names"], call["tensors"]))
        assert _same(_host_values(manager, lora), sent)
        _assert_slot_is_the_host_copys(manager, lora)
    buffers = {id(v.staging) for v in updater._recurring[lora.lora_int_id].versions}
    assert len(buffers) == 2  # the same two buffers all along

    serving, slots = _host_values(manager, lora), _slots(manager)
    for seed in (15, 16):  # staged into the buffer that does not serve, then dropped
        updater.update(_call(manager, lora, seed=seed, dtype=torch.float32), lora)
        assert _same(_host_values(manager, lora), serving)
        assert all(torch.equal(a, b) for a, b in zip(slots, _slots(manager)))
        updater.discard()
    first = _call(manager, lora, seed=17, dtype=torch.float32)
    second = _call(manager, lora, seed=18, dtype=torch.float32, only="lora_B")
    updater.update(first, lora)  # into a recurring buffer ...
    updater.update(second, lora)  # ... moved out of it by the update's second call
    updater.commit()
    want = dict(zip(first["names"], first["tensors"])) | dict(zip(second["names"], second["tensors"]))
    assert _same(_host_values(manager, lora), want)
    for seed in (19, 20):  # recurring syncs after it leave its values alone until they commit
        call = _call(manager, lora, seed=seed, dtype=torch.float32)
        updater.update(call, lora)
        assert _same(_host_values(manager, lora), want)
        updater.commit()
        want = dict(zip(call["names"], call["tensors"]))
        assert _same(_host_values(manager, lora), want)
        _assert_slot_is_the_host_copys(manager, lora)
    assert {id(v.staging) for v in updater._recurring[lora.lora_int_id].versions} == buffers
