"""ModelRunner._split_logprobs: each sampled row gets its own positions and as many top entries as it asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sample import LogprobsTensors
from engine.worker.input_batch import InputBatch
from engine.worker.model_runner import ModelRunner


def batch_of(num_reqs: int, sample_rows: list[int]) -> InputBatch:
    zeros = np.zeros(num_reqs, dtype=np.int64)
    return InputBatch(req_ids=[f"r{i}" for i in range(num_reqs)], slots=np.arange(num_reqs),
                      num_scheduled_tokens=zeros + 1, query_start_loc=np.arange(num_reqs + 1, dtype=np.int32),
                      seq_lens=zeros.astype(np.int32) + 5, input_ids=zeros, positions=zeros, slot_mapping=zeros,
                      block_table=np.zeros((num_reqs, 1), np.int32), sample_rows=np.array(sample_rows, dtype=np.int64),
                      logits_indices=np.array(sample_rows))


@pytest.mark.parametrize("sample_rows, counts", [
    ([0, 1, 2, 3], [2, 2, 2, 2]),  # every row, one width: the rows' views made at once
    ([0, 1, 2, 3], [0, 0, 0, 0]),
    ([0, 1, 2, 3], [2, -1, 0, 2]),  # widths differ, a row asks for none
    ([1, 3], [1, 1]),  # not every row samples
    ([0, 1, 2, 3], [-1, -1, -1, -1]),
])
def test_each_row_gets_its_positions_and_width(sample_rows, counts):
    num_reqs, width = 4, 3
    rng = np.random.default_rng(0)
    lp = LogprobsTensors(torch.from_numpy(rng.integers(0, 50, (len(sample_rows), width))),
                         torch.from_numpy(rng.standard_normal((len(sample_rows), width)).astype(np.float32)),
                         torch.from_numpy(rng.integers(1, 50, len(sample_rows))))
    rows = ModelRunner._split_logprobs(batch_of(num_reqs, sample_rows), np.array(counts), lp)
    assert len(rows) == num_reqs
    entry_of = {row: i for i, row in enumerate(sample_rows)}
    for row in range(num_reqs):
        i = entry_of.get(row)
        if i is None or counts[i] < 0:
            assert rows[row] is None
            continue
        k = counts[i] + 1
        got = rows[row]
        assert got.token_ids.shape == (1, k) and got.logprobs.shape == (1, k) and got.ranks.shape == (1,)
        assert got.token_ids.tolist() == [lp.token_ids[i, :k].tolist()]
        assert got.logprobs.tolist() == [lp.logprobs[i, :k].tolist()]
        assert got.ranks.tolist() == [int(lp.ranks[i])]
