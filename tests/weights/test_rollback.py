"""Weight-update safety in the worker: a failed transfer or an abort restores the old weights, and nothing runs mid-update."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import LLM
from engine.core.scheduler import PauseState
from engine.exceptions import WeightTransferError
from engine.wire import EngineCoreRequest
from weight_transfer.base import InitInfo, SparseWeightPatch, WeightTransferEngine, WeightUpdateInfo, register_engine_backend
from weight_transfer.checksums import hf_state_checksums
from weight_transfer.local import make_update_info
from weight_transfer.messages import Message, NonNegInt

from weight_helpers import PROMPTS, engine_greedy, hf_greedy, hf_model, read_state

# What the test backend below delivers: set by each test before its update_weights calls.
_DELIVERIES: dict[str, torch.Tensor | SparseWeightPatch] = {}


class ScriptedUpdateInfo(Message):
    names: list[str]
    fail_at: NonNegInt | None = None  # the index of the tensor at which the peer dies


@dataclass(kw_only=True)
class ScriptedUpdate(WeightUpdateInfo):
    fail_at: int | None


class ScriptedBackend(WeightTransferEngine[InitInfo, ScriptedUpdateInfo]):
    """Yields the announced names from _DELIVERIES and raises ConnectionError at `fail_at` (a dead peer)."""

    def init_transfer(self, init_info: InitInfo) -> None:
        self.aborted = 0

    def plan_update(self, update_info: ScriptedUpdateInfo) -> ScriptedUpdate:
        items = [_DELIVERIES[n] for n in update_info.names]
        return ScriptedUpdate(
            names=update_info.names,
            dtypes=[i.values.dtype if isinstance(i, SparseWeightPatch) else i.dtype for i in items],
            shapes=[tuple(i.full_shape) if isinstance(i, SparseWeightPatch) else tuple(i.shape) for i in items],
            fail_at=update_info.fail_at,
        )

    def receive_weights(self, info: ScriptedUpdate):
        for i, name in enumerate(info.names):
            if i == info.fail_at:
                raise ConnectionError("peer closed the connection")
            yield name, _DELIVERIES[name]

    def abort_update(self) -> None:
        self.aborted += 1


class ScriptedTogetherBackend(ScriptedBackend):
    """The same, declaring its tensors valid for the whole call: the worker lands a call's tensors together."""

    views_stable_per_call = True


class ScriptedReusedBackend(ScriptedTogetherBackend):
    """The same, marking a call by its names as a repeat (same tensors again): the worker reuses its landing plan."""

    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        info = super().parse_update_info(update_info)
        info.reuse_key = tuple(info.names)
        return info


class ScriptedGroupedBackend(ScriptedBackend):
    """The same, delivering runs of 3 tensors valid together (as nccl's packs): the worker lands run by run."""

    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        info = super().parse_update_info(update_info)
        n = len(info.names)
        info.group_sizes = [3] * (n // 3) + ([n % 3] if n % 3 else [])
        return info


register_engine_backend("scripted", ScriptedBackend)
register_engine_backend("scripted-grouped", ScriptedGroupedBackend)
register_engine_backend("scripted-together", ScriptedTogetherBackend)
register_engine_backend("scripted-reused", ScriptedReusedBackend)
BACKENDS = pytest.mark.parametrize("backend", ["scripted", "scripted-together", "scripted-grouped"])


def _llm(path, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, enable_prefix_caching=True, **kwargs)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def old_new(checkpoints):
    old, new = checkpoints("llama")
    return old, hf_greedy(hf_model(old)), read_state(new)


@BACKENDS
@pytest.mark.parametrize("rollback", ["device", "cpu"])
def test_failed_transfer_restores_every_weight_of_the_update_and_ends_it(old_new, rollback, backend):
    path, old_expected, new_state = old_new
    llm = _llm(path, weight_update_rollback=rollback)
    core = llm.engine_core
    before = core.weight_checker()["checksums"]
    names = sorted(new_state)
    _DELIVERIES.clear()
    _DELIVERIES.update(new_state)
    core.init_weight_transfer_engine({"backend": backend})
    core.start_weight_update()
    assert core.update_weights({"names": names[:6]}) == 6  # lands
    with pytest.raises(WeightTransferError, match=rf"failed at {names[8]!r}: ConnectionError: peer closed.*previous weights restored"):
        core.update_weights({"names": names[6:], "fail_at": 3})  # 6, 7, 8 land, then the peer dies
    assert core.weight_checker()["checksums"] == before  # the first call's weights came back too
    assert core.executor.worker.weight_updater.transfer_engine.aborted == 1
    assert core.scheduler.pause_state == PauseState.UNPAUSED  # the update is over: serving again
    assert _tokens(engine_greedy(llm)) == old_expected
    assert core.get_weight_version() == "default"
    core.start_weight_update()  # a new update can start
    assert core.update_weights({"names": names}) == len(names)
    core.finish_weight_update("v2")
    assert core.weight_checker(hf_state_checksums(new_state))["match"]


def test_abort_restores_the_old_weights_and_keeps_the_version(old_new):
    path, old_expected, new_state = old_new
    llm = _llm(path)
    core = llm.engine_core
    before = core.weight_checker()["checksums"]
    core.init_weight_transfer_engine({"backend": "local"})
    assert core.abort_weight_update() is False  # nothing in progress
    core.start_weight_update()
    core.update_weights(make_update_info(new_state.items()))
    assert core.weight_checker()["checksums"] != before
    assert core.abort_weight_update() is True
    assert core.weight_checker()["checksums"] == before
    assert _tokens(engine_greedy(llm)) == old_expected
    assert core.get_weight_version() == "default"


def test_nothing_is_scheduled_while_an_update_is_in_progress(old_new):
    path, _, new_state = old_new
    llm = _llm(path)
    core = llm.engine_core
    core.init_weight_transfer_engine({"backend": "local"})
    core.start_weight_update()
    assert core.scheduler.pause_state == PauseState.PAUSED_ALL
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest("r0", PROMPTS[0], params, eos_token_id=None))  # queues, not refused
    for _ in range(3):
        assert core.step().outputs == []  # half-updated weights never run
    core.update_weights(make_update_info(new_state.items()))
    core.finish_weight_update("v1")
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step().outputs
    new_hf = hf_model(path)
    new_hf.load_state_dict(new_state)
    assert [t for o in outputs for t in o.new_token_ids] == hf_greedy(new_hf, PROMPTS[:1], 4)[0]


def test_failed_transfer_without_rollback_holds_the_engine_until_an_update_finishes(old_new):
    path, _, new_state = old_new
    llm = _llm(path, weight_update_rollback="none")
    core = llm.engine_core
    names = sorted(new_state)
    _DELIVERIES.clear()
    _DELIVERIES.update(new_state)
    core.init_weight_transfer_engine({"backend": "scripted"})
    core.start_weight_update()
    with pytest.raises(WeightTransferError, match="partly updated"):
        core.update_weights({"names": names, "fail_at": 4})
    assert core.scheduler.pause_state == PauseState.PAUSED_ALL  # a mix must not serve
    core.start_weight_update()
    core.update_weights({"names": names})
    core.finish_weight_update()
    assert core.scheduler.pause_state == PauseState.UNPAUSED
    assert core.weight_checker(hf_state_checksums(new_state))["match"]


@BACKENDS
def test_sparse_patches_land_like_the_dense_tensor_they_describe(old_new, backend):
    """Patches of fused (q/k/v, gate/up) and tied-free tensors end bit-identical to a dense update."""
    path, _, new_state = old_new
    dense_llm, sparse_llm = _llm(path), _llm(path)
    old_state = read_state(path)
    gen = torch.Generator().manual_seed(0)
    patched = {}
    _DELIVERIES.clear()
    for name in ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]:
        flat = old_state[name].clone().reshape(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 50)].to(torch.int32)
        values = torch.randn(idx.numel(), generator=gen)
        flat[idx.long()] = values
        patched[name] = flat.reshape(old_state[name].shape)
        _DELIVERIES[name] = SparseWeightPatch(name, idx, values, tuple(old_state[name].shape))
    for llm, info in ((dense_llm, make_update_info(patched.items())), (sparse_llm, {"names": sorted(patched)})):
        core = llm.engine_core
        core.init_weight_transfer_engine({"backend": "local" if llm is dense_llm else backend})
        core.start_weight_update()
        core.update_weights(info)
        core.finish_weight_update()
    dense = dense_llm.engine_core.weight_checker()["checksums"]
    assert sparse_llm.engine_core.weight_checker(dense)["match"]
    assert dense != hf_state_checksums(old_state)


@pytest.mark.parametrize(
    "patch,message",
    [
        (lambda s: SparseWeightPatch("model.norm.weight", torch.tensor([0, 64], dtype=torch.int32), torch.ones(2), (64,)), "out of range"),
        (lambda s: SparseWeightPatch("model.norm.weight", torch.tensor([3, 3], dtype=torch.int32), torch.ones(2), (64,)), "not unique"),
        (lambda s: SparseWeightPatch("model.norm.weight", torch.tensor([1], dtype=torch.int32), torch.tensor([float("nan")]), (64,)), "NaN"),
        (lambda s: SparseWeightPatch("model.norm.weight", torch.tensor([1], dtype=torch.int64), torch.ones(1), (64,)), "int32"),
        (lambda s: SparseWeightPatch("model.norm.weight", torch.tensor([1], dtype=torch.int32), torch.ones(1), (65,)), r"shape \[65\] does not match"),
    ],
)
@BACKENDS
def test_bad_patches_are_refused_naming_the_tensor_and_change_nothing(old_new, patch, message, backend):
    path, _, new_state = old_new
    llm = _llm(path)
    core = llm.engine_core
    before = core.weight_checker()["checksums"]
    _DELIVERIES.clear()
    _DELIVERIES["model.layers.0.mlp.up_proj.weight"] = new_state["model.layers.0.mlp.up_proj.weight"]
    _DELIVERIES["model.norm.weight"] = patch(new_state)
    core.init_weight_transfer_engine({"backend": backend})
    core.start_weight_update()
    with pytest.raises(ValueError, match=rf"no weight was changed.*model\.norm\.weight.*{message}"):
        core.update_weights({"names": ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]})
    assert core.weight_checker()["checksums"] == before  # the good tensor of the call was undone too
    core.finish_weight_update()


@BACKENDS
def test_a_nan_in_a_later_tensor_changes_nothing_of_its_call(old_new, backend):
    path, _, new_state = old_new
    llm = _llm(path)
    core = llm.engine_core
    before = core.weight_checker()["checksums"]
    names = sorted(new_state)[:5]
    _DELIVERIES.clear()
    _DELIVERIES.update({n: new_state[n] for n in names})
    _DELIVERIES[names[3]] = new_state[names[3]].clone().index_fill_(0, torch.tensor([1]), float("nan"))
    core.init_weight_transfer_engine({"backend": backend})
    core.start_weight_update()
    with pytest.raises(ValueError, match=rf"no weight was changed: {names[3]!r}: contains NaN or inf"):
        core.update_weights({"names": names})
    assert core.weight_checker()["checksums"] == before
    _DELIVERIES[names[3]] = new_state[names[3]].to(torch.float64)  # another dtype: lands through the loaders
    assert core.update_weights({"names": names}) == 5
    core.finish_weight_update()
    landed = core.weight_checker(hf_state_checksums({n: new_state[n] for n in names}))
    assert not landed["mismatches"]


def test_a_repeated_call_reuses_its_landing_plan_and_still_checks_and_lands_right(old_new):
    path, old_expected, new_state = old_new
    old_state = read_state(path)
    llm = _llm(path)
    core = llm.engine_core
    updater = core.executor.worker.weight_updater
    names = sorted(new_state)
    delivered = {n: t.clone() for n, t in new_state.items()}  # the backend's buffers, refilled in place
    _DELIVERIES.clear()
    _DELIVERIES.update(delivered)
    core.init_weight_transfer_engine({"backend": "scripted-reused"})

    def sync(state: dict, version: str) -> None:
        for n in names:
            delivered[n].copy_(state[n])
        core.start_weight_update()
        assert core.update_weights({"names": names}) == len(names)
        core.finish_weight_update(version)

    for version, state in [("v1", new_state), ("v2", old_state), ("v3", new_state)]:
        sync(state, version)
        assert core.weight_checker(hf_state_checksums(state))["match"], version
    assert len(updater._plans) == 1  # built once, used three times

    delivered[names[2]].view(-1)[0] = float("nan")  # a repeated call is still checked
    core.start_weight_update()
    with pytest.raises(ValueError, match=rf"no weight was changed: {names[2]!r}: contains NaN or inf"):
        core.update_weights({"names": names})
    core.abort_weight_update()
    assert core.weight_checker(hf_state_checksums(new_state))["match"]

    # Sleep level 2 may give the parameters new storage (wake_up(reload_weights) reads the checkpoint's
    # weights): a stale plan would land in the old storage, and the engine would keep serving the checkpoint.
    core.sleep(level=2)
    core.wake_up(reload_weights=True)
    assert core.weight_checker(hf_state_checksums(old_state))["match"]
    sync(new_state, "v4")
    assert core.weight_checker(hf_state_checksums(new_state))["match"]
    sync(old_state, "v5")
    assert _tokens(engine_greedy(llm)) == old_expected
