"""Keep-mode pause, a local-backend weight update and resume, with the engine in its own process.

The rollout's weight_versions spans switch at the token where the update landed; tokens
before it are the old weights' greedy tokens and tokens after it are what HF transformers
holding the NEW weights generates from the same prefix (the in-flight request's KV is
recomputed with the new weights).
"""

from __future__ import annotations

import asyncio
import os

import pytest
from hf_reference import hf_greedy
from safetensors.numpy import load_file

from engine.async_llm import AsyncLLM
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow

MAX_TOKENS = 40


def test_keep_pause_update_resume_switches_versions_at_the_right_token(tiny_checkpoint, tmp_path):
    old_path = tiny_checkpoint("llama")
    new_path = make_tiny_checkpoint(tmp_path / "new", "llama", seed=1)
    new_weights = load_file(os.path.join(new_path, "model.safetensors"))
    prompt_ids = list(range(10, 30))

    llm = AsyncLLM.from_engine_args(model=old_path, multiprocess=True, device="cpu", dtype="float32",
                                    max_model_len=256, disable_log_stats=True)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                output_kind=RequestOutputKind.CUMULATIVE)
        outputs = []
        paused = asyncio.Event()

        async def consume():
            async for out in llm.generate({"prompt_token_ids": prompt_ids}, params, "rollout"):
                outputs.append(out)
                if len(out.outputs[0].token_ids) >= 8 and not paused.is_set():
                    paused.set()

        task = asyncio.create_task(consume())
        await paused.wait()
        await llm.pause_generation("keep")
        await asyncio.sleep(0.2)  # nothing may arrive while frozen
        num_before = len(outputs[-1].outputs[0].token_ids)
        assert not outputs[-1].finished

        await llm.init_weight_transfer_engine({"backend": "local"})
        await llm.start_weight_update()
        await llm.update_weights({"weights": new_weights})  # numpy arrays travel as ZMQ frames
        await llm.finish_weight_update(weight_version="v1")
        assert len(outputs[-1].outputs[0].token_ids) == num_before
        await llm.resume_generation()
        await asyncio.wait_for(task, timeout=60)
        return num_before, outputs[-1].outputs[0]

    try:
        num_before, completion = asyncio.run(main())
    finally:
        llm.shutdown()

    tokens = completion.token_ids
    assert len(tokens) == MAX_TOKENS
    assert completion.weight_versions == [("default", 0, num_before), ("v1", num_before, MAX_TOKENS)]
    assert tokens[:num_before] == hf_greedy(old_path, prompt_ids, num_before)
    assert tokens[num_before:] == hf_greedy(new_path, prompt_ids + tokens[:num_before], MAX_TOKENS - num_before)
