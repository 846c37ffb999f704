"""argparse options generated from the option dataclasses (one --flag per field)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _base_type(hint: Any) -> Any:
    """int for `int | None`, and so on; the hint itself when it is no union."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, required: tuple[str, ...] = ()) -> None:
    """One option per field of `cls`: --field-name, typed, defaulting to the field's default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        has_default = f.default is not dataclasses.MISSING
        default = f.default if has_default else None
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif kind in (int, float, str):
            parser.add_argument(flag, type=kind, default=default, required=not has_default or f.name in required,
                                help=f"default: {default}" if has_default else "required")
        else:
            raise TypeError(f"cli: field {cls.__name__}.{f.name} has unsupported type {hints[f.name]!r}")


def dataclass_from_args(cls: type[T], ns: argparse.Namespace) -> T:
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
