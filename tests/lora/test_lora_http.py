"""LoRA over HTTP against a real `rollout launch`: --lora-modules, vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, adapters in /v1/models and selected by `model`, driven by the openai SDK and httpx."""

from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from engine.llm import LLM
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from peft_reference import MAX_TOKENS, make_peft_adapter, make_prompts

pytestmark = pytest.mark.slow

API_KEY = "sk-lora"
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
PROMPT = make_prompts(seed=3)[4]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> str:
    """The one directory the server may read adapters from at runtime (every adapter of these tests is inside)."""
    return str(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(launch_server, base_model, adapters, adapter_root):
    """"qv" from start-up; runtime updating switched on by vLLM's environment variable, behind an API key."""
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        return launch_server(base_model, *LORA_FLAGS, "--served-model-name", "base", "--api-key", API_KEY,
                             "--lora-modules", f"qv={adapters['qv'].lora_path}",
                             "--allowed-lora-paths", adapter_root)
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(base_model):
    llm = LLM(base_model, dtype="float32", device="cpu", max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, disable_log_stats=True)
    yield llm
    llm.shutdown()


def _offline_tokens(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
    c = out.outputs[0]
    return list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]


def _complete(client, model: str, prompt: list[int]):
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def _load(http, name: str, path: str, **extra) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra})


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_a_completion_with_an_adapter_from_lora_modules_equals_offline_generate(client, offline, adapters):
    got = _complete(client, "qv", PROMPT)
    want_tokens, want_logprobs = _offline_tokens(offline, PROMPT, adapters["qv"])
    (choice,) = got.choices
    assert got.model == "qv"
    assert choice.token_ids == want_tokens
    assert max(abs(g - w) for g, w in zip(choice.logprobs.token_logprobs, want_logprobs)) < 1e-4
    base = _complete(client, "base", PROMPT).choices[0]
    assert base.token_ids == _offline_tokens(offline, PROMPT, None)[0] != want_tokens  # the adapter changed them


def test_chat_and_generate_select_the_adapter_by_model(client, http, offline, adapters):
    chat = client.chat.completions.create(model="qv", messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=MAX_TOKENS, temperature=0.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.model == "qv"
    prompt_ids = chat.prompt_token_ids
    assert chat.choices[0].token_ids == _offline_tokens(offline, prompt_ids, adapters["qv"])[0]
    r = http.post("/inference/v1/generate", json={
        "model": "qv", "token_ids": PROMPT, "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                                 "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "qv"
    assert r.json()["choices"][0]["token_ids"] == _offline_tokens(offline, PROMPT, adapters["qv"])[0]


def test_models_lists_the_base_model_and_each_adapter_with_its_parent_and_root(http, base_model, adapters):
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["base"]["parent"] is None and cards["base"]["root"] == base_model
    assert cards["qv"]["parent"] == "base" and cards["qv"]["root"] == adapters["qv"].lora_path
    assert cards["qv"]["max_model_len"] is None and cards["qv"]["object"] == "model"


def test_an_unknown_model_is_vllms_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        _complete(client, "nope", PROMPT)
    assert caught.value.body == {"message": "The model `nope` does not exist. Valid aliases: base.",
                                 "type": "NotFoundError", "param": "model", "code": 404}


def test_load_at_runtime_use_it_then_unload(client, http, offline, adapters):
    mixed = adapters["mixed"]
    r = _load(http, "mixed", mixed.lora_path)
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'mixed' added successfully.")
    assert _complete(client, "mixed", PROMPT).choices[0].token_ids == _offline_tokens(offline, PROMPT, mixed)[0]
    assert "mixed" in {card["id"] for card in http.get("/v1/models").json()["data"]}

    again = _load(http, "mixed", mixed.lora_path)
    assert again.status_code == 400 and _error(again)["type"] == "InvalidUserInput"
    assert "'mixed' has already been loaded" in _error(again)["message"]
    clash = _load(http, "base", mixed.lora_path)
    assert clash.status_code == 400 and "conflicts with a served base model" in _error(clash)["message"]

    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "mixed"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'mixed' removed successfully.")
    with pytest.raises(openai.NotFoundError, match="The model `mixed` does not exist"):
        _complete(client, "mixed", PROMPT)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "mixed", "lora_int_id": 2})
    assert gone.status_code == 404
    assert _error(gone) == {"message": "The lora adapter 'mixed' cannot be found.", "type": "NotFoundError",
                            "param": None, "code": 404}
    assert "mixed" not in {card["id"] for card in http.get("/v1/models").json()["data"]}


def test_load_inplace_replaces_the_adapter_under_its_name(client, http, offline, adapters):
    assert _load(http, "swap", adapters["mixed"].lora_path).status_code == 200
    r = _load(http, "swap", adapters["all"].lora_path, load_inplace=True)
    assert r.status_code == 200, r.text
    assert _complete(client, "swap", PROMPT).choices[0].token_ids == _offline_tokens(offline, PROMPT, adapters["all"])[0]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"}).status_code == 200


@pytest.fixture(scope="module")
def bad_paths(base_model, tmp_path_factory) -> dict[str, str]:
    return {
        "rank": make_peft_adapter(base_model, tmp_path_factory.mktemp("bad-rank"), r=32, target_modules=["q_proj"]),
        "target": make_peft_adapter(base_model, tmp_path_factory.mktemp("bad-target"), r=4,
                                    target_modules=["q_proj", "lm_head"]),
    }


@pytest.mark.parametrize("case, status, phrase", [
    ("rank", 400, r"rank 32 is above max_lora_rank \(16\)"),
    ("target", 400, "target module 'lm_head' is not supported"),
    ("missing", 404, "Loading lora bad failed: No adapter found for"),
    ("outside", 400, "is not inside the server's --allowed-lora-paths"),
])
def test_a_bad_adapter_is_refused_naming_the_problem_and_the_server_serves_on(
        client, http, offline, adapters, adapter_root, bad_paths, case, status, phrase):
    path = {**bad_paths, "missing": os.path.join(adapter_root, "no-such-adapter"), "outside": "/etc"}[case]
    r = _load(http, "bad", path)
    assert r.status_code == status, r.text
    assert re.search(phrase, _error(r)["message"]), _error(r)
    assert "bad" not in {card["id"] for card in http.get("/v1/models").json()["data"]}
    with pytest.raises(openai.NotFoundError):
        _complete(client, "bad", PROMPT)
    assert _complete(client, "qv", PROMPT).choices[0].token_ids == _offline_tokens(offline, PROMPT, adapters["qv"])[0]


def test_the_lora_routes_need_the_api_key(server, adapters):
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        r = anonymous.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapters["all"].lora_path})
        assert r.status_code == 401
        assert anonymous.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 401


def test_without_runtime_updating_the_routes_are_not_served(launch_server, base_model, adapters):
    """vLLM does not mount them without VLLM_ALLOW_RUNTIME_LORA_UPDATING: FastAPI's own 404."""
    server = launch_server(base_model, *LORA_FLAGS, "--lora-modules", f'{{"name": "qv", "path": "{adapters["qv"].lora_path}"}}')
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": adapters["all"].lora_path})
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 404
        assert "qv" in {card["id"] for card in c.get("/v1/models").json()["data"]}  # the JSON form of --lora-modules


def test_a_trainers_http_engine_loads_and_unloads_through_the_declared_routes(server, http, base_model, adapters):
    from trainers.engines import HTTPRolloutEngine

    engine = HTTPRolloutEngine(server.url, base_model, api_key=API_KEY)
    try:
        assert engine.load_lora_adapter("from-trainer", adapters["all"].lora_path) is None
        assert "from-trainer" in {card["id"] for card in http.get("/v1/models").json()["data"]}
        engine.unload_lora_adapter("from-trainer")
        with pytest.raises(ValueError, match="HTTP 404: The lora adapter 'from-trainer' cannot be found"):
            engine.unload_lora_adapter("from-trainer")
    finally:
        engine.shutdown()
