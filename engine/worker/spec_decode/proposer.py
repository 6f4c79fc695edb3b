"""The speculator interface: after a verified step, propose each row's next draft tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.worker.input_batch import InputBatch


@dataclass
class VerifiedStep:
    """What one step settled, for the speculator: the batch the model ran (drafts included) and,
    per row that sampled, where its last known token now sits."""

    batch: InputBatch
    rows: np.ndarray  # [R] int64 indices into batch rows that sampled this step
    last_token_ids: np.ndarray  # [R] int64: each such row's last accepted token
    last_positions: np.ndarray  # [R] int64: its position (num_tokens - 1 after the step)


class Proposer(Protocol):
    """One per algorithm (spec_decode/<algo>/proposer.py); the model runner owns it."""

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        """Drafts for every batch row (empty for rows that did not sample), at most
        num_speculative_tokens each. Called once per step, after the step's tokens are in the
        runner's RequestState."""
        ...
