"""A dataclass's fields checked against their annotations at construction, so that a wrong
type is a TypeError naming the field where the user wrote it, not an AttributeError deep in
the engine later (a dict where a struct belongs: issue 52, finding 12)."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from typing import Any


def check_field_types(obj: Any) -> None:
    """TypeError naming the first field of dataclass `obj` whose value its annotation does not
    admit. Integers (numpy's too, never bool) stand for floats; list[X] checks each item."""
    cls = type(obj)
    for name, allowed in _field_types(cls):
        value = getattr(obj, name)
        if not _admits(allowed, value):
            raise TypeError(f"{cls.__name__}.{name} must be {_describe(allowed)}, got "
                            f"{_type_name(value)}")


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _admits(allowed: Any, value: Any) -> bool:
    origin = typing.get_origin(allowed)
    if origin in (typing.Union, types.UnionType):
        return any(_admits(a, value) for a in typing.get_args(allowed))
    if allowed is Any:
        return True
    if allowed is None or allowed is type(None):
        return value is None
    if allowed is bool:
        return isinstance(value, bool)
    if allowed is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if allowed is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(allowed)
        return isinstance(value, list) and all(_admits(item, v) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, allowed)


def _describe(allowed: Any) -> str:
    if typing.get_origin(allowed) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(allowed))
    if allowed is None or allowed is type(None):
        return "None"
    if typing.get_origin(allowed) is not None:
        return str(allowed)
    return getattr(allowed, "__name__", str(allowed))


def _type_name(value: Any) -> str:
    if isinstance(value, list) and value:
        return f"list[{' | '.join(sorted({type(v).__name__ for v in value}))}]"
    return type(value).__name__
