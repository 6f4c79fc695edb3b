"""Wire messages of weight sync as msgspec Structs, and parse_message: the one strict conversion every init_info, update_info and baseline goes through.

A message type declares its fields, their types and their ranges; msgspec checks them all
(strictly: no bool for an int, no str for a number, unknown keys refused) and parse_message
turns its error into a ValueError that starts with the field path in our style:

    Expected `int` >= 0 - at `$.weights[0].shape[1]`   ->   update_info.weights[0].shape[1]: expected `int` >= 0
    Object missing required field `call_id`            ->   update_info.call_id: missing (update_info: missing field(s) ['call_id'])
    Object contains unknown field `port`               ->   init_info: unknown field(s) ['port']

Checks that involve several fields go in a message's check(), which msgspec runs as part of
the conversion (so a nested message's error carries its path too). A message built in Python
(NCCLTrainerInitInfo(...)) is converted once more from its own fields, so it is checked the
same way as one that came over the wire.
"""

from __future__ import annotations

import re
import sys
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar

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
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
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
        raise ValueError(_in_our_style(str(e), where)) from None
    finally:
        _converting.reset(token)


# True while parse_message converts: a Message's __post_init__ then runs only its check().
_converting: ContextVar[bool] = ContextVar("weight_transfer_converting", default=False)


def _decode(message_type: type, value: Any) -> Any:
    """msgspec's hook for the one type it does not know: a torch.dtype travels as its name (a message
    built in Python may hold the dtype itself)."""
    if message_type is torch.dtype:
        dtype = value if isinstance(value, torch.dtype) else getattr(torch, value, None) if isinstance(value, str) else None
        if isinstance(dtype, torch.dtype):
            return dtype
        raise ValueError(f"{value!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    raise NotImplementedError(f"no wire form for {message_type!r}")


#   <message>[ - at [`key` in ]`$<path>`]
_VALIDATION_ERROR = re.compile(r"(?P<message>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<field>[^`]+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")


def _in_our_style(error: str, where: str) -> str:
    """msgspec's "<what> - at `$.a[0].b`" as "where.a[0].b: <what>" (see the module docstring)."""
    m = _VALIDATION_ERROR.fullmatch(error)
    message, at = m["message"], where + (m["path"] or "")
    if m["key"]:
        at += " (a key)"
    if missing := _MISSING.fullmatch(message):
        return f"{at}.{missing['field']}: missing ({at}: missing field(s) [{missing['field']!r}])"
    if unknown := _UNKNOWN.fullmatch(message):
        return f"{at}: unknown field(s) [{unknown['field']!r}]"
    if message.startswith("."):  # a check() blaming one field of this message
        return at + message
    if message == "Invalid base64 encoded string":
        message = "not valid base64"
    return f"{at}: {message[:1].lower()}{message[1:]}"
