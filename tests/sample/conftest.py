"""Fixtures for sampler unit tests: a SamplingMetadata builder with everything off by default."""

from __future__ import annotations

import pytest
import torch

from engine.sample import SamplingMetadata


def build_metadata(num_rows: int, temperature: float | list[float] = 1.0, **fields) -> SamplingMetadata:
    """Metadata for num_rows rows; keyword fields override the feature-off defaults."""
    if isinstance(temperature, (int, float)):
        temperature = [float(temperature)] * num_rows
    temp = torch.tensor(temperature, dtype=torch.float32)
    defaults = dict(
        temperature=temp,
        all_greedy=bool((temp == 0).all()),
        all_random=bool((temp != 0).all()),
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        presence_penalties=None,
        frequency_penalties=None,
        repetition_penalties=None,
        prompt_token_ids=None,
        output_token_ids=[[] for _ in range(num_rows)],
    )
    defaults.update(fields)
    return SamplingMetadata(**defaults)


@pytest.fixture
def make_md():
    return build_metadata
