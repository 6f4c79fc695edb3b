"""Builds argparse flags from config dataclasses: one `--field-name` per field, typed, with its docstring as help."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from typing import Any, Literal, Union


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right below `name: type = ...`),
    inherited ones included: a dataclass base's docs first, a subclass's own override them."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object and dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    class_def = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    docs: dict[str, str] = {}
    body = class_def.body
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for `T | None`, else (tp, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return str(f.default_factory())  # type: ignore[misc]
    return "required"


def _argument_spec(name: str, tp: Any) -> dict[str, Any]:
    """argparse keyword arguments for a field of type `tp`."""
    tp, _optional = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        choices = list(typing.get_args(tp))
        return {"choices": choices, "type": type(choices[0]), "metavar": "{" + ",".join(map(str, choices)) + "}"}
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1]
        return {"nargs": "*", "type": item, "metavar": name.upper()}
    if tp in (int, float, str):
        return {"type": tp, "metavar": tp.__name__.upper()}
    if tp is dict or origin is dict:
        return {"type": _json_object, "metavar": "JSON"}
    raise TypeError(f"{name}: no CLI mapping for type {tp!r}; extend rollout.cli_args._argument_spec")


def _json_object(text: str) -> dict:
    """A dict flag's value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_dataclass_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str,
    *,
    required: tuple[str, ...] = (),
    extra_help: dict[str, str] | None = None,
) -> argparse._ArgumentGroup:
    """Adds one flag per field of dataclass `cls`, in a --help group named `title`.

    Defaults stay in the dataclass: an unset flag is absent from the namespace (SUPPRESS),
    so the dataclass's own default (and its validation) applies.
    """
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0] or None)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        doc = docs.get(f.name)
        if doc is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring; every config field needs one")
        if extra_help and f.name in extra_help:
            doc = f"{doc} {extra_help[f.name]}"
        is_required = f.name in required
        help_text = doc if is_required else f"{doc} (default: {_default_text(f)})"
        spec = _argument_spec(f.name, hints[f.name])
        group.add_argument(
            flag_name(f.name),
            dest=f.name,
            help=help_text.replace("%", "%%"),
            required=is_required,
            default=argparse.SUPPRESS,
            **spec,
        )
    return group


def dataclass_kwargs(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` that were given on the command line, as keyword arguments."""
    given = vars(namespace)
    return {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
