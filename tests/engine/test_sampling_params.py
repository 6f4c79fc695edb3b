"""Every SamplingParams field, shown to act through the whole engine (LLM.generate)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, RepetitionDetectionParams, SamplingParams

PROMPT = "The scheduler decides which requests run"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=512, device="cpu")


def gen(llm, params, prompt=PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0]


def greedy_ids(llm, max_tokens=16, prompt=PROMPT):
    return gen(llm, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), prompt).outputs[0].token_ids


def seeded(seed=7, **kw):
    kw = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True, **kw}
    return SamplingParams(seed=seed, **kw)


def test_n_gives_n_completions_sharing_the_prompt_blocks(llm):
    prompt = " ".join(["blocks of a fixed size"] * 12)
    llm.reset_prefix_cache()
    hits_before = llm.engine_core.scheduler.kv_cache_manager.total_prefix_cache_hits
    out = gen(llm, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8), prompt)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # A hit always leaves the last prompt token to compute, so it covers (len - 1) // 16 blocks.
    full_blocks = (len(out.prompt_token_ids) - 1) // 16
    assert full_blocks >= 2
    hits = llm.engine_core.scheduler.kv_cache_manager.total_prefix_cache_hits - hits_before
    assert hits >= 3 * full_blocks * 16  # children 1..3 reuse child 0's full prompt blocks


def test_temperature_zero_is_greedy_and_sampling_differs(llm):
    greedy = greedy_ids(llm)
    assert gen(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, seed=5)).outputs[0].token_ids == greedy
    hot = [gen(llm, seeded(seed=s, temperature=2.0)).outputs[0].token_ids for s in range(3)]
    assert any(h != greedy for h in hot)


def test_top_k_1_top_p_tiny_and_min_p_1_collapse_to_greedy(llm):
    greedy = greedy_ids(llm)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert gen(llm, SamplingParams(temperature=1.5, seed=11, max_tokens=16, ignore_eos=True, **kw)).outputs[0].token_ids == greedy, kw
    # Without the restriction the same seed wanders off greedy.
    assert gen(llm, SamplingParams(temperature=1.5, seed=11, max_tokens=16, ignore_eos=True)).outputs[0].token_ids != greedy


def test_top_k_limits_choices_to_the_k_best(llm):
    for k in (2, 3):
        out = gen(llm, seeded(seed=1, temperature=3.0, top_k=k, max_tokens=24, logprobs=0)).outputs[0]
        ranks = [pos[t].rank for t, pos in zip(out.token_ids, out.logprobs)]
        assert max(ranks) <= k and max(ranks) > 1, ranks
    wide = gen(llm, seeded(seed=1, temperature=3.0, max_tokens=24, logprobs=0)).outputs[0]
    assert max(pos[t].rank for t, pos in zip(wide.token_ids, wide.logprobs)) > 3


def test_penalties_change_repetition(llm):
    base = greedy_ids(llm, 32)
    for kw in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        ids = gen(llm, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **kw)).outputs[0].token_ids
        assert ids != base, kw
        assert len(set(ids)) >= len(set(base)), kw


def test_seed_reproducible_and_different_seeds_differ(llm):
    a = gen(llm, seeded(1)).outputs[0].token_ids
    assert gen(llm, seeded(1)).outputs[0].token_ids == a
    assert gen(llm, seeded(2)).outputs[0].token_ids != a


def test_seeded_request_same_alone_in_batch_and_in_other_order(llm):
    target = ("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True))
    alone = llm.generate(target[0], target[1], use_tqdm=False)[0].outputs[0].token_ids
    rng = random.Random(0)
    others = []
    for i in range(30):
        words = rng.choice(["The dog", "A rollout is", "Numbers appear", "café", "What is two"])
        params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]),
                                seed=rng.choice([None, i]), max_tokens=rng.randint(4, 30), ignore_eos=True)
        others.append((words * rng.randint(1, 6), params))
    batch = others[:13] + [target] + others[13:]
    outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    assert outs[13].outputs[0].token_ids == alone
    reordered = [target] + others[::-1]
    outs = llm.generate([p for p, _ in reordered], [s for _, s in reordered], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone


def test_stop_strings(llm):
    full = gen(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)).outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    cut = gen(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])).outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = gen(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                   include_stop_str_in_output=True)).outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids(llm):
    ids = greedy_ids(llm, 16)
    stop_id = ids[5]
    out = gen(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == ids[: ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_max_tokens_and_ignore_eos_and_min_tokens(llm):
    eos = llm.get_tokenizer().eos_token_id
    force_eos = {eos: 100.0}
    out = gen(llm, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)).outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stops = gen(llm, SamplingParams(temperature=0, max_tokens=7, logit_bias=force_eos)).outputs[0]
    assert stops.token_ids == [eos] and stops.finish_reason == "stop"
    ignores = gen(llm, SamplingParams(temperature=0, max_tokens=7, logit_bias=force_eos, ignore_eos=True)).outputs[0]
    assert ignores.token_ids == [eos] * 7 and ignores.finish_reason == "length"
    waits = gen(llm, SamplingParams(temperature=0, max_tokens=20, logit_bias=force_eos, min_tokens=5)).outputs[0]
    assert len(waits.token_ids) == 6 and eos not in waits.token_ids[:5] and waits.token_ids[5] == eos


def test_logit_bias_and_allowed_token_ids(llm):
    out = gen(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={77: 50.0})).outputs[0]
    assert out.token_ids == [77] * 6
    allowed = [40, 41, 42]
    out = gen(llm, SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)).outputs[0]
    assert set(out.token_ids) <= set(allowed)


def test_bad_words(llm):
    tok = llm.get_tokenizer()
    ids = greedy_ids(llm, 24)
    # A word of the greedy output whose own tokenization appears in it (so banning it must act).
    word, seq = next(
        (w, enc)
        for t in ids
        if (w := tok.decode([t]).strip()).isalpha()
        for enc in (tok.encode(w, add_special_tokens=False), tok.encode(" " + w, add_special_tokens=False))
        if any(ids[i : i + len(enc)] == enc for i in range(len(ids)))
    )
    out = gen(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word])).outputs[0]
    for banned in (tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)):
        assert not any(out.token_ids[i : i + len(banned)] == banned for i in range(len(out.token_ids))), banned
    assert out.token_ids != ids


def test_logprobs_sampled_plus_top_k_with_ranks(llm):
    out = gen(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)).outputs[0]
    assert len(out.logprobs) == 8
    total = 0.0
    for token, pos in zip(out.token_ids, out.logprobs):
        assert token in pos and pos[token].rank == 1  # greedy picks the top token
        assert len(pos) == 3  # the sampled token is one of the top 3
        ranks = sorted(lp.rank for lp in pos.values())
        assert ranks == [1, 2, 3]
        assert all(lp.decoded_token is not None for lp in pos.values())
        total += pos[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)
    sampled = gen(llm, SamplingParams(temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, logprobs=0)).outputs[0]
    assert all(len(pos) == 1 for pos in sampled.logprobs)
    assert any(next(iter(pos.values())).rank > 1 for pos in sampled.logprobs)


def test_skip_special_tokens_and_detokenize(llm):
    tok = llm.get_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    params = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={im_end: 100.0})
    skipped = gen(llm, SamplingParams(**params)).outputs[0]
    assert skipped.token_ids == [im_end] * 3 and skipped.text == ""
    shown = gen(llm, SamplingParams(**params, skip_special_tokens=False)).outputs[0]
    assert shown.text.replace(" ", "") == "<|im_end|>" * 3
    raw = gen(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, detokenize=False)).outputs[0]
    assert raw.text == "" and len(raw.token_ids) == 5


def test_repetition_detection_ends_the_request(llm):
    loop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={50: 60.0, 51: 59.0},
                          repetition_detection=RepetitionDetectionParams(max_pattern_size=3, min_count=4))
    out = gen(llm, loop).outputs[0]
    assert out.finish_reason == "repetition"
    assert len(out.token_ids) < 30
    plain = gen(llm, loop.clone(repetition_detection=None)).outputs[0]
    assert plain.finish_reason == "length" and len(plain.token_ids) == 30


def test_logprobs_mode_processed_applies_temperature(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.5, seed=9, max_tokens=4, ignore_eos=True, logprobs=1)
    raw = LLM(path, dtype="float32", max_model_len=128, device="cpu", logprobs_mode="raw_logprobs")
    processed = LLM(path, dtype="float32", max_model_len=128, device="cpu", logprobs_mode="processed_logprobs")
    a = gen(raw, params).outputs[0]
    b = gen(processed, params).outputs[0]
    assert a.token_ids == b.token_ids
    la = a.logprobs[0][a.token_ids[0]].logprob
    lb = b.logprobs[0][b.token_ids[0]].logprob
    assert la != pytest.approx(lb, abs=1e-3)
    assert lb > la  # a temperature below 1 sharpens the sampled (likely) token's probability


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt.startswith("<|im_start|>user\nHello!<|im_end|>")
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
