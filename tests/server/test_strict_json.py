"""strict_json_loads: what a request body may hold before it reaches pydantic, msgspec and torch."""

from __future__ import annotations

import json

import pytest

from rollout.server.middleware import MAX_JSON_DEPTH, strict_json_loads


@pytest.mark.parametrize(
    "body,where",
    [
        (b'{"max_tokens": 18446744073709551617}', "max_tokens: integers must fit in 64 bits"),
        (b'{"a": [1, 2, -9223372036854775809]}', "a[2]: integers must fit in 64 bits"),
        (b'{"a": {"b": [{"c": 1e999}]}}', "a.b[0].c: numbers must be finite"),
        (b'{"t": NaN}', "NaN is not valid JSON"),
        (b'{"t": -Infinity}', "-Infinity is not valid JSON"),
        (b'{"p": "\\ud800x"}', "p: not valid text (a lone surrogate at character 0)"),
        (b'{"\\udc00": 1}', "body (an object key): not valid text"),
        (b'{"n": ' + b"7" * 5000 + b"}", "malformed JSON body"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nests deeper than 64 levels"),
        (b"[" * 100_000 + b"]" * 100_000, "deeper than 64 levels"),
        (b'{"p": "\xff"}', "not UTF-8"),
    ],
)
def test_unbounded_values_are_refused_naming_where(body, where):
    with pytest.raises(ValueError, match=None) as info:
        strict_json_loads(body)
    assert where in str(info.value)


def test_bounded_values_pass_unchanged():
    body = {"prompt": [0, 2**63 - 1, -(2**63)], "t": 0.5, "s": "caf\u00e9 \U0001f600", "deep": [[[[1]]]],
            "x": None, "b": True}
    assert strict_json_loads(json.dumps(body).encode()) == body
    assert strict_json_loads(b'"\\ud83d\\ude00"') == "\U0001f600"  # a surrogate pair is one character


def test_malformed_json_is_a_decode_error():
    with pytest.raises(json.JSONDecodeError):
        strict_json_loads(b'{"a": ')
