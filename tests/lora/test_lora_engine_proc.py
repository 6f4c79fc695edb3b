"""LoRA through the EngineCore in its own process over real ZMQ: AsyncLLM with mixed adapters, and the engine's own checks."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_llm import AsyncLLM
from engine.engine_args import create_engine_config
from engine.lora.request import LoRARequest
from engine.mp_client import SyncMPClient
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest, FinishReason
from peft_reference import MAX_TOKENS

pytestmark = pytest.mark.slow

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=16,
                   disable_log_stats=True)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def test_async_llm_serves_mixed_adapters_and_refuses_a_bad_one(base_model, adapters, prompts, assignment, references):
    llm = AsyncLLM.from_engine_args(model=base_model, multiprocess=True, **ENGINE_ARGS)

    async def run(i: int, name: str | None):
        lora = adapters[name] if name else None
        final = None
        async for out in llm.generate({"prompt_token_ids": prompts[i]}, PARAMS, f"r{i}", lora_request=lora):
            final = out
        return final

    async def bad():
        with pytest.raises(ValueError, match="not a PEFT adapter directory"):
            async for _ in llm.generate("Hello", PARAMS, "bad", lora_request=LoRARequest("gone", 9, "/no/such/dir")):
                pass

    async def main():
        outputs = await asyncio.gather(*(run(i, name) for i, name in enumerate(assignment)), bad())
        # The adapter calls cross the process boundary as the LoRARequest's dict.
        loaded = await llm.list_loras()
        removed = await llm.remove_lora(adapters["qv"].lora_int_id)
        return outputs[:-1], loaded, removed, await llm.list_loras()

    try:
        outputs, loaded, removed, after = asyncio.run(main())
    finally:
        llm.shutdown()
    for i, (out, name) in enumerate(zip(outputs, assignment)):
        want = references[name, i]
        completion = out.outputs[0]
        assert completion.token_ids == want.token_ids, f"prompt {i} (adapter {name})"
        got = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert max(abs(g - w) for g, w in zip(got, want.logprobs)) < 1e-4
    # max_cpu_loras defaults to max_loras (2): the engine keeps the two adapters used last.
    assert len(loaded) == 2 and set(loaded) < {a.lora_int_id for a in adapters.values()}
    assert removed is (adapters["qv"].lora_int_id in loaded)
    assert adapters["qv"].lora_int_id not in after


def test_the_engine_validates_an_adapter_a_request_brings_over_zmq(base_model, adapters, prompts, references):
    """A frontend that skips add_lora: the EngineCore reads the adapter on arrival and refuses a bad one alone."""
    client = SyncMPClient(create_engine_config(model=base_model, **ENGINE_ARGS))
    try:
        good = EngineCoreRequest("good", prompts[2], PARAMS, None, lora_request=adapters["all"])
        bad = EngineCoreRequest("bad", prompts[2], PARAMS, None, lora_request=LoRARequest("gone", 9, "/no/such/dir"))
        client.add_request(bad)
        client.add_request(good)
        tokens, finished = [], {}
        while len(finished) < 2:
            for out in client.get_output().outputs:
                if out.request_id == "good":
                    tokens += out.new_token_ids
                if out.finished:
                    finished[out.request_id] = out
        assert finished["bad"].finish_reason == FinishReason.ERROR
        assert "not a PEFT adapter directory" in finished["bad"].stop_reason
        assert tokens == references["all", 2].token_ids
        assert client.call_utility("list_loras") == [adapters["all"].lora_int_id]
    finally:
        client.shutdown()
