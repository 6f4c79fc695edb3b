"""LLM with LoRA: the prefix cache is keyed by adapter, vLLM's adapter calls, and bad adapters refused by name."""

from __future__ import annotations

import json
import os

import pytest

from engine import LLM, LoRARequest, SamplingParams
from peft_reference import ALL_TARGETS, MAX_TOKENS, make_peft_adapter, make_prompts, reference, reference_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(base_model):
    llm = LLM(base_model, dtype="float32", device="cpu", max_model_len=128, block_size=16, enable_lora=True,
              max_loras=2, max_lora_rank=8, disable_log_stats=True)
    yield llm
    llm.shutdown()


def _generate(llm, prompt, lora):
    return llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False, lora_request=lora)[0]


def test_the_same_prompt_shares_cached_blocks_only_with_its_own_adapter(llm, base_model, adapters):
    prompt = make_prompts(seed=5)[7]  # 50 tokens: three full blocks of 16 may hit
    full = 3 * 16
    qv, mixed = adapters["qv"], adapters["mixed"]
    want = {lora: reference(reference_model(base_model, lora.lora_path if lora else None), prompt, MAX_TOKENS).token_ids
            for lora in (qv, mixed, None)}
    # The same prompt under two adapters in one batch, then each again, then the base model.
    first = llm.generate([{"prompt_token_ids": prompt}] * 2, PARAMS, use_tqdm=False, lora_request=[qv, mixed])
    assert [o.num_cached_tokens for o in first] == [0, 0]
    again = [_generate(llm, prompt, lora) for lora in (qv, mixed, None)]
    assert [o.num_cached_tokens for o in again] == [full, full, 0]
    for out, lora in zip([*first, *again], [qv, mixed, qv, mixed, None]):
        assert out.outputs[0].token_ids == want[lora]
    # Loaded again, an adapter gets a new cache key: its files may have changed (a trainer saved more steps).
    assert llm.remove_lora(qv.lora_int_id) is True
    assert _generate(llm, prompt, qv).num_cached_tokens == 0


def test_add_list_pin_remove(llm, adapters):
    qv, mixed = adapters["qv"], adapters["mixed"]
    assert llm.add_lora(qv) is True and llm.add_lora(mixed) is True
    assert llm.add_lora(qv) is True  # already loaded
    assert {qv.lora_int_id, mixed.lora_int_id} <= set(llm.list_loras())
    assert llm.pin_lora(mixed.lora_int_id) is True
    assert llm.remove_lora(mixed.lora_int_id) is True
    assert mixed.lora_int_id not in llm.list_loras()
    assert llm.remove_lora(mixed.lora_int_id) is False
    with pytest.raises(ValueError, match="not loaded"):
        llm.pin_lora(mixed.lora_int_id)


@pytest.fixture(scope="module")
def bad_adapters(base_model, tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[LoRARequest, str]]:
    """name -> (an adapter the engine must refuse, a phrase its error names)."""
    def made(name, base=base_model, **spec):
        return make_peft_adapter(base, tmp_path_factory.mktemp(f"bad-{name}"), **spec)

    lm_head = made("lm-head", r=4, target_modules=["q_proj", "lm_head"])
    wider = made("other-model", base=tiny_checkpoint("llama", intermediate_size=96), r=4, target_modules=ALL_TARGETS)
    deeper = made("deeper-model", base=tiny_checkpoint("llama", num_hidden_layers=3), r=4, target_modules=["q_proj"])
    dora = made("dora", r=4, target_modules=["q_proj"], use_dora=True)
    rank16 = made("rank16", r=16, target_modules=["q_proj"])
    # A config edited to name a module the model does not have (the tensors still name q_proj's).
    renamed = made("renamed", r=4, target_modules=["q_proj"])
    with open(os.path.join(renamed, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(renamed, "adapter_config.json"), "w") as f:
        json.dump({**config, "target_modules": ["q_proj", "c_attn"]}, f)
    cases = {
        "unknown path": ("/nonexistent/adapter", "not a PEFT adapter directory"),
        "rank above max_lora_rank": (rank16, r"rank 16 is above max_lora_rank \(8\)"),
        "unsupported target module": (lm_head, "target module 'lm_head' is not supported"),
        "target module the model lacks": (renamed, "target module 'c_attn' is not supported"),
        "shape mismatch": (wider, "shape mismatch for model.layers.0.mlp"),
        "a layer the model lacks": (deeper, "targets 'model.layers.2.self_attn.q_proj', which is not a module of this model"),
        "DoRA": (dora, "use_dora=True is not supported"),
    }
    return {name: (LoRARequest(name.replace(" ", "-"), 100 + i, path), phrase)
            for i, (name, (path, phrase)) in enumerate(cases.items())}


@pytest.mark.parametrize("case", ["unknown path", "rank above max_lora_rank", "unsupported target module",
                                  "target module the model lacks", "shape mismatch", "a layer the model lacks", "DoRA"])
def test_a_bad_adapter_is_refused_by_name_and_the_engine_serves_on(llm, base_model, adapters, bad_adapters, case):
    lora, phrase = bad_adapters[case]
    num_requests = llm.engine_core.scheduler.get_num_unfinished_requests()
    with pytest.raises(ValueError, match=phrase):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, PARAMS, use_tqdm=False, lora_request=[adapters["qv"], lora])
    with pytest.raises(ValueError, match=phrase):
        llm.add_lora(lora)
    assert llm.engine_core.scheduler.get_num_unfinished_requests() == num_requests  # nothing was queued
    assert lora.lora_int_id not in llm.list_loras()
    prompt = make_prompts(seed=6)[2]
    out = llm.generate([{"prompt_token_ids": prompt}] * 2, PARAMS, use_tqdm=False, lora_request=[adapters["qv"], None])
    assert out[0].outputs[0].token_ids == reference(
        reference_model(base_model, adapters["qv"].lora_path), prompt, MAX_TOKENS).token_ids
    assert out[1].outputs[0].token_ids == reference(reference_model(base_model, None), prompt, MAX_TOKENS).token_ids


def test_an_id_taken_by_another_adapter_is_refused(llm, adapters):
    qv, mixed = adapters["qv"], adapters["mixed"]
    llm.add_lora(qv)
    with pytest.raises(ValueError, match=f"lora_int_id {qv.lora_int_id} is already loaded as 'qv'"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False,
                     lora_request=LoRARequest("impostor", qv.lora_int_id, mixed.lora_path))


def test_lora_request_without_enable_lora_is_refused(base_model, adapters):
    llm = LLM(base_model, dtype="float32", device="cpu", max_model_len=64, disable_log_stats=True)
    try:
        with pytest.raises(ValueError, match="LoRA is off"):
            llm.generate("Hello", PARAMS, use_tqdm=False, lora_request=adapters["qv"])
        with pytest.raises(ValueError, match="LoRA is off"):
            llm.add_lora(adapters["qv"])
        assert llm.generate("Hello", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_malformed_lora_requests_name_the_field(llm):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/a")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1, "")
    with pytest.raises(ValueError, match="lora_request: 2 given for 1 prompts"):
        llm.generate(["Hi"], PARAMS, use_tqdm=False, lora_request=[None, None])
