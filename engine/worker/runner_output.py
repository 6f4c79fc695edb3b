"""ModelRunnerOutput: what one forward pass sampled, handed back to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.wire import LogprobsLists


@dataclass
class ModelRunnerOutput:
    # Rows in the order the runner processed them.
    req_ids: list[str]
    # Tokens sampled per row: one for a request whose tokens are all computed after this
    # step, none for a request still in the middle of its prompt (chunked prefill).
    sampled_token_ids: list[list[int]]
    # Per row (None where the request asked for none or sampled nothing).
    logprobs: list[LogprobsLists | None] | None = None
    # Prompt logprobs computed this step, per request that asked for them.
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Per request that asked for return_routed_experts: (position of its first token this step,
    # [n, num_moe_layers, top_k] int32 expert ids of its n tokens processed this step).
    routed_experts: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    # Speculative decoding: per row, the draft tokens proposed for its next step (None: no speculator).
    spec_token_ids: list[list[int]] | None = None

    @staticmethod
    def empty() -> "ModelRunnerOutput":
        return ModelRunnerOutput([], [])
