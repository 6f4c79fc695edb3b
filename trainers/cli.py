"""Nested config dataclasses <-> command line and config files: `--section.field-name` flags over a YAML/TOML `--config`.

    parser = build_parser(TrainerConfig, prog="python -m trainers.grpo")
    config = parse_config(TrainerConfig, argv)     # file values first, then flags on top

Every section is a dataclass field of the root config; its fields become `--section.field-name`
flags in a --help group titled by the section's docstring, and scalar fields of the root
become plain `--field-name` flags. Help texts are the fields' one-line docstrings (read by
rollout.cli_args.field_docs, the same helper `rollout launch` uses), so --help is complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, Union

from rollout.cli_args import field_docs

_NONE_WORDS = ("none", "null")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(T, True) for `T | None`, else (tp, False)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _parse_scalar(tp: Any, optional: bool, where: str):
    """An argparse `type=` callable for a scalar field; `none` gives None for optional fields."""

    def parse(text: str):
        if optional and text.lower() in _NONE_WORDS:
            return None
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{where}: expected {tp.__name__}, got {text!r}") from None

    parse.__name__ = tp.__name__  # argparse names the type in its own messages
    return parse


def _argument_spec(where: str, tp: Any) -> dict[str, Any]:
    tp, optional = _unwrap_optional(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(tp) is Literal:
        choices = list(typing.get_args(tp)) + ([None] if optional else [])
        kind = type(choices[0])
        parse = _parse_scalar(kind, optional, where)
        metavar = "{" + ",".join("none" if c is None else str(c) for c in choices) + "}"
        return {"type": parse, "choices": choices, "metavar": metavar}
    if tp in (int, float, str):
        metavar = tp.__name__.upper() + ("|none" if optional else "")
        return {"type": _parse_scalar(tp, optional, where), "metavar": metavar}
    raise TypeError(f"{where}: no CLI mapping for type {tp!r}; extend trainers.cli._argument_spec")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    return "required"


def _add_fields(parser: argparse.ArgumentParser, cls: type, prefix: str, title: str | None) -> None:
    doc = (cls.__doc__ or "").strip().splitlines()
    group = parser.add_argument_group(title, doc[0] if doc else None) if title else parser
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            continue
        text = docs.get(f.name)
        if text is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring; every config field needs one")
        dest = prefix + f.name
        flag = "--" + prefix + f.name.replace("_", "-")
        group.add_argument(
            flag,
            dest=dest,
            help=f"{text} (default: {_default_text(f)})".replace("%", "%%"),
            default=argparse.SUPPRESS,  # unset flags stay absent: the file's value or the dataclass default applies
            **_argument_spec(dest, hints[f.name]),
        )


def build_parser(cls: type, prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with `--config FILE` and one flag per leaf field of the nested dataclass `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").strip())
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML (.yaml/.yml) or TOML (.toml) file with the same nested fields; flags override its values.",
    )
    _add_fields(parser, cls, "", "general")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            _add_fields(parser, hints[f.name], f.name + ".", f.name)
    return parser


def load_config_file(path: str) -> dict[str, Any]:
    """The nested dict of a YAML or TOML config file (by extension)."""
    ext = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
        raise ValueError(f"config: no such file {path!r}")
    if ext == ".toml":
        import tomllib

        with open(path, "rb") as f:
            data = tomllib.load(f)
    elif ext in (".yaml", ".yml"):
        import yaml  # PyYAML; a dependency of transformers

        with open(path) as f:
            data = yaml.safe_load(f) or {}
    else:
        raise ValueError(f"config: {path!r} must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"config: {path!r} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _check_value(where: str, tp: Any, value: Any) -> Any:
    """`value` as field type `tp` (ints widen to float); ValueError naming the field otherwise."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{where}: must not be None")
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {list(choices)}")
        return value
    if tp is float and type(value) is int:
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and type(value) is not int):
            raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Builds nested dataclass `cls` from a nested dict; unknown, missing or mistyped fields raise ValueError naming them."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{', '.join(prefix + u for u in unknown)}: unknown field(s) of {cls.__name__}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        where = prefix + f.name
        if _is_section(hints[f.name]):
            section = data.get(f.name, {})
            if isinstance(section, hints[f.name]):
                kwargs[f.name] = section
            else:
                kwargs[f.name] = from_dict(hints[f.name], section if section is not None else {}, where + ".")
        elif f.name in data:
            kwargs[f.name] = _check_value(where, hints[f.name], data[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ValueError(f"{where}: required (give --{where.replace('_', '-')} or set it in --config)")
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """The nested dict of a config (what a config file holds; for logging and saving a run's settings)."""
    return dataclasses.asdict(config)


def parse_config(cls: type, argv: Sequence[str] | None = None, prog: str | None = None) -> Any:
    """Parses argv into `cls`: values of `--config FILE`, then flags over them, then the dataclasses' validation."""
    args = build_parser(cls, prog=prog).parse_args(argv)
    return config_from_namespace(cls, args)


def config_from_namespace(cls: type, args: argparse.Namespace) -> Any:
    given = dict(vars(args))
    path = given.pop("config", None)
    data = load_config_file(path) if path else {}
    for dest, value in given.items():
        node = data
        *sections, name = dest.split(".")
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise ValueError(f"{section}: expected a mapping in the config file")
        node[name] = value
    return from_dict(cls, data)
