"""The offline LLM's RL controls under vLLM's names and arguments (vLLM's LLM has the same), on a real in-process engine."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint, device="cpu") as llm:
        yield llm


def _tokens(llm) -> list[int]:
    return list(llm.generate(["The quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_sleep_wake_up_returns_whether_fully_awake(llm):
    before = _tokens(llm)
    assert llm.sleep(level=1, mode="abort") is None
    assert llm.is_sleeping() is True
    assert llm.wake_up(["weights"]) is False  # the KV cache still sleeps
    assert llm.wake_up(tags=["kv_cache"]) is True
    assert _tokens(llm) == before
    llm.sleep(0, "keep")
    assert llm.wake_up(["scheduling"]) is True
    with pytest.raises(ValueError, match="mode"):
        llm.sleep(1, mode="later")
    assert llm.is_sleeping() is False


def test_reset_prefix_cache_world_size_and_collective_rpc(llm):
    _tokens(llm)
    assert llm.reset_prefix_cache() is True
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
    (num_parameters,) = llm.collective_rpc("num_parameters")
    assert num_parameters == sum(p.numel() for p in load_file(os.path.join(llm.config.model.model,
                                                                           "model.safetensors")).values())
    with pytest.raises(ValueError, match="method"):
        llm.collective_rpc("shutdown")
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc("num_parameters", timeout=-1)


def test_compute_weight_checksums_are_vllms_keys_and_plain_sha256(llm, checkpoint):
    (checksums,) = llm.compute_weight_checksums()
    state = load_file(os.path.join(checkpoint, "model.safetensors"))
    name = "model.norm.weight"
    raw = state[name].to(torch.float32).contiguous().view(-1).view(torch.uint8).numpy()
    assert checksums["dp0:pp0:pcp0:tp0:" + name] == hashlib.sha256(raw).hexdigest()
    assert llm.weight_checker(action="compare", baseline=checksums) == {"match": True, "mismatches": []}
    changed = {**checksums, "dp0:pp0:pcp0:tp0:" + name: "0" * 64, "dp9:pp0:pcp0:tp0:extra": "1" * 64}
    assert llm.weight_checker(action="compare", baseline=changed) == {
        "match": False, "mismatches": sorted(["dp0:pp0:pcp0:tp0:" + name, "dp9:pp0:pcp0:tp0:extra"])}
    with pytest.raises(ValueError, match="baseline"):
        llm.weight_checker(action="compare")


def test_update_weights_takes_vllms_per_worker_list_and_draft_needs_a_draft(llm, tiny_checkpoint):
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    new = load_file(os.path.join(tiny_checkpoint("llama", seed=1), "model.safetensors"))
    original = load_file(os.path.join(llm.config.model.model, "model.safetensors"))
    with pytest.raises(ValueError, match="draft"):
        llm.start_draft_weight_update()
    llm.init_weight_transfer_engine({"backend": "local"})
    for weights, version in ((new, "v-list"), (original, "default")):
        llm.start_weight_update()
        # vLLM's list form: one update_info per worker in global rank order; this engine's one worker is entry 0
        llm.update_weights({"update_info": [make_update_info(weights.items(), "b64")]})
        llm.finish_weight_update(version)
        assert llm.weight_checker(hf_state_checksums(weights))["match"] is True
    assert llm.get_weight_version() == "default"
    with pytest.raises(ValueError, match="update_info"):
        llm.update_weights({"update_info": []})


def test_release_kv_cache_memory_needs_a_pause_and_wakes_with_the_kv_cache(llm):
    before = _tokens(llm)
    with pytest.raises(ValueError, match="requires a completed pause"):
        llm.release_kv_cache_memory()
    llm.pause_generation(mode="abort")
    kv_refs = [layer.kv_cache for layer in llm.engine_core.executor.worker.attn_layers]
    assert all(t is not None for t in kv_refs)
    del kv_refs
    try:
        llm.release_kv_cache_memory()
        assert llm.is_sleeping() is True
        assert all(layer.kv_cache is None for layer in llm.engine_core.executor.worker.attn_layers)
        with pytest.raises(ValueError, match="resident"):
            llm.release_kv_cache_memory()
        assert llm.wake_up(["kv_cache"]) is True
        assert all(layer.kv_cache is not None for layer in llm.engine_core.executor.worker.attn_layers)
    finally:
        llm.resume_generation()
    assert _tokens(llm) == before


def test_start_draft_weight_update_lands_an_update_without_a_model_in_the_draft(tiny_checkpoint):
    """vLLM's start_draft_weight_update: the update_info sent after it names no model and lands in the draft."""
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    path = tiny_checkpoint("llama")
    old = load_file(os.path.join(path, "model.safetensors"))
    new = load_file(os.path.join(tiny_checkpoint("llama", seed=1), "model.safetensors"))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with LLM(path, device="cpu", dtype="float32", speculative_config=spec) as llm:
        before = _tokens(llm)
        llm.init_weight_transfer_engine({"init_info": {"backend": "local", "model": "draft"}})
        llm.start_draft_weight_update()
        llm.update_weights({"update_info": make_update_info(new.items(), "b64")})  # no "model": the draft
        llm.finish_weight_update("draft-1")
        assert llm.weight_checker(hf_state_checksums(new), model="draft")["match"] is True
        assert llm.weight_checker(hf_state_checksums(old))["match"] is True  # the target is as it was
        assert _tokens(llm) == before  # speculation never changes greedy outputs
        # a plain start after it: an update without a model is the target's again
        llm.init_weight_transfer_engine({"backend": "local"})
        llm.start_weight_update()
        llm.update_weights(make_update_info(old.items(), "b64"))
        llm.finish_weight_update()
        assert llm.weight_checker(hf_state_checksums(new), model="draft")["match"] is True
