"""parse_message: strict conversion of wire messages, and its errors naming the field in our style (no engine)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec
import pytest
import torch

from weight_transfer.messages import Message, NonEmptyStr, NonNegInt, TimeoutS, int_in, parse_message


class Handle(Message, tag_field="kind", tag="a"):
    name: Annotated[str, msgspec.Meta(pattern=r"^h-\d+\Z", description="a handle name (h-<n>)")]


class OtherHandle(Message, tag_field="kind", tag="b"):
    size: int_in(1)


class Entry(Message):
    slot: int_in(0, 7)
    handle: Handle | OtherHandle


class Call(Message):
    where: ClassVar[str] = "update_info"

    names: list[NonEmptyStr]
    dtypes: list[torch.dtype]
    entries: dict[str, Entry] = {}
    mode: Literal["fast", "safe"] = "fast"
    timeout_s: TimeoutS = 1.0
    count: NonNegInt = 0

    def check(self) -> None:
        if len(self.names) != len(self.dtypes):
            raise ValueError(f".dtypes: {len(self.dtypes)} for {len(self.names)} names")


GOOD = {"names": ["w"], "dtypes": ["bfloat16"], "entries": {"k1": {"slot": 1, "handle": {"kind": "a", "name": "h-1"}}}}


def test_a_good_message_converts_to_its_types():
    call = parse_message(GOOD, Call, "update_info")
    assert call.dtypes == [torch.bfloat16] and call.entries["k1"].handle == Handle("h-1")
    assert call.timeout_s == 1.0 and call.mode == "fast"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"count": -1}, "update_info.count: -1 is below 0"),
        ({"count": 2**63}, r"update_info.count: 9223372036854775808 is out of range \(must be <= 2\*\*63 - 1\)"),
        ({"count": 10**400}, r"update_info.count: an integer of 1329 bits is out of range"),
        ({"count": True}, r"update_info.count: expected `int`, got `bool`"),
        ({"timeout_s": float("nan")}, r"update_info.timeout_s: nan is not above 0.0"),
        ({"mode": "quick"}, r"update_info.mode: expected 'fast' or 'safe', got 'quick'"),
        ({"dtypes": ["floaty"]}, r"update_info.dtypes\[0\]: 'floaty' is not a torch dtype name"),
        ({"dtypes": []}, r"update_info.dtypes: 0 for 1 names"),  # a check() naming its field
        ({"names": [""]}, r"update_info.names\[0\]: '' is not a non-empty string"),
        ({"extra": 1}, r"update_info: unknown field\(s\) \['extra'\]"),
        # A dict entry is named by its key (msgspec says [...]), also when a good entry comes first.
        ({"entries": {**GOOD["entries"], "k2": {"slot": 9, "handle": {"kind": "b", "size": 1}}}},
         r"update_info.entries\['k2'\].slot: 9 is out of range \(must be <= 7\)"),
        ({"entries": {"k1": {"slot": 0, "handle": {"kind": "c"}}}},
         r"update_info.entries\['k1'\].handle.kind: expected 'a' or 'b', got 'c'"),
        ({"entries": {"k1": {"slot": 0, "handle": {"kind": "a", "name": "../x"}}}},
         r"update_info.entries\['k1'\].handle.name: '../x' is not a handle name \(h-<n>\)"),
        ({"entries": {"k1": {"slot": 0}}},
         r"update_info.entries\['k1'\].handle: missing \(update_info.entries\['k1'\]: missing field\(s\) \['handle'\]\)"),
        ({"entries": {3: GOOD["entries"]["k1"]}}, r"update_info.entries \(a key\): expected `str`, got `int`"),
    ],
)
def test_a_bad_field_is_a_value_error_naming_it(change, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        parse_message({**GOOD, **change}, Call, "update_info")


def test_a_message_built_in_python_is_checked_like_a_received_one():
    assert Call(["w"], [torch.float32]).dtypes == [torch.float32]
    with pytest.raises(ValueError, match=r"^update_info.timeout_s: 0 is not above 0.0"):
        Call(["w"], [torch.float32], timeout_s=0)
    with pytest.raises(ValueError, match=r"^update_info.dtypes: 0 for 1 names"):
        Call(["w"], [])
    with pytest.raises(ValueError, match=r"^update_info.count: -1 is below 0"):
        msgspec.structs.replace(Call(["w"], [torch.float32]), count=-1)


def test_a_message_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError, match=r"^update_info: expected `object`, got `array`"):
        parse_message([GOOD], Call, "update_info")
    with pytest.raises(ValueError, match=r"^baseline\['a'\]: expected `str`, got `int`"):
        parse_message({"a": 1}, dict[str, str], "baseline")
