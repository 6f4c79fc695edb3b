"""SamplingMetadata: one step's sampling parameters as batched tensors, built by the model runner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine.config import LogprobsMode


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for the B rows that sample this step.

    Optional tensors are None when no row in the batch uses that feature, so the common
    case (plain temperature sampling or greedy) skips the work entirely.
    """

    temperature: torch.Tensor  # [B] float32; 0.0 marks a greedy row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64; 0 = off for that row
    top_p: torch.Tensor | None  # [B] float32; 1.0 = off
    min_p: torch.Tensor | None  # [B] float32; 0.0 = off
    # Seeded rows: row -> a generator seeded with mix_seed(request seed, output position). The
    # sampler uses its initial_seed() as the row's noise key (it never draws from it), so a
    # request's token does not depend on the rest of the batch, nor on CPU vs GPU. The model runner
    # passes a random_sampling.SeededKeys (the keys as arrays, no generator built per row).
    generators: Mapping[int, torch.Generator]
    # Penalties; None when no row uses any of them.
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64, padded with vocab_size
    output_token_ids: list[list[int]]  # per row, the tokens generated so far
    # row -> (min_tokens, stop token ids incl. EOS) for rows below their min_tokens.
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)
    # row -> {token id: bias}
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    # row -> token-id sequences; a sequence's last token is banned when its prefix ends the output.
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # [B, V] bool, True = banned; None when no row restricts its tokens.
    allowed_token_ids_mask: torch.Tensor | None = None
    # Largest top-k logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None = None
    logprobs_mode: LogprobsMode = "raw_logprobs"
    # The largest value in top_k, known on the host: top-k then needs no device sync. None: read from top_k.
    max_top_k: int | None = None

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None
