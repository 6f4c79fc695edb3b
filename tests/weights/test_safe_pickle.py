"""safe_pickle.loads: admits exactly the allow-listed globals, refuses hostile pickles by name (no engine)."""

from __future__ import annotations

import collections
import operator
import os
import pickle
import subprocess

import pytest

from weight_transfer import safe_pickle

PLAIN = frozenset()


class Boom:
    """A pickle whose load would call `fn(*args)` - the classic code-execution payload."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_plain_values_need_no_globals():
    value = {"a": [1, 2.5, b"\x00\x01"], "b": ("x", None, True)}
    assert safe_pickle.loads(pickle.dumps(value), PLAIN, what="plain") == value


def test_allowed_global_is_resolved_and_called():
    data = pickle.dumps(collections.OrderedDict(a=1))
    got = safe_pickle.loads(data, frozenset({("collections", "OrderedDict")}), what="ordered")
    assert got == collections.OrderedDict(a=1) and type(got) is collections.OrderedDict


def test_mapping_substitutes_the_callable():
    data = pickle.dumps(Boom(operator.add, 2, 3))
    key = (operator.add.__module__, "add")  # "_operator" on CPython
    assert safe_pickle.loads(data, frozenset({key}), what="add") == 5
    calls = []

    def rebuild(*args):
        calls.append(args)
        return "substituted"

    assert safe_pickle.loads(data, {key: rebuild}, what="add") == "substituted"
    assert calls == [(2, 3)]


@pytest.mark.parametrize(
    "payload, refused",
    [
        (Boom(os.system, "echo pwned"), "system"),  # posix.system / nt.system
        (Boom(eval, "1+1"), "builtins.eval"),
        (Boom(exec, "x=1"), "builtins.exec"),
        (Boom(subprocess.check_output, ["true"]), "subprocess.check_output"),
        (Boom(__import__, "os"), "builtins.__import__"),
        (Boom(getattr, "os", "system"), "builtins.getattr"),
    ],
)
def test_hostile_globals_refused_naming_what_and_global(payload, refused):
    with pytest.raises(ValueError, match=rf"init_info\.thing: refused to unpickle global .*{refused}"):
        safe_pickle.loads(pickle.dumps(payload), PLAIN, what="init_info.thing")


def test_nested_reduce_inside_allowed_structure_is_refused():
    # The outer callable is allowed; an argument to it is itself a reduce of os.system.
    data = pickle.dumps(collections.OrderedDict(x=Boom(os.system, "echo pwned")))
    with pytest.raises(ValueError, match=r"nested: refused to unpickle global .*system"):
        safe_pickle.loads(data, frozenset({("collections", "OrderedDict")}), what="nested")


def test_allowing_one_builtin_does_not_allow_others():
    data = pickle.dumps(Boom(eval, "1"))
    with pytest.raises(ValueError, match=r"builtins\.eval"):
        safe_pickle.loads(data, frozenset({("builtins", "bytes")}), what="uid")


def test_every_protocol_refused():
    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(ValueError, match="refused"):
            safe_pickle.loads(pickle.dumps(Boom(eval, "1"), protocol=proto), PLAIN, what="p")


def test_size_limit_and_empty_and_garbage():
    data = pickle.dumps(b"x" * 1000)
    with pytest.raises(ValueError, match=r"big: pickle of \d+ bytes is over the 100-byte limit"):
        safe_pickle.loads(data, PLAIN, what="big", max_bytes=100)
    with pytest.raises(ValueError, match="e: empty pickle"):
        safe_pickle.loads(b"", PLAIN, what="e")
    with pytest.raises(ValueError, match="g: not a readable pickle"):
        safe_pickle.loads(b"\x80\x04garbage", PLAIN, what="g")
    with pytest.raises(ValueError, match="t: not a readable pickle"):
        safe_pickle.loads(pickle.dumps([1, 2, 3])[:-3], PLAIN, what="t")
    with pytest.raises(ValueError, match="s: expected pickled bytes, got str"):
        safe_pickle.loads("abc", PLAIN, what="s")


def test_persistent_id_refused():
    import io

    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return "pid" if obj == "magic" else None

    buf = io.BytesIO()
    P(buf).dump(["magic"])
    with pytest.raises(ValueError, match="pp: refused a pickle persistent id"):
        safe_pickle.loads(buf.getvalue(), PLAIN, what="pp")


def test_allowed_must_be_mapping_or_frozenset():
    with pytest.raises(TypeError, match="allowed must be"):
        safe_pickle.loads(pickle.dumps(1), {("builtins", "bytes")}, what="x")  # a plain set
