"""RolloutGroup with two real engine processes, driven through RolloutWorker(data_parallel_size=2)."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from engine.exceptions import EngineDeadError
from engine.sampling_params import SamplingParams
from engine.tiny_models import make_tiny_checkpoint
from rollout import RolloutWorker
from rollout.group import RolloutGroup, WeightVersionMismatchError

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=256, disable_log_stats=True)
PROMPTS = ["The quick brown fox", "Once upon a time", "A rollout is", "hello world", "one two three", "RL with PPO"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dp_worker(tiny_checkpoint):
    with RolloutWorker(model=tiny_checkpoint("llama"), multiprocess=True, data_parallel_size=2, **ENGINE_ARGS) as w:
        yield w


def _on_loop(worker: RolloutWorker, coro):
    """Runs a coroutine of the group's engines on the worker's loop (where their sockets live)."""
    return worker._run(coro)


def test_outputs_match_one_engine_and_both_engines_serve(dp_worker, tiny_checkpoint):
    group = dp_worker.engine
    assert isinstance(group, RolloutGroup) and group.num_engines == 2
    routed_before = list(group.balancer.num_routed)
    dp_greedy = dp_worker.generate(PROMPTS, GREEDY)
    dp_seeded = dp_worker.generate(PROMPTS, [_seeded(i) for i in range(len(PROMPTS))])
    assert all(after > before for after, before in zip(group.balancer.num_routed, routed_before))
    assert group.balancer.outstanding_tokens == [0, 0]  # every finished request gave its work back
    with RolloutWorker(model=tiny_checkpoint("llama"), **ENGINE_ARGS) as single:
        assert [o.outputs[0].token_ids for o in dp_greedy] == [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
        seeded = single.generate(PROMPTS, [_seeded(i) for i in range(len(PROMPTS))])
        assert [o.outputs[0].token_ids for o in dp_seeded] == [o.outputs[0].token_ids for o in seeded]
    assert [o.prompt for o in dp_greedy] == PROMPTS
    # Token-id prompts and bad input go through the group like through one engine.
    ids = dp_worker.tokenizer.encode(PROMPTS[0])
    assert dp_worker.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids == dp_greedy[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="top_p"):
        dp_worker.generate("a", SamplingParams(top_p=2.0))
    with pytest.raises(ValueError, match="prompt"):
        dp_worker.generate({"tokens": [1, 2]}, GREEDY)


def test_controls_fan_out_and_world_size_adds_up(dp_worker):
    assert dp_worker.get_world_size() == 2
    with pytest.raises(ValueError, match="mode"):
        dp_worker.pause_generation("later")
    for mode in ("abort", "wait", "keep"):
        dp_worker.pause_generation(mode)
        assert _on_loop(dp_worker, _all(dp_worker.engine, "is_paused")) == [True, True]
        dp_worker.resume_generation()
        assert dp_worker.is_paused() is False
    dp_worker.sleep(1)
    assert _on_loop(dp_worker, _all(dp_worker.engine, "is_sleeping")) == [True, True]
    dp_worker.wake_up()
    assert dp_worker.is_sleeping() is False
    assert dp_worker.generate("hello", GREEDY)[0].finished
    assert dp_worker.abort_requests(["no-such-request"]) == []


async def _all(group: RolloutGroup, method: str, *args):
    return [await getattr(engine, method)(*args) for engine in group.engines]


def test_a_local_weight_update_reaches_every_engine(dp_worker, tmp_path):
    from weight_transfer import hf_state_checksums

    before = [o.outputs[0].token_ids for o in dp_worker.generate(PROMPTS, GREEDY)]
    original = load_file(os.path.join(dp_worker.config.model.model, "model.safetensors"))
    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path / "seed1", "llama", seed=1), "model.safetensors"))
    for weights, version in ((new, "v1"), (original, "v2")):
        dp_worker.pause_generation("wait")
        dp_worker.init_weight_transfer_engine({"backend": "local"})
        dp_worker.start_weight_update()
        dp_worker.update_weights({"weights": dict(weights)})
        dp_worker.finish_weight_update(version)
        dp_worker.resume_generation()
        assert dp_worker.get_weight_version() == version
        assert dp_worker.weight_info()["weight_version"] == version
        report = dp_worker.weight_checker(hf_state_checksums(weights))
        assert report["match"] is True and report["consistent"] is True
        assert [r["match"] for r in report["engines"]] == [True, True]
        outputs = dp_worker.generate(PROMPTS, GREEDY)
        assert {v for o in outputs for v, _, _ in o.outputs[0].weight_versions} == {version}
        if version == "v1":
            assert [o.outputs[0].token_ids for o in outputs] != before
    assert [o.outputs[0].token_ids for o in outputs] == before


def test_a_one_call_update_lands_on_every_engine_or_on_none(dp_worker, tmp_path):
    """apply_weight_update on a group: an engine that refuses to start, or fails its landing, leaves every engine
    serving the old weights with no update open; then one call lands the new weights on both."""
    from weight_transfer import hf_state_checksums

    group = dp_worker.engine
    original = load_file(os.path.join(dp_worker.config.model.model, "model.safetensors"))
    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path / "seed2", "llama", seed=2), "model.safetensors"))
    version = dp_worker.get_weight_version()
    before = [o.outputs[0].token_ids for o in dp_worker.generate(PROMPTS, GREEDY)]

    def unchanged() -> None:
        assert _on_loop(dp_worker, _all(group, "abort_weight_update")) == [False, False]  # no update open
        assert dp_worker.get_weight_version() == version
        assert [r["match"] for r in dp_worker.weight_checker(hf_state_checksums(original))["engines"]] == [True, True]
        assert [o.outputs[0].token_ids for o in dp_worker.generate(PROMPTS, GREEDY)] == before

    dp_worker.init_weight_transfer_engine({"backend": "local"})
    _on_loop(dp_worker, group.engines[1].shutdown_weight_transfer_engine())  # engine 1 cannot start an update
    with pytest.raises(ValueError, match="init_weight_transfer_engine first"):
        dp_worker.apply_weight_update({"weights": dict(new)}, "v-none")
    unchanged()

    dp_worker.init_weight_transfer_engine({"backend": "local"})
    landing = group.engines[1].update_weights

    async def fails_after_landing(request):  # engine 1 lands the tensors, then its call fails
        await landing(request)
        raise RuntimeError("engine 1 lost its transfer")

    group.engines[1].update_weights = fails_after_landing
    try:
        with pytest.raises(RuntimeError, match="engine 1 lost its transfer"):
            dp_worker.apply_weight_update({"weights": dict(new)}, "v-none")
    finally:
        del group.engines[1].update_weights
    unchanged()

    dp_worker.apply_weight_update({"weights": dict(new)}, "v-one-call")
    assert dp_worker.get_weight_version() == "v-one-call"
    assert [r["match"] for r in dp_worker.weight_checker(hf_state_checksums(new))["engines"]] == [True, True]
    assert [o.outputs[0].token_ids for o in dp_worker.generate(PROMPTS, GREEDY)] != before
    dp_worker.apply_weight_update({"weights": dict(original)}, version)
    unchanged()


def test_engines_that_disagree_on_the_weight_version_fail_loudly(dp_worker):
    group = dp_worker.engine
    version = dp_worker.get_weight_version()
    _on_loop(dp_worker, group.engines[1].update_weight_version("stray"))
    try:
        with pytest.raises(WeightVersionMismatchError, match=r"disagree.*engine 0 serves .*engine 1 serves 'stray'"):
            dp_worker.get_weight_version()
        with pytest.raises(WeightVersionMismatchError, match="weight_info"):
            dp_worker.weight_info()
    finally:
        dp_worker.update_weight_version(version)  # goes to both: they agree again
    assert dp_worker.get_weight_version() == version


def test_a_dead_engine_fails_the_pause_resumes_the_other_and_requests_go_around_it(dp_worker):
    # Last in the module: it stops engine 1.
    group = dp_worker.engine

    async def stop_engine_1():
        group.engines[1].shutdown()

    _on_loop(dp_worker, stop_engine_1())
    with pytest.raises(EngineDeadError, match="engine 1"):
        dp_worker.pause_generation("abort")
    # The pause failed as a whole: engine 0 serves again.
    assert _on_loop(dp_worker, group.engines[0].is_paused()) is False
    with pytest.raises(EngineDeadError, match="engine 1 of 2"):
        _on_loop(dp_worker, group.check_health())
    routed = group.balancer.num_routed[0]
    outputs = dp_worker.generate(PROMPTS[:3], GREEDY)
    assert all(o.finished for o in outputs) and group.balancer.num_routed[0] == routed + 3
