"""RolloutSession: a multi-turn rollout over one exact token history, with a mask of the model's tokens, their logprobs and weight versions.

    session = worker.session([{"role": "user", "content": "123*456?"}], SamplingParams(max_tokens=32))
    turn = session.generate()                       # the model's turn, sampled on the history
    session.add_messages([{"role": "tool", "content": "56088"}])
    session.generate()
    trajectory = session.trajectory()               # token_ids, mask, logprobs, weight_versions

The same session runs over HTTP (`RolloutSession(GenerateClient("http://127.0.0.1:8000"), ...)`):
token ids in and out through POST /inference/v1/generate, the chat template through POST /tokenize.

How the history grows (every step appends, nothing already in it is ever re-tokenized):

    prompt (template, add_generation_prompt) | sampled turn 0 | closing | new messages' delta | sampled turn 1 | ...
    mask 0                                   | 1              | 0       | 0                   | 1

- A turn's tokens are exactly what the engine sampled, its end-of-turn token included. The
  end-of-turn token is the first token of the template's *closing* (what the template writes
  after an assistant message's content, e.g. "<|im_end|>\\n"); every turn has it as a stop token.
- Before new messages, the rest of the closing is appended: closing[1:] when the turn ended on the
  end-of-turn token, the whole closing when it did not (cut by max_tokens, a stop string or the
  model's EOS, which stays in the history as sampled).
- New messages' tokens are the template's delta: render(PROBE + new, add_generation_prompt) less
  render(PROBE), where PROBE is a fixed two-message conversation ending with an assistant message,
  so the delta holds the new messages and the next generation prompt and nothing of the closing.
- Each turn sends the whole history, so the prefix cache serves the earlier turns' blocks.
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from engine.outputs import WeightVersionSpan
from engine.sampling_params import SamplingParams

# The conversation the template delta is measured against: a user message, then an assistant one.
_PROBE_USER = {"role": "user", "content": "1"}
# Two assistant contents that differ in every token: the closing is their renders' common tail.
_PROBE_CONTENTS = ("A", "B")
DEFAULT_TIMEOUT_S = 600.0


class ContextFullError(ValueError):
    """The session's history would leave no room for a model turn in max_model_len (nothing was appended)."""


class TurnSample(NamedTuple):
    """What the engine returned for one turn."""

    token_ids: list[int]
    logprobs: list[float]
    """The sampled token's logprob at each position."""
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    weight_versions: list[WeightVersionSpan]
    """Spans over token_ids."""
    num_cached_tokens: int | None
    """Prompt tokens the prefix cache served; None where the engine does not say (over HTTP)."""


@dataclass
class Turn:
    """One model turn of a session."""

    start: int
    """Index in the session's token_ids of the turn's first sampled token."""
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    """History length the turn was sampled on (its prompt)."""
    num_cached_tokens: int | None
    """Of those, the tokens the prefix cache served (None over HTTP: read the server's prefix_cache_hits)."""

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class Trajectory:
    """A finished (or paused) session as one token sequence: T = len(token_ids)."""

    token_ids: list[int]
    """[T] the whole history: prompt, sampled turns, closings and environment messages."""
    mask: list[int]
    """[T] 1 on tokens the model sampled (train on them), 0 on everything else."""
    logprobs: list[float]
    """[T] the engine's logprob of each sampled token; 0.0 where mask is 0."""
    weight_versions: list[WeightVersionSpan]
    """(version, start, end) spans over token_ids: which weights sampled which tokens (only mask-1 tokens are covered)."""
    prompt_len: int
    """Tokens of the first prompt (the first turn starts there)."""
    turns: list[Turn]
    messages: list[dict[str, Any]]
    """The conversation as text: the given messages and each turn as an assistant message."""

    @property
    def final_text(self) -> str:
        """The last turn's text ("" before any turn): what a final-answer reward reads."""
        return self.turns[-1].text if self.turns else ""


# ---- backends: a RolloutWorker in this process, or a server over HTTP -------------------------------


class _Backend:
    """What a session needs of an engine: its chat template as tokens, batched generation on token ids, max_model_len."""

    max_model_len: int
    _closing: list[int] | None = None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[TurnSample]:
        raise NotImplementedError

    @property
    def closing(self) -> list[int]:
        """What the chat template writes after an assistant message's content (its first token ends a turn)."""
        if self._closing is None:
            tails = [self.render([_PROBE_USER, {"role": "assistant", "content": c}], False) for c in _PROBE_CONTENTS]
            common = 0
            while common < min(map(len, tails)) and tails[0][-1 - common] == tails[1][-1 - common]:
                common += 1
            self._closing = tails[0][len(tails[0]) - common:]
        return self._closing

    def delta(self, messages: list[dict]) -> list[int]:
        """The tokens the chat template adds for `messages` after an assistant message, through the next generation prompt."""
        probe = [_PROBE_USER, {"role": "assistant", "content": _PROBE_CONTENTS[0]}]
        base = self.render(probe, False)
        full = self.render(probe + messages, True)
        if full[: len(base)] != base:
            raise ValueError(
                "messages: the chat template does not render them as an extension of the conversation before "
                "them, so their tokens cannot be appended to the history"
            )
        return full[len(base):]


class _WorkerBackend(_Backend):
    """A RolloutWorker (or anything with its generate(), tokenizer-bearing engine and config)."""

    def __init__(self, worker) -> None:
        self.worker = weakref.proxy(worker)  # the worker's sessions keep it alive; this cache must not
        self.max_model_len = worker.config.model.max_model_len

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        # The engine's own renderer (the one chat requests go through), with its text bounds.
        _, ids = self.worker.engine.processor.tokenize(
            {"messages": messages, "add_generation_prompt": add_generation_prompt}
        )
        return ids

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[TurnSample]:
        outputs = self.worker.generate([{"prompt_token_ids": p} for p in prompts], params)
        samples = []
        for out in outputs:
            c = out.outputs[0]
            samples.append(TurnSample(
                token_ids=list(c.token_ids), logprobs=[pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)],
                text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                weight_versions=[WeightVersionSpan(*s) for s in c.weight_versions],
                num_cached_tokens=out.num_cached_tokens,
            ))
        return samples


def check_response(response, path: str) -> Any:
    """The JSON body (a text one as text: vLLM's LoRA routes answer a sentence); a 4xx is a ValueError (the
    request's fault), any other error a RuntimeError, with the server's message."""
    if response.status_code < 400:
        if not response.content:
            return {}
        return response.text if response.headers.get("content-type", "").startswith("text/plain") else response.json()
    try:
        detail = response.json()
        message = detail.get("error", {}).get("message") or detail.get("detail") or response.text
    except ValueError:
        message = response.text
    error = ValueError if response.status_code < 500 else RuntimeError
    raise error(f"{path}: HTTP {response.status_code}: {message}")


class GenerateClient(_Backend):
    """Sessions over HTTP: a `rollout launch` (or vLLM) server's /inference/v1/generate and /tokenize.

    One client serves many sessions; generate() sends concurrent requests so the server batches them.
    """

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S, max_concurrency: int = 64) -> None:
        from weight_transfer.clients import HTTPPool

        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected the server's http(s):// URL, got {base_url!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = HTTPPool(base_url.rstrip("/"), headers=headers, timeout=timeout)  # fresh connections after a 5xx
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency,
                                                           thread_name_prefix="rollout-session")
        try:
            card = check_response(self._http.get("/v1/models"), "/v1/models")["data"][0]
        except BaseException:
            self.close()
            raise
        self.model = model or card["id"]
        self.max_model_len = int(card["max_model_len"])

    def render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "add_special_tokens": False}
        return check_response(self._http.post("/tokenize", json=body), "/tokenize")["tokens"]

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[TurnSample]:
        futures = [self._pool.submit(self._generate_one, p, sp) for p, sp in zip(prompts, params)]
        return [f.result() for f in futures]

    def _generate_one(self, prompt: list[int], params: SamplingParams) -> TurnSample:
        fields = msgspec.to_builtins(params, str_keys=True)  # SamplingParams' non-default fields, by vLLM's names
        fields.pop("output_kind", None)  # the route sets it
        # output_mode "text": the turn's text beside its token ids, logprobs by position (clamped at -9999 as vLLM's).
        body = {"model": self.model, "token_ids": prompt, "sampling_params": fields, "output_mode": "text"}
        answer = check_response(self._http.post("/inference/v1/generate", json=body), "/inference/v1/generate")
        choice = answer["choices"][0]
        token_ids = list(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(token_ids):
            raise RuntimeError(f"/inference/v1/generate: {len(content)} logprobs for {len(token_ids)} tokens")
        return TurnSample(
            token_ids=token_ids, logprobs=[entry["logprob"] for entry in content], text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
            weight_versions=[WeightVersionSpan(s["version"], s["start"], s["end"])
                             for s in choice.get("weight_versions") or []],
            num_cached_tokens=None,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> GenerateClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# One backend per worker, so that sessions on the same worker generate in one batch (generate_turns).
_WORKER_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _backend_of(engine) -> _Backend:
    if isinstance(engine, _Backend):
        return engine
    if hasattr(engine, "generate") and hasattr(getattr(engine, "engine", None), "processor"):
        if engine not in _WORKER_BACKENDS:
            _WORKER_BACKENDS[engine] = _WorkerBackend(engine)
        return _WORKER_BACKENDS[engine]
    raise ValueError(f"engine: expected a RolloutWorker or a GenerateClient, got {type(engine).__name__}")


# ---- the session ------------------------------------------------------------------------------------


@dataclass
class _History:
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Appends environment tokens (logprobs None) or sampled ones."""
        self.token_ids.extend(token_ids)
        self.mask.extend([0 if logprobs is None else 1] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids) if logprobs is None else logprobs)


class RolloutSession:
    """`RolloutSession(engine, messages=None, sampling_params=None, *, prompt_token_ids=None)`: one multi-turn trajectory.

    `engine` is a RolloutWorker or a GenerateClient. The first prompt is `messages` through the chat
    template (with the generation prompt) or `prompt_token_ids` as given. `sampling_params` apply to
    every turn (n must be 1; run n sessions for n samples); each turn also stops on the end-of-turn
    token, reports the sampled token's logprob, and with a seed samples with seed + turn index.
    Calls alternate: generate(), add_messages(), generate(), ...; a refused call changes nothing.
    """

    def __init__(self, engine, messages: list[dict] | None = None, sampling_params: SamplingParams | None = None,
                 *, prompt_token_ids: Sequence[int] | None = None) -> None:
        self._engine = engine
        self._backend = _backend_of(engine)
        self._params = self._turn_params(sampling_params or SamplingParams())
        if (messages is None) == (prompt_token_ids is None):
            raise ValueError("messages: give exactly one of messages or prompt_token_ids")
        if messages is not None:
            prompt = self._backend.render(list(messages), True)
        else:
            prompt = list(prompt_token_ids)
            if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
                raise ValueError("prompt_token_ids: expected a non-empty list of token ids")
        self._check_room(len(prompt), "messages" if messages is not None else "prompt_token_ids")
        self._history = _History()
        self._history.extend(prompt)
        self.prompt_len = len(prompt)
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages or ()]
        self.turns: list[Turn] = []
        self._spans: list[WeightVersionSpan] = []
        self._closing_due: list[int] | None = None  # set after a turn: what add_messages() appends first

    @property
    def num_tokens(self) -> int:
        return len(self._history.token_ids)

    @property
    def awaiting_model(self) -> bool:
        """True when the next call is generate() (the history ends with a prompt or new messages)."""
        return self._closing_due is None

    def _check_room(self, num_tokens: int, what: str) -> None:
        """ValueError unless a history of num_tokens leaves room for at least one sampled token."""
        if num_tokens + 1 > self._backend.max_model_len:
            raise ContextFullError(
                f"{what}: the session's history would be {num_tokens} tokens, leaving no room for a model turn in "
                f"max_model_len={self._backend.max_model_len}"
            )

    def _turn_params(self, params: SamplingParams) -> SamplingParams:
        """`params` as a turn samples with them: the end-of-turn token stops it, the sampled token's logprob is reported."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"sampling_params.n: a session samples one trajectory, got n={params.n}; start n sessions")
        return params.clone(
            logprobs=params.logprobs if params.logprobs is not None else 0,
            stop_token_ids=sorted(set(params.stop_token_ids or ()) | set(self._backend.closing[:1])),
        )

    def _request(self, sampling_params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        if not self.awaiting_model:
            raise ValueError("session: the model's turn is over; add_messages() before the next generate()")
        self._check_room(self.num_tokens, "session")
        params = self._params if sampling_params is None else self._turn_params(sampling_params)
        if params.seed is not None:
            params = params.clone(seed=params.seed + len(self.turns))
        return list(self._history.token_ids), params

    def _record(self, sample: TurnSample) -> Turn:
        start = self.num_tokens
        turn = Turn(start=start, token_ids=sample.token_ids, text=sample.text, finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason, num_prompt_tokens=start, num_cached_tokens=sample.num_cached_tokens)
        self._history.extend(sample.token_ids, sample.logprobs)
        self._spans.extend(WeightVersionSpan(v, start + s, start + e) for v, s, e in sample.weight_versions)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": sample.text})
        closing = self._backend.closing
        ended = bool(closing) and bool(sample.token_ids) and sample.token_ids[-1] == closing[0]
        self._closing_due = closing[1:] if ended else list(closing)
        return turn

    def generate(self, sampling_params: SamplingParams | None = None) -> Turn:
        """Samples the model's next turn on the whole history and appends it; `sampling_params` replace the session's for this turn."""
        return generate_turns([self], sampling_params)[0]

    def add_messages(self, messages: list[dict]) -> list[int]:
        """Appends the rest of the model turn's closing and `messages`' template delta (environment tokens); returns what was appended."""
        if self.awaiting_model:
            raise ValueError("messages: the model has not taken its turn yet; generate() first")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages: expected a non-empty list of {role, content} objects")
        appended = self._closing_due + self._backend.delta(messages)
        self._check_room(self.num_tokens + len(appended), "messages")
        self._history.extend(appended)
        self.messages.extend(dict(m) for m in messages)
        self._closing_due = None
        return appended

    def trajectory(self) -> Trajectory:
        """The session so far as one sequence (a copy): tokens, mask, logprobs, weight-version spans, turns."""
        h = self._history
        return Trajectory(
            token_ids=list(h.token_ids), mask=list(h.mask), logprobs=list(h.logprobs),
            weight_versions=list(self._spans), prompt_len=self.prompt_len, turns=list(self.turns),
            messages=[dict(m) for m in self.messages],
        )


def generate_turns(sessions: Sequence[RolloutSession], sampling_params: SamplingParams | None = None) -> list[Turn]:
    """Each session's next turn, generated together (one batch per engine); all or none are appended.

    `sampling_params` replace each session's own for this turn (seeds still advance per session's turn).
    """
    groups: dict[int, list[int]] = {}
    requests = []
    for i, session in enumerate(sessions):
        requests.append(session._request(sampling_params))
        groups.setdefault(id(session._backend), []).append(i)
    samples: list[TurnSample | None] = [None] * len(sessions)
    for indices in groups.values():
        backend = sessions[indices[0]]._backend
        out = backend.generate([requests[i][0] for i in indices], [requests[i][1] for i in indices])
        for i, sample in zip(indices, out):
            samples[i] = sample
    return [session._record(sample) for session, sample in zip(sessions, samples)]
