"""Rollout engines outside the trainer's process - a `rollout launch` server over HTTP, a RolloutWorker Ray actor - behind the RolloutWorker methods the trainers call.

Both adapters give what trainers.common, trainers.rollouts and trainers.async_rollouts use:
generate(prompts, params, use_tqdm=False) -> RequestOutputs with the sampled tokens' logprobs
and weight_versions spans, agenerate(prompt, params), tokenizer, the controls of
engine/control.py (pause_generation/resume_generation, sleep/wake_up, get_weight_version, weight_checker...; over HTTP
those with a route), weight_sync_client() (the weight_transfer client that reaches the same
engine) and shutdown().
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from typing import Any

import msgspec

from engine import SamplingParams
from engine.control import Control, forward_controls, http_request, http_result
from rollout.session import check_response
from weight_transfer.clients import HTTPWeightSyncClient, RayWeightSyncClient

# SamplingParams fields that never travel over HTTP: the adapter's own choices or engine internals.
_LOCAL_FIELDS = ("output_kind", "detokenize", "bad_words_token_ids")
DEFAULT_TIMEOUT_S = 600.0
logger = logging.getLogger(__name__)


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _params_list(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """(prompts, one SamplingParams per prompt), normalised as RolloutWorker.generate does."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    params_list = list(sampling_params)
    if len(params_list) != len(prompts):
        raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
    return prompts, params_list


# ---- HTTP --------------------------------------------------------------------------------------


def completion_body(model_name: str, prompt: Any, params: SamplingParams) -> dict:
    """The /v1/completions body of one prompt (text, token ids or {"prompt_token_ids": [...]}) under `params`."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise ValueError(f"prompt: a dict prompt needs prompt_token_ids, got keys {sorted(prompt)}")
        prompt = list(prompt["prompt_token_ids"])
    elif not isinstance(prompt, (str, list)):
        raise ValueError(  # noqa: TRY004 - bad input is a ValueError naming the field, as everywhere here
            f"prompt: expected text, token ids or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )
    # Only non-default fields (omit_defaults); the server's names are SamplingParams' own.
    fields = msgspec.to_builtins(params, str_keys=True)
    for name in _LOCAL_FIELDS:
        fields.pop(name, None)
    # The legacy-completions default of max_tokens is 16 as in SamplingParams, so omission agrees.
    return {**fields, "model": model_name, "prompt": prompt, "return_token_ids": True, "return_weight_versions": True,
            "stream": False}


def request_output(body: dict, prompt: Any):
    """A RequestOutput from the /v1/completions response of one prompt (return_token_ids on).

    Each position's logprobs hold the sampled token only: the legacy format keys its top-k by
    text, which cannot be mapped back to token ids.
    """
    from engine.outputs import CompletionOutput, Logprob, RequestOutput

    choices = sorted(body["choices"], key=lambda c: c["index"])
    if not choices or choices[0].get("token_ids") is None:
        raise ValueError("response: no token ids in the choices; the request must set return_token_ids")
    outputs = []
    for c in choices:
        token_ids = list(c["token_ids"])
        logprobs = cumulative = None
        if c.get("logprobs") is not None:
            lp = c["logprobs"]
            logprobs = [
                {tid: Logprob(logprob=value, decoded_token=text)} if value is not None else {}
                for tid, value, text in zip(token_ids, lp["token_logprobs"], lp["tokens"])
            ]
            cumulative = sum(v for v in lp["token_logprobs"] if v is not None)
        outputs.append(CompletionOutput(
            index=c["index"], text=c["text"], token_ids=token_ids, cumulative_logprob=cumulative, logprobs=logprobs,
            finish_reason=c.get("finish_reason"), stop_reason=c.get("stop_reason"),
            weight_versions=[(s["version"], s["start"], s["end"]) for s in c.get("weight_versions") or []],
        ))
    return RequestOutput(
        request_id=body["id"], prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(choices[0]["prompt_token_ids"]),
        prompt_logprobs=_prompt_logprobs(choices[0].get("prompt_logprobs")), outputs=outputs, finished=True,
    )


def _prompt_logprobs(positions: list | None):
    """The server's prompt_logprobs JSON ({token id as text: {logprob, rank, decoded_token}} per position) as Logprobs."""
    from engine.outputs import Logprob

    if positions is None:
        return None
    return [
        None if position is None else {
            int(tid): Logprob(logprob=lp["logprob"], rank=lp.get("rank"), decoded_token=lp.get("decoded_token"))
            for tid, lp in position.items()
        }
        for position in positions
    ]


@forward_controls(asynchronous=False, include=lambda declared: declared.route is not None)
class HTTPRolloutEngine:
    """A `rollout launch --enable-rl-routes` server as a rollout worker; one /v1/completions request per prompt.

    The server should report processed logprobs (`--logprobs-mode processed_logprobs`), as the
    trainer scores the tempered distribution. `tokenizer` is a local directory with the
    server's tokenizer (the policy checkpoint); it gives the trainer the pad token.
    """

    def __init__(self, base_url: str, tokenizer: str, *, api_key: str | None = None,
                 timeout: float | None = DEFAULT_TIMEOUT_S, max_concurrency: int = 64) -> None:
        from weight_transfer.clients import HTTPPool

        self.base_url = base_url.rstrip("/")
        self.config = None  # the server's configuration stays on the server
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._http = HTTPPool(self.base_url, headers=self._headers, timeout=timeout)  # fresh connections after a 5xx
        self._weights = HTTPWeightSyncClient(self.base_url, api_key=api_key, timeout=timeout)
        self._api_key = api_key
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout-http")
        try:
            self.model_name = check_response(self._http.get("/v1/models"), "/v1/models")["data"][0]["id"]
            self.tokenizer = _load_tokenizer(tokenizer)
        except BaseException:
            self.shutdown()
            raise

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, lora_request=None) -> list:
        """Every prompt to completion (concurrent requests, so the server batches them); outputs in prompt order.
        lora_request: an adapter the server serves by its lora_name (the requests' `model`)."""
        prompts, params_list = _params_list(prompts, sampling_params)
        model = self._model_for(lora_request)
        bodies = [completion_body(model, p, sp) for p, sp in zip(prompts, params_list)]
        futures = [self._pool.submit(self._post_completion, body) for body in bodies]
        return [request_output(f.result(), p) for f, p in zip(futures, prompts)]

    def _post_completion(self, body: dict) -> dict:
        return check_response(self._http.post("/v1/completions", json=body), "/v1/completions")

    def _model_for(self, lora_request) -> str:
        return self.model_name if lora_request is None else lora_request.lora_name

    async def agenerate(self, prompt, sampling_params: SamplingParams | None = None, lora_request=None):
        """One prompt's final RequestOutput; cancelling closes the connection, which aborts the request on the server."""
        import httpx

        body = completion_body(self._model_for(lora_request), prompt, sampling_params or SamplingParams())
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout) as http:
            response = await http.post("/v1/completions", json=body)
        return request_output(check_response(response, "/v1/completions"), prompt)

    # ---- controls: every control with an HTTP route (engine/control.py) -------------------------

    def _forward_control(self, declared: Control, args: tuple) -> Any:
        """The control's RL route; the weight-sync calls through the HTTPWeightSyncClient (WeightSyncError on failure)."""
        if declared.weight_sync:
            return getattr(self._weights, declared.name)(*args)
        verb, path, query, body = http_request(declared, args)
        return http_result(declared, check_response(self._http.request(verb, path, params=query or None, json=body), path))

    def weight_sync_client(self) -> HTTPWeightSyncClient:
        """A client of this server's RL routes for a weight sync (its own connection pool)."""
        return HTTPWeightSyncClient(self.base_url, api_key=self._api_key, timeout=self._timeout)

    def shutdown(self) -> None:
        """Closes this side's connections; the server belongs to whoever launched it and keeps running."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._weights.close()
        self._http.close()


# ---- Ray ---------------------------------------------------------------------------------------


def _ray_env() -> dict:
    """runtime_env for a Ray cluster this process starts: its workers import this repository as the trainer does."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}}


@forward_controls(asynchronous=False)
class RayRolloutEngine:
    """A RolloutWorker Ray actor as a rollout worker: each call is the actor's method, awaited with ray.get.

    `tokenizer` is a local directory with the engine's tokenizer (the policy checkpoint).
    With owns_actor, shutdown() also ends the actor.
    """

    def __init__(self, actor, tokenizer: str, *, owns_actor: bool = False, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        self.actor = actor
        self.config = None  # the engine's configuration lives in the actor
        self.timeout = timeout
        self._owns_actor = owns_actor
        self.tokenizer = _load_tokenizer(tokenizer)

    @classmethod
    def start(cls, model: str, *, num_gpus: float = 0.0, timeout: float | None = DEFAULT_TIMEOUT_S,
              **worker_args: Any) -> RayRolloutEngine:
        """A fresh RolloutWorker actor on `model` (ray.init() first when this process is not connected); waits until it serves."""
        import ray

        from rollout import RolloutWorker

        if not ray.is_initialized():
            ray.init(runtime_env=_ray_env(), include_dashboard=False)
        actor = RolloutWorker.as_ray_actor(model, num_cpus=1, num_gpus=num_gpus, ready_timeout_s=timeout, **worker_args)
        return cls(actor, model, owns_actor=True, timeout=timeout)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, lora_request=None) -> list:
        prompts, params_list = _params_list(prompts, sampling_params)
        return self._call("generate", prompts, params_list, False, lora_request)

    async def agenerate(self, prompt, sampling_params: SamplingParams | None = None, lora_request=None):
        """One prompt's final RequestOutput; cancelling cancels the actor's task, which aborts the request."""
        import ray

        ref = self.actor.agenerate.remote(prompt, sampling_params or SamplingParams(), None, lora_request)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    # ---- controls: every control declared in engine/control.py, the actor's method ---------------

    def _forward_control(self, declared: Control, args: tuple) -> Any:
        return self._call(declared.name, *args)

    def weight_sync_client(self) -> RayWeightSyncClient:
        return RayWeightSyncClient([self.actor], timeout=self.timeout)

    def shutdown(self) -> None:
        """Ends the actor if this adapter started it (its engine first, then its process)."""
        if not self._owns_actor:
            return
        import ray

        self._owns_actor = False
        try:
            self._call("shutdown")
        finally:
            ray.kill(self.actor)
            _wait_until_dead(self.actor, _ACTOR_EXIT_S)


_ACTOR_EXIT_S = 30.0  # how long shutdown waits for a killed actor's process to be gone


def _wait_until_dead(actor, timeout_s: float) -> None:
    """Returns once calls to `actor` fail as a dead actor's (ray.kill only asks for its end: a call sent right
    after could still reach the live actor), or after timeout_s with a warning."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    logger.warning("RayRolloutEngine: the killed actor still answered after %.0f s", timeout_s)
