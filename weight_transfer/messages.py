"""Weight sync's wire messages as msgspec Structs, and parse_message: the one strict conversion they all go through.

A message type declares its fields, their types and their ranges; msgspec checks them all
(strictly: no bool for an int, no str for a number, unknown keys refused) and parse_message
turns its error into a ValueError that starts with the field path in our style:

    Expected `int` >= 0 - at `$.weights[0].shape[1]`
        update_info.weights[0].shape[1]: -1 is below 0
    Invalid value 'nfs' - at `$.buffer[...].handle.kind`
        update_info.buffer['cpu:...'].handle.kind: expected 'shm' or 'cuda', got 'nfs'
    Object missing required field `call_id`
        update_info.call_id: missing (update_info: missing field(s) ['call_id'])
    Object contains unknown field `port`
        init_info: unknown field(s) ['port']

A type with a constraint (a pattern, a length) may say what it wants (msgspec.Meta(description=...)):
a value that breaks the constraint "is not <description>".

Checks that involve several fields go in a message's check(), which msgspec runs as part of
the conversion (so a nested message's error carries its path too). A message built in Python
(NCCLTrainerInitInfo(...)) is converted once more from its own fields, so it is checked the
same way as one that came over the wire.
"""

from __future__ import annotations

import re
import sys
import types
import typing
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import torch

# No integer past 64 bits reaches torch, NIXL or msgspec's encoder, and no wait on a peer is
# longer than a day (datetime.timedelta overflows long before inf).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TIMEOUT_S = 24 * 3600.0


def int_in(ge: int = INT64_MIN, le: int = INT64_MAX) -> Any:
    """The type of an int in [ge, le]; the default bounds keep it within 64 bits."""
    return Annotated[int, msgspec.Meta(ge=ge, le=le)]


NonNegInt = int_in(0)
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string")]
# Both bounds finite: NaN fails every comparison and inf the upper bound, so these floats are finite.
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every wire message: strict types, declared ranges, no unknown keys, check() between fields."""

    # The name a message built in Python is reported under (a received one: parse_message's `where`).
    where: ClassVar[str] = "message"

    def __post_init__(self) -> None:
        if _converting.get():
            self.check()
        else:  # built in Python: msgspec has checked none of its fields yet
            fields = {f.encode_name: getattr(self, f.name) for f in msgspec.structs.fields(self)}
            parse_message(fields, type(self), self.where)

    def check(self) -> None:
        """Checks between fields, run after their types and ranges held. Raises ValueError(".field: why")
        to blame one field (the path is added in front), or ValueError("why") for the message as a whole."""


def parse_message(raw: Any, message_type: Any, where: str) -> Any:
    """raw (a dict from JSON, ZMQ or a caller) strictly converted to message_type; ValueError naming the field.

    message_type may be any type msgspec converts to (a Message, dict[str, str], a bounded number).
    """
    token = _converting.set(True)
    try:
        return msgspec.convert(raw, message_type, strict=True, dec_hook=_decode)
    except msgspec.ValidationError as e:
        raise ValueError(_in_our_style(str(e), raw, message_type, where)) from None
    finally:
        _converting.reset(token)


# True while parse_message converts: a Message's __post_init__ then runs only its check().
_converting: ContextVar[bool] = ContextVar("weight_transfer_converting", default=False)


def replace_parsed(message: Message, **changes: Any) -> Any:
    """`message` (parsed) with some fields replaced by values parse_message already checked, each as its field
    declares it: only check() runs again (ValueError from it), not the conversion of every field."""
    token = _converting.set(True)
    try:
        return msgspec.structs.replace(message, **changes)
    finally:
        _converting.reset(token)


# Every name torch gives a dtype ("bfloat16", "float32", also aliases such as "half").
_DTYPES = {name: dtype for name in dir(torch) if isinstance(dtype := getattr(torch, name), torch.dtype)}


def _decode(message_type: type, value: Any) -> Any:
    """msgspec's hook for the one type it does not know: a torch.dtype travels as its name (a message
    built in Python may hold the dtype itself)."""
    if message_type is torch.dtype:
        dtype = _DTYPES.get(value) if type(value) is str else value  # (a dict: this runs once per tensor)
        if type(dtype) is torch.dtype:
            return dtype
        raise ValueError(f"{_shown(value)} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    # msgspec's dec_hook protocol: NotImplementedError says "not a type this hook converts", which msgspec
    # then reports as an unsupported type (no message here declares one).
    raise NotImplementedError(f"no wire form for {message_type!r}")


# ---- msgspec's errors in our words ------------------------------------------------------------------

#   <message>[ - at [`key` in ]`$<path>`]
_VALIDATION_ERROR = re.compile(r"(?P<message>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_PATH_STEP = re.compile(r"\.(?P<field>[^.\[]+)|\[(?P<index>\d+)\]|\[\.\.\.\]")  # .field, [3], or [...]: a dict's value
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")
_RANGE = re.compile(r"Expected `\w+` (?P<op>>=|>|<=|<) (?P<bound>\S+)")
_RANGE_WORDS = {">=": "is below {}", ">": "is not above {}", "<=": "is out of range (must be <= {})",
                "<": "is out of range (must be < {})"}
_BOUND_WORDS = {str(INT64_MAX): "2**63 - 1", str(INT64_MIN): "-2**63"}
_NOT_FOUND = object()  # where the walk along the error's path could not follow the value


def _in_our_style(error: str, raw: Any, message_type: Any, where: str) -> str:
    """msgspec's "<what> - at `$.a[0].b`" as "where.a[0].b: <what>", in our words (see the module docstring).

    The path is followed through `raw` and message_type, so that the message can name the key of a
    dict entry (msgspec says [...]), show the offending value, and list the values a field allows.
    """
    m = _VALIDATION_ERROR.fullmatch(error)
    message = m["message"]
    at, value, value_type = _follow(m["path"] or "", raw, message_type, where)
    if m["key"]:  # a key of the dict at the path
        at += " (a key)"
        value, value_type = _failing_key(value, value_type)
    if missing := _MISSING.fullmatch(message):
        return f"{at}.{missing['field']}: missing ({at}: missing field(s) [{missing['field']!r}])"
    if unknown := _UNKNOWN.fullmatch(message):
        return f"{at}: unknown field(s) [{unknown['field']!r}]"
    if message.startswith("."):  # a check() blaming one field of this message
        return at + message
    if value is not _NOT_FOUND:
        shown = _shown(value)
        if bounds := _RANGE.fullmatch(message):
            bound = _BOUND_WORDS.get(bounds["bound"], bounds["bound"])
            return f"{at}: {shown} {_RANGE_WORDS[bounds['op']].format(bound)}"
        if message == "Number out of range":
            return f"{at}: {shown} is out of range"
        if message.startswith(("Invalid enum value", "Invalid value")) and _choices(value_type):
            return f"{at}: expected {_choices(value_type)}, got {shown}"
        # A constraint (pattern, length) the value broke, on a type that says what it wants.
        if message.startswith("Expected `") and ", got" not in message and _description(value_type):
            return f"{at}: {shown} is not {_description(value_type)}"
    if message == "Invalid base64 encoded string":
        message = "not valid base64"
    return f"{at}: {message[:1].lower()}{message[1:]}"


def _follow(path: str, raw: Any, message_type: Any, where: str) -> tuple[str, Any, Any]:
    """The error's path rendered from `where` with dict keys filled in, and the value and type found there."""
    at, value, value_type = where, raw, message_type
    for step in _PATH_STEP.finditer(path):
        try:
            value, value_type, shown_step = _step(step, value, value_type)
        except (KeyError, IndexError, TypeError, AttributeError, StopIteration):  # not the shape the path says
            return at + path[step.start():], _NOT_FOUND, None
        at += shown_step
    return at, value, value_type


def _step(step: re.Match, value: Any, value_type: Any) -> tuple[Any, Any, str]:
    """One step of an error's path: the value and type found there, and how the step reads."""
    union = _members(value_type)
    if step["field"] is not None:
        name = step["field"]
        tags = [member.__struct_config__.tag for member in union
                if _is_struct(member) and member.__struct_config__.tag_field == name]
        if tags:  # the tag of a tagged union (a handle's "kind"): its values are the members' tags
            return value[name], Literal.__getitem__(tuple(tags)), f".{name}"
        struct = next(member for member in union if _is_struct(member) and isinstance(value, Mapping)
                      and _tag_fits(member, value))
        field = next(f for f in msgspec.structs.fields(struct) if f.encode_name == name)
        return value[name], field.type, f".{name}"
    if step["index"] is not None:
        i = int(step["index"])
        array = next(member for member in union if typing.get_origin(member) in (list, tuple, set, frozenset))
        args = typing.get_args(array)
        fixed = typing.get_origin(array) is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        return value[i], args[i] if fixed else args[0], f"[{i}]"
    # [...]: an entry of a dict. Which one msgspec does not say; the first that fails to convert.
    entry_type = typing.get_args(next(member for member in union if typing.get_origin(member) is dict))[1]
    key = next(k for k, v in value.items() if not _converts(v, entry_type))
    return value[key], entry_type, f"[{key!r}]"


def _members(value_type: Any) -> list[Any]:
    """The types a value of value_type may be converted to: the members of a union, Annotated taken off."""
    while typing.get_origin(value_type) is Annotated:
        value_type = typing.get_args(value_type)[0]
    if typing.get_origin(value_type) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(value_type) for m in _members(arg)]
    return [value_type]


def _is_struct(value_type: Any) -> bool:
    return isinstance(value_type, type) and issubclass(value_type, msgspec.Struct)


def _tag_fits(struct: type, value: Mapping) -> bool:
    config = struct.__struct_config__
    return config.tag_field is None or value.get(config.tag_field) == config.tag


def _failing_key(value: Any, value_type: Any) -> tuple[Any, Any]:
    """The first key of a dict that does not convert to the dict type's key type, and that type."""
    try:
        dict_type = next(member for member in _members(value_type) if typing.get_origin(member) is dict)
        key_type = typing.get_args(dict_type)[0]
        return next(k for k in value if not _converts(k, key_type)), key_type
    except (StopIteration, TypeError, IndexError):
        return _NOT_FOUND, None


def _converts(value: Any, value_type: Any) -> bool:
    try:
        msgspec.convert(value, value_type, strict=True, dec_hook=_decode)
    except msgspec.ValidationError:
        return False
    return True


def _choices(value_type: Any) -> str | None:
    """"'a', 'b' or 'c'": the values a Literal allows (None for another type)."""
    literals = [v for m in _members(value_type) if typing.get_origin(m) is Literal for v in typing.get_args(m)]
    if not literals:
        return None
    shown = [repr(v) for v in literals]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _description(value_type: Any) -> str | None:
    """The description its Meta gives a field's type (for a pattern: what a matching string is)."""
    while typing.get_origin(value_type) is Annotated:
        value_type, *metas = typing.get_args(value_type)
        for meta in metas:
            if isinstance(meta, msgspec.Meta) and meta.description:
                return meta.description
    return None


def _shown(value: Any) -> str:
    """A value for a message: short (no value in an error may be unbounded)."""
    if type(value) is int and value.bit_length() > 64:  # (a bool is no int here)
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."
