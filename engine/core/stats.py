"""SchedulerStats: the scheduler's per-step numbers that the metrics layer turns into gauges and counters."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class StepWork:
    """The work of the steps scheduled since the last stats: the inputs of the FLOPs/bytes estimate.

    A row is one request in one step. Rows are split by size, not by phase: a row scheduled
    with more than one token counts as prefill, a row with exactly one token as decode (a
    one-token prompt chunk costs what a decode costs, so it is counted as one).
    """

    num_steps: int = 0  # non-empty steps scheduled
    num_reqs: int = 0  # rows, summed over those steps
    num_prefill_tokens: int = 0  # tokens of rows scheduled with more than one token
    num_decode_tokens: int = 0  # rows scheduled with exactly one token (one token each)
    num_sampling_reqs: int = 0  # rows whose step reaches their last token, so they sample
    # Over scheduled tokens: the keys each token attends to (itself and every token before it).
    attn_context_sum: int = 0
    # Over rows: the keys in the row's KV after its step (computed + scheduled), i.e. what an
    # attention kernel that reads each row's KV once reads.
    kv_context_sum: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def add_decode_rows(self, num_rows: int, kv_context_sum: int) -> None:
        """Counts num_rows rows of one sampling token each; kv_context_sum: their computed + 1, summed.
        The same as add_row(c, 1, samples=True) per row (a decode token attends to c + 1 keys)."""
        self.num_reqs += num_rows
        self.num_decode_tokens += num_rows
        self.num_sampling_reqs += num_rows
        self.attn_context_sum += kv_context_sum
        self.kv_context_sum += kv_context_sum

    def add_row(self, num_computed_tokens: int, num_new_tokens: int, samples: bool) -> None:
        """Counts one row whose num_new_tokens start at position num_computed_tokens."""
        c, n = num_computed_tokens, num_new_tokens
        self.num_reqs += 1
        if n > 1:
            self.num_prefill_tokens += n
        else:
            self.num_decode_tokens += n
        self.num_sampling_reqs += int(samples)
        # Token i (0-based) sits at position c + i and attends to c + i + 1 keys:
        # sum_{i<n} (c + i + 1) = n*c + n*(n+1)/2.
        self.attn_context_sum += n * c + n * (n + 1) // 2
        self.kv_context_sum += c + n


@dataclass
class SpecDecodingStats:
    """Speculative decoding since the last stats: how many proposed tokens the model accepted."""

    num_spec_tokens: int  # the speculator's tokens per step (num_speculative_tokens)
    num_drafts: int = 0  # request steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [num_spec_tokens]: accepted drafts at each draft position (position 0 first).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Adds another interval's counts (positions past this one's count are appended)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for pos, num_accepted in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[pos] += num_accepted


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache since the last stats
    prefix_cache_hits: int = 0  # tokens found there since the last stats
    num_preemptions: int = 0  # cumulative since the scheduler started
    step_num_preemptions: int = 0  # since the last stats (one step when read every step)
    step_work: StepWork = field(default_factory=StepWork)  # since the last stats, like the above
    pause_state: int = 0  # engine.control.PauseState: 0 unpaused, 1 new requests refused, 2 nothing scheduled
    # The level of the last sleep() while any part is still asleep, else 0 (sleep(0) shows as
    # pause_state 2 only: memory stays where it is).
    sleep_level: int = 0
    spec_decoding: SpecDecodingStats | None = None  # since the last stats; None without a speculator

    def gauges_only(self) -> SchedulerStats:
        """A copy without the since-the-last-stats counts: what a second client of one engine gets, so
        that each count is recorded by exactly one frontend."""
        return replace(self, prefix_cache_queries=0, prefix_cache_hits=0, step_num_preemptions=0,
                       step_work=StepWork(), spec_decoding=None)
