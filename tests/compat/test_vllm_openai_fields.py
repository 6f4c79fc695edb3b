"""The OpenAI-side fields against vLLM 0.33's own code: a real `rollout launch` (float32, tiny llama)
answers echo, /tokenize token_strs, /tokenizer_info, /v1/models and return_weight_versions in bodies that
vLLM's own response models parse and that carry no field vLLM's lack; vLLM's request model turns
lm-evaluation-harness's log-likelihood body into the same sampling parameters ours does; vLLM's own
TokenizerInfo builds the /tokenizer_info body ours answers; vLLM's length check words its 400 as ours."""

from __future__ import annotations

import json

import httpx
import pytest

from rollout.server import protocol as P

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_MODEL_LEN = 256  # tests/server_launch.py's
LM_EVAL_BODY = {"model": MODEL, "prompt": [[5, 17, 99, 230, 41]], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                "seed": 1234, "echo": True}


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def http(launch_server, model_path):
    server = launch_server(model_path, "--served-model-name", MODEL, "--enable-tokenizer-info-endpoint")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def vllm_completion(vllm_import):
    return vllm_import("vllm.entrypoints.openai.completion.protocol")


def _only_vllm_fields(body: dict, model, where: str) -> None:
    extra = set(body) - set(model.model_fields)
    assert not extra, f"{where}: fields vLLM's {model.__name__} does not have: {sorted(extra)}"


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_body_gives_vllms_sampling_params(vllm_completion, max_tokens):
    body = {**LM_EVAL_BODY, "max_tokens": max_tokens}
    theirs = vllm_completion.CompletionRequest(**body).to_sampling_params(max(max_tokens, 1), {})
    ours = P.CompletionRequest(**body).to_sampling_params(MAX_MODEL_LEN)
    for name in ("max_tokens", "logprobs", "prompt_logprobs", "temperature", "seed"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_echo_answers_parse_as_vllms(http, vllm_completion):
    for body in (LM_EVAL_BODY, {**LM_EVAL_BODY, "max_tokens": 0},
                 {**LM_EVAL_BODY, "return_weight_versions": True, "return_token_ids": True}):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        parsed = vllm_completion.CompletionResponse.model_validate(answer)
        _only_vllm_fields(answer, vllm_completion.CompletionResponse, "completion")
        for choice, theirs in zip(answer["choices"], parsed.choices):
            _only_vllm_fields(choice, vllm_completion.CompletionResponseChoice, "choice")
            _only_vllm_fields(choice["logprobs"], vllm_completion.CompletionLogProbs, "logprobs")
            assert theirs.logprobs.token_logprobs[0] is None and theirs.logprobs.top_logprobs[0] is None
            if body.get("return_weight_versions"):
                (span,) = theirs.weight_versions  # vLLM's WeightVersionSpan dataclass, read from our dicts
                assert (span.version, span.start, span.end) == ("default", 0, len(choice["token_ids"]))


def test_tokenize_token_strs_and_tokenizer_info_as_vllm_builds_them(http, vllm_import, model_path):
    from transformers import AutoTokenizer

    tokenize = vllm_import("vllm.entrypoints.serve.tokenize.protocol")
    serving = vllm_import("vllm.entrypoints.serve.tokenize.serving")
    # As vLLM loads a generating model's tokenizer (vllm/tokenizers/registry.py: truncation_side "left").
    tokenizer = AutoTokenizer.from_pretrained(model_path, truncation_side="left")

    answer = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    tokenize.TokenizeResponse.model_validate(answer)
    _only_vllm_fields(answer, tokenize.TokenizeResponse, "tokenize")
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert http.post("/tokenize", json={"prompt": "hello"}).json()["token_strs"] is None

    info = http.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    # vLLM's own builder over the same tokenizer (no --chat-template given, as here), as JSON writes it.
    assert info.json() == json.loads(json.dumps(serving.TokenizerInfo(tokenizer, None).to_dict()))
    tokenize.TokenizerInfoResponse.model_validate(info.json())


def test_models_card_has_vllms_fields(http, vllm_import):
    engine_protocol = vllm_import("vllm.entrypoints.serve.engine.protocol")
    answer = http.get("/v1/models").json()
    engine_protocol.ModelList.model_validate(answer)
    (card,) = answer["data"]
    assert set(card) == set(engine_protocol.ModelCard.model_fields)
    assert card["parent"] is None and card["root"] and card["max_model_len"] == MAX_MODEL_LEN
    (permission,) = card["permission"]
    assert set(permission) == set(engine_protocol.ModelPermission.model_fields)
    default = engine_protocol.ModelPermission()
    assert {k: v for k, v in permission.items() if k not in ("id", "created")} == {
        k: v for k, v in default.model_dump().items() if k not in ("id", "created")}


def test_max_tokens_over_max_model_len_words_its_400_as_vllm(http, vllm_import):
    params = vllm_import("vllm.renderers.params")
    with pytest.raises(Exception) as theirs:  # VLLMValidationError; vLLM's 400 says str() of it
        params.TokenizeParams(max_total_tokens=MAX_MODEL_LEN, max_output_tokens=MAX_MODEL_LEN + 1,
                              max_total_tokens_param="max_model_len", max_output_tokens_param="max_tokens")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN + 1})
    assert r.status_code == 400 and r.json()["error"]["message"] == str(theirs.value)
    assert r.json()["error"]["param"] == "max_tokens"


@pytest.fixture(scope="module")
def vllm_generate(vllm_import):
    return vllm_import("vllm.entrypoints.scale_out.token_in_token_out.protocol")


def test_generate_takes_vllms_request_and_answers_vllms_response(http, vllm_generate, vllm_import):
    from rollout.server.generate_routes import VLLM_ONLY_SAMPLING_FIELDS
    from engine.sampling_params import SamplingParams

    import msgspec

    # Every public field of vLLM's SamplingParams is ours or listed as vLLM-only.
    theirs = {f.name for f in msgspec.structs.fields(vllm_import("vllm.sampling_params").SamplingParams)}
    ours = {f.name for f in msgspec.structs.fields(SamplingParams)}
    assert {n for n in theirs if not n.startswith("_")} - ours - VLLM_ONLY_SAMPLING_FIELDS == set()

    for mode, response_model, chunk_model in (
        ("tokens", vllm_generate.GenerateTokensResponse, vllm_generate.GenerateTokensStreamResponse),
        ("text", vllm_generate.GenerateTextResponse, vllm_generate.GenerateTextStreamResponse),
    ):
        # The body vLLM's own request model writes (sampling_params dumped with vLLM's defaults).
        request = vllm_generate.GenerateRequest(
            token_ids=[5, 17, 99, 230], output_mode=mode, return_token_ids=True,
            sampling_params={"temperature": 0.0, "max_tokens": 4, "logprobs": 1, "ignore_eos": True})
        body = request.model_dump(mode="json")
        r = http.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        parsed = response_model.model_validate(answer)
        assert set(answer) == set(response_model.model_fields)
        (choice,) = answer["choices"]
        choice_model = type(parsed.choices[0])
        assert set(choice) == set(choice_model.model_fields), mode
        assert answer["request_id"] == request.request_id and len(choice["token_ids"]) == 4
        with http.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    chunk_model.model_validate(chunk)
                    assert set(chunk) <= set(chunk_model.model_fields)
