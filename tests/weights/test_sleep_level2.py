"""sleep(2) discards the weights: woken without reload_weights the engine refuses to generate until a finished
weight update has written every weight, then serves exactly those weights under their version."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.exceptions import EngineNotReadyError
from weight_transfer.checksums import hf_state_checksums

from weight_helpers import engine_greedy, hf_greedy, hf_model, read_state


def _llm(path) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, block_size=16, enable_prefix_caching=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def engine(checkpoints):
    old, new = checkpoints("llama")
    llm = _llm(old)
    llm.engine_core.init_weight_transfer_engine({"backend": "local"})
    yield llm, old, new
    llm.shutdown()


def _refused(llm) -> EngineNotReadyError:
    with pytest.raises(EngineNotReadyError) as refused:
        engine_greedy(llm)
    return refused.value


def _push(core, state: dict[str, torch.Tensor], version: str) -> None:
    core.start_weight_update()
    core.update_weights({"weights": state})
    core.finish_weight_update(weight_version=version)


def test_woken_without_an_update_the_engine_refuses_and_says_how_to_fix_it(engine):
    llm, old, _ = engine
    core = llm.engine_core
    core.sleep(2)
    assert core.wake_up() is True  # awake: memory back, but nothing to serve with
    refused = _refused(llm)
    assert refused.reason == "weights_discarded"
    assert "sleep(level=2)" in str(refused) and "reload_weights" in str(refused) and "weight update" in str(refused)
    params = list(core.executor.worker.model.parameters())
    assert all(not p.any() for p in params)  # zeros, not the checkpoint read back behind the caller's back
    _push(core, read_state(old), "old-again")  # leave the module's engine serving
    assert _tokens(engine_greedy(llm)) == hf_greedy(hf_model(old))


def test_a_full_update_after_sleep_2_serves_exactly_the_pushed_weights_under_their_version(engine):
    llm, _, new = engine
    core = llm.engine_core
    core.sleep(2)
    core.wake_up(["weights"])  # the RL order: weights, update, then the KV cache
    _push(core, read_state(new), "v7")
    core.wake_up(["kv_cache"])
    outputs = engine_greedy(llm)
    assert _tokens(outputs) == hf_greedy(hf_model(new))
    assert all(span.version == "v7" for o in outputs for span in o.outputs[0].weight_versions)
    assert core.get_weight_version() == "v7"
    assert core.weight_checker(hf_state_checksums(read_state(new)))["match"]


def test_a_partial_update_keeps_refusing_until_every_weight_is_written(engine):
    llm, old, new = engine
    core = llm.engine_core
    state = read_state(new)
    core.sleep(2)
    core.wake_up()
    _push(core, {"model.norm.weight": state["model.norm.weight"]}, "partial")
    assert _refused(llm).reason == "weights_discarded"  # one tensor of many: still not the trainer's model
    core.start_weight_update()  # an update that fails validation writes nothing and changes nothing
    with pytest.raises(ValueError):
        core.update_weights({"weights": {"model.norm.weight": torch.zeros(3)}})
    core.abort_weight_update()
    assert _refused(llm).reason == "weights_discarded"
    _push(core, {k: v for k, v in state.items() if k != "model.norm.weight"}, "v8")
    assert _tokens(engine_greedy(llm)) == hf_greedy(hf_model(new))
    _push(core, read_state(old), "old-again")


def test_reload_weights_reads_the_checkpoint_under_its_version(engine):
    llm, old, new = engine
    core = llm.engine_core
    _push(core, read_state(new), "trained")
    core.sleep(2)
    core.wake_up(reload_weights=True)
    assert _tokens(engine_greedy(llm)) == hf_greedy(hf_model(old))
    assert core.get_weight_version() != "trained"  # the checkpoint's version, not the discarded update's


def test_tied_embeddings_count_as_written_with_the_embedding(checkpoints):
    """A tied lm_head is an alias of the embedding: a trainer sends the embedding once (as the checkpoint
    holds it), and that writes both."""
    old, new = checkpoints("qwen3")
    llm = _llm(old)
    try:
        core = llm.engine_core
        core.init_weight_transfer_engine({"backend": "local"})
        state = read_state(new)
        assert "lm_head.weight" not in state  # tied: saved once
        core.sleep(2)
        core.wake_up()
        _push(core, state, "tied")
        assert _tokens(engine_greedy(llm)) == hf_greedy(hf_model(new))
    finally:
        llm.shutdown()
