"""Bad input raises ValueError naming the field, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=64, device="cpu")


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        # Non-finite floats pass every range check (NaN compares false to everything): refused by name.
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias\[5\]"),
        ({"logit_bias": {5: float("-inf")}}, r"logit_bias\[5\]"),
        # The sampler computes in float32: 5e-324 is 0 there (it once sampled an id past the vocabulary), 1e39 inf.
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"logit_bias": {5: 1e39}}, r"logit_bias\[5\]"),
        ({"temperature": 1e39}, "temperature"),
        # Integers past 64 bits never reach msgspec or torch.
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"top_k": 2**70}, "top_k"),
        ({"n": 2**64}, "n"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logit_bias": {2**64: 1.0}}, "logit_bias"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_over_max_model_len_is_rejected_and_the_engine_keeps_serving(llm):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = llm.generate("hello there", good, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["hello there", {"prompt_token_ids": [5] * 65}], good, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()  # the good prompt was not left behind
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**9]), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": []}, good, use_tqdm=False)
    assert llm.generate("hello there", good, use_tqdm=False)[0].outputs[0].token_ids == before


def test_output_length_follows_vllm_033(llm):
    """A prompt must leave room for one output token (vLLM's input check); a max_tokens past what is left
    is not refused: the output stops at max_model_len with finish_reason "length", as vLLM clamps it."""
    with pytest.raises(ValueError, match="^prompt: .*max_model_len=64"):
        llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="routed_experts_prompt_start"):
        SamplingParams(routed_experts_prompt_start=-1)


def test_unknown_architecture_names_the_field(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(dst), device="cpu")


def test_bad_engine_args_name_the_field(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, max_model_len=10**6, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        LLM(path, dtype="int3", device="cpu")
    with pytest.raises(ValueError, match="model"):
        LLM("/nonexistent/dir", device="cpu")


def test_what_the_engine_cannot_hold_is_refused_before_any_work(llm):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="n must be at most max_num_seqs=256"):
        llm.generate("hi", SamplingParams(n=257), use_tqdm=False)
    # Far more characters than max_model_len tokens can spell: refused from its length, untokenized.
    with pytest.raises(ValueError, match="characters cannot fit max_model_len=64"):
        llm.generate("word " * 1_000_000, good, use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate("hi", good, priority=[2**64], use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


def test_text_that_is_not_valid_unicode_is_refused_by_name(llm):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt: not valid text"):
        llm.generate("\ud800abc", good, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt: not valid text"):
        llm.chat([{"role": "user", "content": "hi \udfff"}], good, use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words: not valid text"):
        llm.generate("hi", SamplingParams(bad_words=["\ud800"]), use_tqdm=False)
    assert llm.generate("\U0001f600", good, use_tqdm=False)[0].outputs[0].finish_reason == "length"
