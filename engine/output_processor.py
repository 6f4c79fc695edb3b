"""OutputProcessor: turns EngineCoreOutputs into RequestOutputs (detokenize, stop strings, logprobs, n > 1)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer, PromptContext, prompt_context
from engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs, WeightVersionSpan
from engine.sampling_params import RequestOutputKind, SamplingParams, _check_int64
from engine.stop_strings import find_stop_string, stop_hold_back
from engine.wire import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists, finish_reason_text


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests finished here by a stop string: the engine core still runs them and must
    # abort them to free their KV blocks.
    reqs_to_abort: list[str]


class ParentRequest:
    """A request with n > 1, fanned out into n engine requests and gathered back into one output."""

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.child_req_ids = [self.child_request_id(i) for i in range(self.n)]
        self.unfinished_indices = set(range(self.n))
        # Latest CompletionOutput of each child (CUMULATIVE / FINAL_ONLY gather these).
        self.latest: list[CompletionOutput | None] = [None] * self.n
        # Registered by OutputProcessor.add_request; child 0 carries the prompt logprobs. Each state refers
        # back to this parent: done() empties it, so that the pair is freed without the garbage collector.
        self.child_states: dict[int, RequestState] = {}

    def child_request_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_sampling_params(self, index: int) -> SamplingParams:
        sp = self.sampling_params
        seed = None if sp.seed is None else sp.seed + index
        # Prompt logprobs are the same for every child: only child 0 asks the engine for them.
        prompt_logprobs = sp.prompt_logprobs if index == 0 else None
        return sp.clone(n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    def make_child_requests(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """The n engine requests for `request` (whose id and params are the parent's), in index order."""
        # Child 0's params are built (and fully validated) as child_sampling_params builds them; the
        # others differ from child 0 only in seed and prompt_logprobs=None (always valid), so they are
        # shallow copies with those set, the seed bound-checked as validation would. Same params and
        # the same first error as validating every child, without n-1 re-validations.
        first = self.child_sampling_params(0)
        params = [first]
        for i in range(1, self.n):
            child = copy.copy(first)
            if first.seed is not None:
                child.seed = self.sampling_params.seed + i
                _check_int64("seed", child.seed)
            child.prompt_logprobs = None
            params.append(child)
        return [
            EngineCoreRequest(
                request_id=self.child_req_ids[i],
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=params[i],
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                client_index=request.client_index,
                lora_request=request.lora_request,
            )
            for i in range(self.n)
        ]

    @property
    def finished(self) -> bool:
        return not self.unfinished_indices

    def done(self) -> None:
        """Forgets the children's states once the OutputProcessor has forgotten the parent."""
        self.child_states = {}


@dataclass
class _Delta:
    """One child's report in one step, for the parent to gather."""

    completion: CompletionOutput | None  # None: nothing to show this step (e.g. FINAL_ONLY)
    finished: bool


class RequestState:
    """Everything the OutputProcessor keeps about one engine request while it runs."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer,
        token_text: _TokenTextCache | None,
        parent: ParentRequest | None,
        index: int,
        detok_context: PromptContext | None = None,
    ) -> None:
        """`detok_context`: the detokenizer's prompt context when the caller has it (shared by n children)."""
        params = request.sampling_params
        self.req_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.lora_request = request.lora_request
        self.params = params
        self.output_kind = params.output_kind
        self.parent = parent
        self.index = index
        self.token_text = token_text  # None: no detokenization, so decoded_token is None too

        self.detokenizer = None
        if params.detokenize and tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens,
                detok_context,
            )
        self.stop = params.stop if self.detokenizer is not None else None
        self.hold_back = stop_hold_back(self.stop, params.include_stop_str_in_output)
        # FINAL_ONLY without stop strings shows text only once the request finishes, so the
        # text is decoded then, in one pass over all its tokens: a decode step costs a
        # list extend instead of a detokenizer call. Feeding the same ids through the same
        # IncrementalDetokenizer makes the text identical to decoding step by step.
        self.final_only = self.output_kind == RequestOutputKind.FINAL_ONLY
        self.defer_text = self.final_only and not self.stop
        # Whether a step may carry anything besides token ids (checked once per step).
        self.wants_extras = (
            params.logprobs is not None or params.prompt_logprobs is not None or params.return_routed_experts
        )

        self.token_ids: list[int] = []
        self.text = ""  # detokenized text, cut at a stop string
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # (weight_version, start) of each run of token_ids computed by one version, in order; a
        # run ends where the next starts (the last at len(token_ids)). A step of the version
        # already running only extends token_ids, so this changes only when the version does.
        self.weight_span_starts: list[tuple[str, int]] = []
        # DELTA bookkeeping: how much of each stream the caller has seen.
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.prompt_logprobs_sent = False
        self.routed_experts: list[list[list[int]]] | None = [] if params.return_routed_experts else None
        self.num_sent_routed = 0
        # Rows of the first routed_experts_prompt_start prompt positions still to leave out (they come first).
        self.num_routed_to_skip = params.routed_experts_prompt_start if params.return_routed_experts else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput, weight_version: str = "default") -> bool:
        """Folds one step into the state; returns True if a stop string finished the request here."""
        new_ids = out.new_token_ids
        if new_ids:
            spans = self.weight_span_starts
            if not spans or spans[-1][0] != weight_version:
                spans.append((weight_version, len(self.token_ids)))
            self.token_ids += new_ids
        if out.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if self.wants_extras:
            self._update_extras(out)
        finished = out.finish_reason is not None
        if finished:
            self.finish_reason, self.stop_reason = finish_reason_text(out.finish_reason), out.stop_reason

        if self.detokenizer is None:
            return False
        if self.defer_text:
            if finished:  # every token at once (no stop strings, so nothing else to check)
                self.text = self.detokenizer.decode_whole(self._ids_to_detokenize(self.token_ids, out))
            return False
        new_text = self.detokenizer.update(self._ids_to_detokenize(new_ids, out), finished=finished)
        self.text += new_text
        # As in vLLM, stop strings are ignored while the output is shorter than min_tokens.
        if not self.stop or not new_text or len(self.token_ids) <= self.params.min_tokens:
            return False
        hit = find_stop_string(self.text, len(new_text), self.stop, self.params.include_stop_str_in_output)
        if hit is None:
            return False
        stop_str, cut = hit
        self.text = self.text[:cut]
        # A stop string overrides whatever the engine said in the same step (e.g. "length").
        self.finish_reason, self.stop_reason = str(FinishReason.STOP), stop_str
        return not finished

    def _ids_to_detokenize(self, ids: list[int], out: EngineCoreOutput) -> list[int]:
        """`ids` (ending with this step's tokens) less a final stop token: a stop token (EOS or one
        of stop_token_ids) ends the text without appearing in it, unless the request asks for
        its stop string/token to be kept."""
        stopped_by_token = out.finish_reason == FinishReason.STOP and not isinstance(out.stop_reason, str)
        if stopped_by_token and out.new_token_ids and ids and not self.params.include_stop_str_in_output:
            return ids[:-1]
        return ids

    def _update_extras(self, out: EngineCoreOutput) -> None:
        """Logprobs, prompt logprobs and routed experts of one step."""
        if out.new_logprobs is not None and self.logprobs is not None:
            rows, chosen = self._logprob_dicts(out.new_logprobs, self.params.logprobs, self.logprobs)
            self.logprobs += rows
            self.cumulative_logprob += sum(chosen)
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs += self._logprob_dicts(
                out.new_prompt_logprobs, self.params.prompt_logprobs, self.prompt_logprobs
            )[0]
        if out.new_routed_experts is not None and self.routed_experts is not None:
            rows = out.new_routed_experts
            if self.num_routed_to_skip:
                skipped = min(self.num_routed_to_skip, len(rows))
                rows, self.num_routed_to_skip = rows[skipped:], self.num_routed_to_skip - skipped
            self.routed_experts += rows.tolist()

    def _weight_spans_from(self, start_tok: int) -> list[WeightVersionSpan]:
        """The spans of token_ids[start_tok:], re-based so that they index that slice."""
        starts = self.weight_span_starts
        ends = [start for _, start in starts[1:]] + [len(self.token_ids)]
        return [
            WeightVersionSpan(version, max(start, start_tok) - start_tok, end - start_tok)
            for (version, start), end in zip(starts, ends)
            if end > start_tok
        ]

    def _logprob_dicts(
        self, lists: LogprobsLists, num_top: int, history: list
    ) -> tuple[list[dict[int, Logprob]], list[float]]:
        """Per position {token_id: Logprob}: the chosen token (its true rank) first, then the top num_top;
        and the chosen tokens' logprobs. `history`: the positions these follow (the request's logprobs or
        prompt logprobs so far), whose chosen tokens are the context that completes a token text left as a
        partial UTF-8 sequence."""
        token_text = self.token_text
        texts = token_text.texts if token_text is not None else None  # None: decoded_token stays None
        # One .tolist() per array and chunk: Python ints and floats from here on.
        token_ids, logprobs, ranks = lists.token_ids.tolist(), lists.logprobs.tolist(), lists.ranks.tolist()
        rows: list[dict[int, Logprob]] = []
        for ids, lps, rank in zip(token_ids, logprobs, ranks):
            row: dict[int, Logprob] = {}
            partial = False
            # Column 0 is the chosen token; columns 1..K hold the top-K in order, so column k has rank k. The
            # engine may send more columns than this request asked for (it samples a batch with one K).
            for k in range(min(num_top, len(ids) - 1) + 1):
                tid = ids[k]
                if tid in row:  # the chosen token keeps its own entry
                    continue
                text = None
                if texts is not None:
                    text = texts.get(tid)
                    if text is None:
                        text = token_text.get(tid)
                    partial = partial or text.endswith(_REPLACEMENT)
                row[tid] = Logprob(lps[k], rank if k == 0 else k, text)
            if partial:
                context = _chosen_ids(history, rows)
                for tid, lp in row.items():
                    if lp.decoded_token.endswith(_REPLACEMENT):
                        lp.decoded_token = token_text.completed(tid, context)
            rows.append(row)
        return rows, [lps[0] for lps in logprobs]

    def make_completion(self) -> CompletionOutput | None:
        """The CompletionOutput to report after a step, per output kind (None: report nothing)."""
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # Withhold a tail that may turn out to start a stop string. Invariant: the text never
        # shrinks below what was already shown, because a stop string found later starts at
        # most hold_back characters before the text of its step (see find_stop_string).
        num_visible = len(self.text) if finished else max(self.num_sent_chars, len(self.text) - self.hold_back)
        if self.output_kind == RequestOutputKind.DELTA:
            start_tok, start_char, start_routed = self.num_sent_tokens, self.num_sent_chars, self.num_sent_routed
        else:
            # CUMULATIVE copies everything so far, so callers may keep earlier outputs unchanged.
            start_tok, start_char, start_routed = 0, 0, 0
        self.num_sent_tokens, self.num_sent_chars = len(self.token_ids), num_visible
        routed = None
        if self.routed_experts is not None:
            routed = self.routed_experts[start_routed:]
            self.num_sent_routed = len(self.routed_experts)
        return CompletionOutput(
            index=self.index,
            text=self.text[start_char:num_visible],
            token_ids=self.token_ids[start_tok:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start_tok:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            weight_versions=self._weight_spans_from(start_tok),
            routed_experts=routed,
        )

    def take_prompt_logprobs(self, kind: RequestOutputKind) -> PromptLogprobs | None:
        """Prompt logprobs for an output: every time, or once for DELTA."""
        if kind == RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return self.prompt_logprobs


_REPLACEMENT = "\ufffd"  # what decoding a partial UTF-8 sequence ends with
_MAX_UTF8_CONTEXT = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte-fallback tokens


def _chosen_ids(history: list, rows: list) -> list[int]:
    """The chosen token ids of the last few positions before the next one (a None position, the prompt's
    first, has none), oldest first."""
    ids = [next(iter(row)) for row in rows[-_MAX_UTF8_CONTEXT:] if row is not None]
    if len(ids) < _MAX_UTF8_CONTEXT:
        older = history[-(_MAX_UTF8_CONTEXT - len(ids)):]
        ids = [next(iter(row)) for row in older if row is not None] + ids
    return ids


class _TokenTextCache:
    """Text of single token ids (for Logprob.decoded_token), decoded once per id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.texts: dict[int, str] = {}  # by token id; read directly where a lookup is per token

    def completed(self, token_id: int, context: list[int]) -> str:
        """The text `token_id` adds after `context` when on its own it decodes to a partial UTF-8 sequence
        (as vLLM's logprobs report it): the text it completes together with the byte-fallback tokens
        just before it (whose own texts were partial too), or "" when the character is still unfinished."""
        decode = self._tokenizer.decode
        for num_ctx in range(1, min(len(context), _MAX_UTF8_CONTEXT) + 1):
            ctx = context[-num_ctx:]
            whole = decode(ctx + [token_id])
            if whole.endswith(_REPLACEMENT):
                continue  # still unfinished with this much context: take one more token
            # The context tokens that were partial themselves hand their bytes to this token.
            num_clean = num_ctx
            while num_clean > 0 and self.get(ctx[num_clean - 1]).endswith(_REPLACEMENT):
                num_clean -= 1
            prefix = decode(ctx[:num_clean]) if num_clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = 0  # a normalizing tokenizer may change the prefix: cut at the longest common one
            while common < min(len(prefix), len(whole)) and prefix[common] == whole[common]:
                common += 1
            return whole[common:]
        return ""

    def get(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            text = self.texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class OutputProcessor:
    """Frontend-side processing of engine outputs for all of one client's requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text = _TokenTextCache(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}  # by engine request id
        self.parent_requests: dict[str, ParentRequest] = {}  # by parent (user) request id

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        index: int = 0,
        detok_context: PromptContext | None = None,
    ) -> None:
        """`detok_context`: prompt_context() of the request's prompt, when the caller has it."""
        req_id = request.request_id
        if req_id in self.request_states:
            raise ValueError(f"request_id: {req_id!r} is already running")
        token_text = self._token_text if request.sampling_params.detokenize else None
        state = RequestState(request, prompt, self.tokenizer, token_text, parent_req, index, detok_context)
        self.request_states[req_id] = state
        if parent_req is not None:
            parent_req.child_states[index] = state
            self.parent_requests[parent_req.request_id] = parent_req

    def add_user_request(self, request: EngineCoreRequest, prompt: str | None) -> list[EngineCoreRequest]:
        """Registers a user's request, fanned out into its n children when n > 1 (they share the
        prompt, so prefix caching shares its KV blocks); returns the engine requests to send."""
        if request.sampling_params.n == 1:
            self.add_request(request, prompt)
            return [request]
        parent = ParentRequest(request.request_id, request.sampling_params)
        children = parent.make_child_requests(request)
        params = request.sampling_params
        # The children share the prompt, hence the detokenizer's context: computed once for all n.
        context = None
        if params.detokenize and self.tokenizer is not None:
            context = prompt_context(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        for index, child in enumerate(children):
            self.add_request(child, prompt, parent, index, context)
        return children

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        """Forgets requests (parent ids expand to their children); returns the engine request ids removed."""
        removed = []
        for req_id in req_ids:
            parent = self.parent_requests.pop(req_id, None)
            for child_id in parent.child_req_ids if parent is not None else [req_id]:
                state = self.request_states.pop(child_id, None)
                if state is None:
                    continue
                removed.append(child_id)
                # A parent lives while a child is unfinished: O(1) per child, so aborting a
                # parent of n children costs O(n), not O(n^2).
                if state.parent is not None:
                    state.parent.unfinished_indices.discard(state.index)
                    if state.parent.finished:
                        self.parent_requests.pop(state.parent.request_id, None)
                        state.parent.done()
            if parent is not None:
                parent.done()
        return removed

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def process_outputs(
        self, engine_core_outputs: list[EngineCoreOutput], weight_version: str | None = None,
        lora_weight_versions: dict[int, str] | None = None,
    ) -> OutputProcessorOutput:
        """`weight_version`: the version that computed these outputs (EngineCoreOutputs.weight_version);
        None counts as "default". It becomes the CompletionOutputs' weight_versions spans, except for a
        request whose adapter a weight sync labelled (`lora_weight_versions`, by lora_int_id): its
        adapter's version, which is what an adapter-training trainer synced."""
        if weight_version is None:
            weight_version = "default"
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        # Children's reports are gathered per parent so each step yields one output per parent.
        parent_reports: dict[str, dict[int, _Delta]] = {}
        request_states = self.request_states
        for out in engine_core_outputs:
            state = request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            version = weight_version
            if lora_weight_versions and state.lora_request is not None:
                version = lora_weight_versions.get(state.lora_request.lora_int_id, weight_version)
            if state.update(out, version):
                reqs_to_abort.append(state.req_id)
            finished = state.finish_reason is not None
            if finished:
                del request_states[state.req_id]
            elif state.final_only:
                continue  # nothing to show until it finishes (for a child: nothing to gather)
            # Steps without new tokens (prompt-logprob chunks of a chunked prefill) report nothing.
            elif not out.new_token_ids:
                continue
            completion = state.make_completion()
            parent = state.parent
            if parent is not None:
                reports = parent_reports.get(parent.request_id)
                if reports is None:
                    reports = parent_reports[parent.request_id] = {}
                reports[state.index] = _Delta(completion, finished)
            elif completion is not None:
                request_outputs.append(
                    RequestOutput(
                        request_id=state.req_id,
                        prompt=state.prompt,
                        prompt_token_ids=state.prompt_token_ids,
                        prompt_logprobs=state.take_prompt_logprobs(state.output_kind),
                        outputs=[completion],
                        finished=state.finished,
                        num_cached_tokens=state.num_cached_tokens,
                        lora_request=state.lora_request,
                    )
                )
        for parent_id, reports in parent_reports.items():
            output = self._gather(self.parent_requests[parent_id], reports)
            if output is not None:
                request_outputs.append(output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def _gather(self, parent: ParentRequest, reports: dict[int, _Delta]) -> RequestOutput | None:
        """One RequestOutput for a parent from its children's reports of this step."""
        kind = parent.sampling_params.output_kind
        for index, report in reports.items():
            if report.completion is not None:
                parent.latest[index] = report.completion
            if report.finished:
                parent.unfinished_indices.discard(index)
        finished = parent.finished
        if finished:
            del self.parent_requests[parent.request_id]

        if kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            outputs = parent.latest
        elif kind == RequestOutputKind.DELTA:
            outputs = [reports[i].completion for i in sorted(reports) if reports[i].completion is not None]
        else:  # CUMULATIVE: every child's state so far, empty for children yet to report
            outputs = [c if c is not None else self._empty_completion(parent, i) for i, c in enumerate(parent.latest)]

        first = parent.child_states[0]
        output = RequestOutput(
            request_id=parent.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.take_prompt_logprobs(kind),
            outputs=list(outputs),
            finished=finished,
            num_cached_tokens=max(c.num_cached_tokens for c in parent.child_states.values()),
            lora_request=first.lora_request,
        )
        if finished:
            parent.done()
        return output

    @staticmethod
    def _empty_completion(parent: ParentRequest, index: int) -> CompletionOutput:
        wants_logprobs = parent.sampling_params.logprobs is not None
        return CompletionOutput(
            index=index,
            text="",
            token_ids=[],
            cumulative_logprob=0.0 if wants_logprobs else None,
            logprobs=[] if wants_logprobs else None,
            routed_experts=[] if parent.sampling_params.return_routed_experts else None,
        )
