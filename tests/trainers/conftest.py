"""Fixtures the trainer loop tests share: a process group torn down after each test, the toy prompts and a toy reward."""

from __future__ import annotations

import pytest
import torch.distributed as dist

PROMPTS = ["The quick brown fox", "Once upon a time", "12+35=", "Numbers appear too:"]


def vowel_fraction(completion: str, item) -> float:
    """A toy reward with many distinct values, so groups have a spread (non-zero advantages) that a tiny model can climb."""
    return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)


@pytest.fixture
def process_group():
    """Destroys the default process group a trainer created during the test (a later test starts its own)."""
    created = not dist.is_initialized()
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def prompts() -> list[str]:
    return list(PROMPTS)


@pytest.fixture
def vowel_reward():
    """vowel_fraction as the per-sample reward callable (wrap with trainers.common.single_reward)."""
    return vowel_fraction
