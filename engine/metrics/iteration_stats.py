"""Frontend-side request timing: per-request state and the IterationStats of each engine step."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.wire import EngineCoreOutputs, finish_reason_text


@dataclass(slots=True)  # slots: read and written per request on every step
class RequestStateStats:
    """What the frontend remembers about one engine request's timing while it runs.

    Times ending in `_time` are wall-clock seconds (time.time()). `first_token_time` and
    `last_token_time` are engine timestamps (end of the step that produced the token);
    `last_seen_time` is when the frontend received the last token (what a user sees).
    The engine core does not report when it queued or scheduled a request, so the queue
    entry is the arrival and `scheduled_time` is estimated as the start of the step that
    produced the first token (see IterationStatsRecorder).
    """

    arrival_time: float
    num_prompt_tokens: int
    parent_req_id: str | None = None  # the user request an n > 1 child belongs to
    max_tokens: int | None = None  # the request's max_tokens parameter (None: not given)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (known with the first token)
    num_preemptions: int = 0  # the most the engine's outputs reported
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    last_seen_time: float = 0.0
    num_generation_tokens: int = 0


@dataclass
class FinishedRequestStats:
    """Latencies of one finished engine request, in seconds."""

    req_id: str
    finish_reason: str  # "stop", "length", "abort", "error", "repetition"
    e2e_latency: float  # arrival -> the frontend saw it finish
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float  # arrival -> (estimated) start of its first-token step
    prefill_time: float  # that start -> first token (engine clock)
    decode_time: float  # first token -> last token (engine clock)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    max_tokens: int | None = None  # the max_tokens parameter, if the request gave one
    num_preemptions: int = 0  # times the engine preempted it (as of its last output)

    @property
    def inference_time(self) -> float:
        """First scheduled -> last token: prefill and decode together."""
        return self.prefill_time + self.decode_time

    @property
    def mean_time_per_output_token(self) -> float:
        return self.decode_time / (self.num_generation_tokens - 1) if self.num_generation_tokens > 1 else 0.0


@dataclass
class IterationStats:
    """What one engine step meant to the frontend: token counts and the latencies it completed."""

    iteration_timestamp: float
    num_prompt_tokens: int = 0  # prompts of requests whose first token came in this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # of num_prompt_tokens, the tokens found in the prefix cache
    # Per user request whose last engine request finished in this step: its n parameter, and the
    # most tokens any of its n sequences generated.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    weight_version: str | None = None  # the weight version that computed this step's tokens (None: no tokens)

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens this step's first-token requests prefilled themselves (not cache hits)."""
        return self.num_prompt_tokens - self.num_cached_prompt_tokens


@dataclass(slots=True)
class _ParentStats:
    """An n > 1 user request while its children run: how many are left, the longest generation so far."""

    n: int
    num_unfinished: int
    max_num_generation_tokens: int = 0


class IterationStatsRecorder:
    """Turns a frontend's view of requests and engine outputs into IterationStats, one per step.

    A frontend calls on_request_added() for each engine request (each child of an n > 1
    request), on_engine_outputs() for each EngineCoreOutputs it processes, and
    on_requests_aborted() when it drops requests itself.

    Queue time is an estimate: the engine reports no per-request scheduling time, so a
    request counts as scheduled when the step that produced its first token started, taken
    as the previous EngineCoreOutputs' timestamp from the same engine (steps run back to
    back), and never before its arrival. With chunked prefill, the earlier chunks' steps
    count as queue time rather than prefill time.
    """

    def __init__(self) -> None:
        self.requests: dict[str, RequestStateStats] = {}
        self.parents: dict[str, _ParentStats] = {}
        self._last_step_end: dict[int, float] = {}  # engine_index -> timestamp of its last outputs

    def on_request_added(
        self,
        req_id: str,
        arrival_time: float,
        num_prompt_tokens: int,
        parent_req_id: str | None = None,
        max_tokens: int | None = None,
        n: int = 1,
    ) -> None:
        """One engine request; an n > 1 user request adds each of its n children with its own id as
        `parent_req_id` and the same `n`."""
        self.requests[req_id] = RequestStateStats(arrival_time, num_prompt_tokens, parent_req_id, max_tokens)
        if parent_req_id is not None:
            parent = self.parents.get(parent_req_id)
            if parent is None:
                self.parents[parent_req_id] = _ParentStats(n, 1)
            else:
                parent.num_unfinished += 1

    def on_requests_aborted(self, req_ids: Iterable[str]) -> None:
        """Forgets engine requests (children of an n > 1 request by their own ids) without reporting
        them; O(len(req_ids)), whatever else is running."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None and state.parent_req_id is not None:
                parent = self.parents[state.parent_req_id]
                parent.num_unfinished -= 1
                if parent.num_unfinished == 0:
                    del self.parents[state.parent_req_id]

    def on_engine_outputs(
        self, outputs: EngineCoreOutputs, now: float | None = None, stopped_req_ids: Iterable[str] = ()
    ) -> IterationStats:
        """Folds one step's outputs in; `stopped_req_ids` are requests the frontend finished
        itself in this step (a stop string), which the engine only learns of by an abort."""
        now = time.time() if now is None else now
        engine_time = outputs.timestamp or now
        step_start = self._last_step_end.get(outputs.engine_index, 0.0)
        self._last_step_end[outputs.engine_index] = engine_time
        stats = IterationStats(iteration_timestamp=now)

        # Per output only the per-request fields; the step's sums are kept in locals and stored once.
        requests = self.requests
        time_to_first_tokens = stats.time_to_first_tokens
        inter_token_latencies = stats.inter_token_latencies
        num_prompt_tokens = num_cached_prompt_tokens = num_generation_tokens = 0
        any_tokens = False
        for out in outputs.outputs:
            state = requests.get(out.request_id)
            if state is None:
                continue  # not tracked, or already finished by the frontend
            num_new = len(out.new_token_ids)
            if out.num_preemptions > state.num_preemptions:
                state.num_preemptions = out.num_preemptions
            if num_new:
                if state.num_generation_tokens == 0:
                    state.scheduled_time = max(state.arrival_time, step_start)
                    state.first_token_time = engine_time
                    time_to_first_tokens.append(now - state.arrival_time)
                    num_prompt_tokens += state.num_prompt_tokens
                    state.num_cached_tokens = min(out.num_cached_tokens, state.num_prompt_tokens)
                    num_cached_prompt_tokens += state.num_cached_tokens
                else:
                    inter_token_latencies.append(now - state.last_seen_time)
                state.num_generation_tokens += num_new
                state.last_token_time = engine_time
                state.last_seen_time = now
                num_generation_tokens += num_new
                any_tokens = True
            if out.finish_reason is not None:
                self._finish(out.request_id, finish_reason_text(out.finish_reason), now, stats)
        stats.num_prompt_tokens = num_prompt_tokens
        stats.num_cached_prompt_tokens = num_cached_prompt_tokens
        stats.num_generation_tokens = num_generation_tokens
        if any_tokens:
            # Only a step's outputs carry the engine's version (a utility answer's says "default").
            stats.weight_version = outputs.weight_version
        for req_id in stopped_req_ids:
            if req_id in self.requests:
                self._finish(req_id, "stop", now, stats)
        return stats

    def _finish(self, req_id: str, finish_reason: str, now: float, stats: IterationStats) -> None:
        state = self.requests.pop(req_id)
        e2e = now - state.arrival_time
        if state.num_generation_tokens == 0:  # finished (aborted, failed) before any token
            queue_time, prefill_time, decode_time = e2e, 0.0, 0.0
        else:
            queue_time = state.scheduled_time - state.arrival_time
            prefill_time = state.first_token_time - state.scheduled_time
            decode_time = state.last_token_time - state.first_token_time
        stats.finished_requests.append(
            FinishedRequestStats(
                req_id=req_id,
                finish_reason=finish_reason,
                e2e_latency=e2e,
                num_prompt_tokens=state.num_prompt_tokens,
                num_generation_tokens=state.num_generation_tokens,
                queue_time=queue_time,
                prefill_time=prefill_time,
                decode_time=decode_time,
                num_cached_tokens=state.num_cached_tokens,
                max_tokens=state.max_tokens,
                num_preemptions=state.num_preemptions,
            )
        )
        if state.parent_req_id is None:
            stats.n_params.append(1)
            stats.max_num_generation_tokens.append(state.num_generation_tokens)
            return
        parent = self.parents[state.parent_req_id]
        parent.num_unfinished -= 1
        parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, state.num_generation_tokens)
        if parent.num_unfinished == 0:  # the user request's last sequence: it counts once
            del self.parents[state.parent_req_id]
            stats.n_params.append(parent.n)
            stats.max_num_generation_tokens.append(parent.max_num_generation_tokens)
