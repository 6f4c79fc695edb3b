"""Scheduler with speculative decoding, driven by a fake runner that verifies drafts and checks the KV it reads."""

from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, SchedulerConfig, SpecDecodeSettings
from engine.core.scheduler import Scheduler
from engine.worker.runner_output import ModelRunnerOutput
from tests.core.test_scheduler import BS, default_next_token, make_request, reference_tokens, run


class FakeSpecRunner:
    """Deterministic model (default_next_token) with a KV cache of (token, position) per slot.

    A step writes every scheduled token, drafts included, then each row checks that it reads its
    known tokens back at positions [0, its last known token]; it emits the drafts that equal the
    model's tokens plus one of its own, and proposes k drafts of which a random one is wrong.
    """

    def __init__(self, k, lookahead, seed=0):
        self.k, self.lookahead = k, lookahead
        self.rng = random.Random(seed)
        self.reqs = {}  # req_id -> [known token_ids, block_ids, num_computed]
        self.kv = {}

    def slot(self, block_ids, pos):
        return block_ids[pos // BS] * BS + pos % BS

    def execute(self, out):
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.reqs[new.req_id] = [list(new.token_ids), list(new.block_ids), new.num_computed_tokens]
        cached = out.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.reqs[req_id]
            assert num_computed <= len(state[0])  # rolled back to its known tokens at most
            state[1] += new_block_ids or []
            state[2] = num_computed
        req_ids, sampled, drafts_out = [], [], []
        for req_id, num in out.num_scheduled_tokens.items():
            known, block_ids, start = self.reqs[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            inputs = known + drafts
            end = start + num
            assert end == len(inputs) or (not drafts and end < len(known)), (req_id, start, num, len(inputs))
            # Slots for the step's tokens and the draft model's lookahead are allocated.
            assert len(block_ids) * BS >= end + min(self.lookahead, 64 - end)
            for pos in range(start, end):
                self.kv[self.slot(block_ids, pos)] = (inputs[pos], pos)
            for pos in range(min(end, len(known))):
                assert self.kv[self.slot(block_ids, pos)] == (known[pos], pos), (req_id, pos)
            req_ids.append(req_id)
            if end < len(known):  # a prompt chunk
                sampled.append([])
                drafts_out.append([])
                continue
            emitted = []
            for d in drafts + [None]:
                token = default_next_token(known)
                known.append(token)
                emitted.append(token)
                if d != token:
                    break
            sampled.append(emitted)
            proposal, probe = [], list(known)
            wrong = self.rng.randrange(self.k + 1)  # k: all right
            for j in range(self.k):
                token = default_next_token(probe)
                probe.append(token)
                proposal.append(token if j != wrong else (token + 1) % 100)
            drafts_out.append(proposal)
        return ModelRunnerOutput(req_ids, sampled, spec_token_ids=drafts_out)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("num_blocks", [64, 16])
def test_verified_drafts_give_the_model_tokens_with_rollback_and_preemption(method, num_blocks):
    k = 3
    spec = SpecDecodeSettings(method=method, num_speculative_tokens=k, model="x" if method == "draft_model" else None)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
                      CacheConfig(block_size=BS, enable_prefix_caching=True), 64, num_blocks, spec)
    prompts = {f"r{i}": [1 + i, 2, 3, 4, 5, 6, 7][: 3 + i] * 2 for i in range(5)}
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(req_id, prompt, max_tokens=13 + 2 * int(req_id[1:]), ignore_eos=True))
    runner = FakeSpecRunner(k, sched.num_lookahead_tokens)
    tokens, finals = run(sched, runner)
    for req_id, prompt in prompts.items():
        assert tokens[req_id] == reference_tokens(prompt, 13 + 2 * int(req_id[1:]))  # max_tokens exactly, no more
    totals = sched.spec_totals
    assert totals.num_drafts > 0 and 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    assert sched.num_lookahead_tokens == (k if method == "draft_model" else 0)
    if num_blocks == 16:
        assert sched.num_preemptions > 0


def test_prefix_cache_registers_only_known_tokens():
    """Drafts fill block slots too, but a block enters the prefix cache only when its tokens are known."""
    spec = SpecDecodeSettings(method="ngram", num_speculative_tokens=3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), CacheConfig(block_size=BS), 64, 64, spec)
    prompt = [9, 8, 7, 6, 5, 4]
    sched.add_request(make_request("a", prompt, max_tokens=10, ignore_eos=True))
    runner = FakeSpecRunner(3, 0)
    run(sched, runner)
    # A second request with a's prompt and first output tokens hits exactly the full blocks of known tokens.
    known = prompt + reference_tokens(prompt, 10)
    sched.add_request(make_request("b", known[:12], max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8  # 2 full blocks; the 3rd holds the last token
