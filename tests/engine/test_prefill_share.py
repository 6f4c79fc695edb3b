"""Shared prefill (engine/worker/prefill_share.py): equal-context rows run once and give what they give alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.input_batch import InputBatch
from engine.worker.model_runner import ModelRunner
from engine.worker.prefill_share import copy_kv_slots, fold_shared_rows
from engine.worker.request_state import RequestState

PLACEHOLDER = -1


def _batch(state: RequestState, rows: list[tuple[int, list[int], int]], block_size: int = 4) -> InputBatch:
    """A batch of (slot, context tokens, tokens already computed) rows, each scheduling the rest."""
    slots, num_sched, seq_lens, ids, pos, slot_map = [], [], [], [], [], []
    for slot, tokens, start in rows:
        state.token_ids[slot, : len(tokens)] = tokens
        state.block_table[slot, :4] = np.arange(4) + 4 * slot
        slots.append(slot)
        num_sched.append(len(tokens) - start)
        seq_lens.append(len(tokens))
        for p in range(start, len(tokens)):
            ids.append(tokens[p])
            pos.append(p)
            slot_map.append(int(state.block_table[slot, p // block_size]) * block_size + p % block_size)
    qsl = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(num_sched, out=qsl[1:])
    sample_rows = np.arange(len(rows))
    return InputBatch(
        req_ids=[f"r{i}" for i in range(len(rows))], slots=np.array(slots, dtype=np.int64),
        num_scheduled_tokens=np.array(num_sched, dtype=np.int64), query_start_loc=qsl,
        seq_lens=np.array(seq_lens, dtype=np.int32), input_ids=np.array(ids, dtype=np.int64),
        positions=np.array(pos, dtype=np.int64), slot_mapping=np.array(slot_map, dtype=np.int64),
        block_table=state.block_table[slots, :4], sample_rows=sample_rows,
        logits_indices=qsl[1:].astype(np.int64) - 1,
    )


def test_fold_keeps_one_row_per_context_and_maps_the_others_onto_it():
    state = RequestState(8, 16, 4)
    p, q = [5, 6, 7], [5, 6, 8]
    #        row:  0       1       2       3                  4 (decode)   5 (other adapter)
    batch = _batch(state, [(0, p, 0), (1, p, 0), (2, q, 0), (3, p, 0), (4, [9, 9, 9, 9], 3), (5, p, 0)])
    state.lora_ids[5] = 1
    shared = fold_shared_rows(batch, state, PLACEHOLDER)
    assert shared is not None
    folded = shared.batch
    assert folded.req_ids == ["r0", "r2", "r4", "r5"]
    assert folded.query_start_loc.tolist() == [0, 3, 6, 7, 10]
    assert folded.input_ids.tolist() == p + q + [9] + p
    assert folded.sample_rows.tolist() == [0, 1, 2, 3]
    # Full batch's rows 0..5 take the hidden row of: r0's last, r0's, r2's, r0's, r4's, r5's.
    assert shared.logits_indices.tolist() == [2, 2, 5, 2, 6, 9]
    # Rows 1 and 3 get row 0's KV, position by position.
    assert shared.src_slots.tolist() == [0, 1, 2, 0, 1, 2]
    assert shared.dst_slots.tolist() == [16, 17, 18, 48, 49, 50]


def test_fold_leaves_excluded_placeholder_and_distinct_rows_alone():
    state = RequestState(8, 16, 4)
    p = [5, 6, 7]
    assert fold_shared_rows(_batch(state, [(0, p, 0), (1, [5, 6, 8], 0)]), state, PLACEHOLDER) is None
    # Same tokens but a different number already computed: not the same computation.
    assert fold_shared_rows(_batch(state, [(0, p, 0), (1, p, 1)]), state, PLACEHOLDER) is None
    batch = _batch(state, [(0, p, 0), (1, p, 0)])
    assert fold_shared_rows(batch, state, PLACEHOLDER, exclude=np.array([False, True])) is None
    state.token_ids[1, 2] = PLACEHOLDER
    batch = _batch(state, [(0, [5, 6, PLACEHOLDER], 0), (1, [5, 6, PLACEHOLDER], 0)])
    assert fold_shared_rows(batch, state, PLACEHOLDER) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_kv_slots_copies_every_layer_position_by_position(dtype):
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 3, 4, 2, 8, generator=gen).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    copy_kv_slots(caches, torch.tensor([0, 1, 5]), torch.tensor([8, 9, 2]))
    for c, b in zip(caches, before):
        flat, old = c.view(2, 12, 2, 8).view(torch.uint8), b.view(2, 12, 2, 8).view(torch.uint8)
        for src, dst in ((0, 8), (1, 9), (5, 2)):
            assert torch.equal(flat[:, dst], old[:, src])
        untouched = [s for s in range(12) if s not in (8, 9, 2)]
        assert torch.equal(flat[:, untouched], old[:, untouched])


def _workload(vocab_size: int):
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(10):
        length = rng.choice([3, 6, 17, 40])  # under and over a block: prefix-cache hits for the long ones
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(length)]})
        kind = i % 4
        if kind == 0:  # the RL shape: n samples, seeded, logprobs of the sampled tokens
            params.append(SamplingParams(n=8, temperature=1.0, seed=10 * i, max_tokens=12, logprobs=0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(n=3, temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))
        elif kind == 2:  # a prompt_logprobs child keeps its own prefill
            params.append(SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=4, prompt_logprobs=1))
        else:
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=10, ignore_eos=True))
    prompts.append(prompts[0])  # the same prompt in another request too
    params.append(SamplingParams(n=4, temperature=1.0, seed=999, max_tokens=12, logprobs=0, ignore_eos=True))
    return prompts, params


def _flat(outs):
    return [(o.request_id, c.index, c.token_ids, c.logprobs, o.prompt_logprobs) for o in outs for c in o.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_shared_prefill_outputs_equal_running_every_row(tiny_checkpoint, monkeypatch, async_scheduling):
    path = tiny_checkpoint("llama")
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=128, async_scheduling=async_scheduling,
              block_size=16)
    prompts, params = _workload(llm.engine_core.vocab_size)
    folds = []
    real = ModelRunner._shared_prefill

    def counting(self, batch, routing_rows):
        shared = real(self, batch, routing_rows)
        folds.append(0 if shared is None else batch.num_reqs - shared.batch.num_reqs)
        return shared

    monkeypatch.setattr(ModelRunner, "_shared_prefill", counting)
    shared_outs = _flat(llm.generate(prompts, params, use_tqdm=False))
    assert sum(folds) >= 7 * 3 + 2 * 2  # the n=8 and n=3 children (and the repeated prompt) were folded
    monkeypatch.setattr(ModelRunner, "_shared_prefill", lambda self, batch, routing_rows: None)
    alone_outs = _flat(llm.generate(prompts, params, use_tqdm=False))
    assert len(shared_outs) == len(alone_outs)
    for (_, idx, tokens, lps, plps), (_, idx2, tokens2, lps2, plps2) in zip(shared_outs, alone_outs):
        assert idx == idx2 and tokens == tokens2
        assert (lps is None) == (lps2 is None)
        for row, row2 in zip(lps or [], lps2 or []):
            assert list(row) == list(row2)
            for tid in row:
                assert row[tid].logprob == pytest.approx(row2[tid].logprob, abs=1e-5)
                assert row[tid].rank == row2[tid].rank
        assert (plps is None) == (plps2 is None)
        for row, row2 in zip(plps or [], plps2 or []):
            assert (row is None and row2 is None) or list(row) == list(row2)
