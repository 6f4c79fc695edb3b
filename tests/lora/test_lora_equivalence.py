"""Three PEFT adapters and base-model requests mixed in one batch: greedy tokens and logprobs equal HF + PEFT's
merged model, with chunked prefill, preemption, prefix caching and LRU paging of adapter slots."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from peft_reference import MAX_TOKENS

LOGPROB_TOLERANCE = 1e-4

# Engine arguments on top of the common ones; each variant must give exactly the references.
VARIANTS = {
    "one-batch": dict(max_loras=3),
    "chunked-prefill": dict(max_loras=3, max_num_batched_tokens=16),
    "preemption": dict(max_loras=3, num_gpu_blocks_override=10),
    # Two slots and two host copies for three adapters: slots are paged and adapters re-read from disk.
    "lru-paging": dict(max_loras=2, max_cpu_loras=2, max_num_batched_tokens=32),
}


def _llm(base_model, **engine_args) -> LLM:
    return LLM(base_model, dtype="float32", device="cpu", max_model_len=128, block_size=16, max_num_seqs=16,
               enable_lora=True, max_lora_rank=16, enable_prefix_caching=True, disable_log_stats=True, **engine_args)


def _assert_matches(outputs, assignment, references):
    for i, (out, name) in enumerate(zip(outputs, assignment)):
        want = references[name, i]
        completion = out.outputs[0]
        assert completion.token_ids == want.token_ids, f"prompt {i} (adapter {name})"
        got = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert max(abs(g - w) for g, w in zip(got, want.logprobs)) < LOGPROB_TOLERANCE, f"prompt {i} (adapter {name})"


def test_the_adapters_change_the_outputs(references, adapters, prompts):
    """Not a test of the engine: it makes the equality tests below meaningful (an adapter left out would fail them)."""
    for name in adapters:
        differing = [i for i in range(len(prompts)) if references[name, i].token_ids != references[None, i].token_ids]
        assert len(differing) >= len(prompts) // 2, f"adapter {name} barely changes the greedy tokens"


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_adapters_match_hf_peft_merged(base_model, adapters, prompts, assignment, references, variant):
    llm = _llm(base_model, **VARIANTS[variant])
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        loras = [adapters[name] if name else None for name in assignment]
        # lru-paging runs the batch twice: the second needs back the adapters the first one paged out.
        for _ in range(2 if variant == "lru-paging" else 1):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   lora_request=loras)
            _assert_matches(outputs, assignment, references)
        for out, lora in zip(outputs, loras):
            assert out.lora_request == lora
        scheduler = llm.engine_core.scheduler
        manager = llm.engine_core.executor.worker.lora_manager
        if variant == "preemption":
            assert scheduler.num_preemptions > 0, "the KV cache was meant to be small enough to preempt"
        if variant == "lru-paging":
            # Three adapters through two slots: at least one paged in twice, and one read from disk again.
            assert manager.num_slot_loads > len(adapters) and manager.num_disk_loads > len(adapters)
        else:
            assert manager.num_slot_loads == len(adapters)
    finally:
        llm.shutdown()


def test_qwen3_with_an_adapter_on_every_projection_matches(tiny_checkpoint, tmp_path, prompts):
    """Qwen3 (per-head q/k norms after the fused q/k/v, tied embeddings): the adapter and the base model in one batch."""
    from peft_reference import ALL_TARGETS, make_peft_adapter, reference, reference_model

    from engine import LoRARequest

    base = tiny_checkpoint("qwen3")
    lora = LoRARequest("qwen3-all", 1, make_peft_adapter(base, tmp_path / "adapter", r=8, target_modules=ALL_TARGETS))
    llm = _llm(base, max_loras=1, max_num_batched_tokens=24)
    try:
        loras = [lora, None] * 2
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                               use_tqdm=False, lora_request=loras)
    finally:
        llm.shutdown()
    models = {lora: reference_model(base, lora.lora_path), None: reference_model(base, None)}
    want = {(name, i): reference(models[lr], prompts[i], MAX_TOKENS)
            for i, (name, lr) in enumerate(zip(["a", None] * 2, loras))}
    assert want["a", 0].token_ids != reference(models[None], prompts[0], MAX_TOKENS).token_ids
    _assert_matches(outputs, ["a", None] * 2, want)
