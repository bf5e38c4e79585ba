"""Build kio's per-version message classes from plain mappings.

kio has one frozen dataclass per API version and per nested struct, each version with
its own set of fields. The handlers describe an answer once, as nested dicts holding
every field any version has; :func:`build` keeps the fields the version's class
declares, builds nested structs from their annotated class, and fills a required field
the handler did not give with its empty value (Kafka's own default for a field the
version adds: null, an empty array, error code NONE, 0)."""

from __future__ import annotations

import dataclasses
import types
import typing
import uuid
from collections.abc import Callable, Hashable, Mapping
from datetime import timedelta
from functools import cache
from typing import Any, TypeVar, cast

from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta, i64Timedelta

T = TypeVar("T")


Converter = Callable[[Any], Any]


@cache
def _plan(cls: Hashable) -> tuple[tuple[str, Converter | None, bool, Any], ...]:
    """(name, converter (None: the value as given), required, type) of each field of a
    kio dataclass: what :func:`build` does with each field worked out once per class,
    not per answer (a Produce's answer took 16 µs of reflection per request)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            _converter(hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            hints[f.name],
        )
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    )


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of ``cls`` from ``values`` (extra keys are other versions' fields)."""
    kwargs: dict[str, Any] = {}
    for name, convert, required, hint in _plan(cast(Hashable, cls)):
        if name in values:
            value = values[name]
            kwargs[name] = value if convert is None or value is None else convert(value)
        elif required:
            kwargs[name] = _blank(hint)
    return cls(**kwargs)


def _optional(hint: Any) -> tuple[Any, bool]:
    """The type inside ``X | None`` and whether None was allowed."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


@cache
def _converter(hint: Any) -> Converter | None:
    """What a given value of type ``hint`` becomes (never called with None, which
    stays None): a tuple's items converted, a mapping built into its dataclass, an int
    of milliseconds a timedelta; None when every value stays as given."""
    inner, _ = _optional(hint)
    if typing.get_origin(inner) is tuple:
        (element, *_rest) = typing.get_args(inner)
        item = _converter(element)
        if item is None:
            return tuple
        return lambda value: tuple(None if v is None else item(v) for v in value)
    if dataclasses.is_dataclass(inner):
        entity = cast(type[Any], inner)
        return lambda value: build(entity, value) if isinstance(value, Mapping) else value
    if inner in (i32Timedelta, i64Timedelta):
        return lambda value: timedelta(milliseconds=value) if isinstance(value, int) else value
    return None


def _blank(hint: Any) -> Any:
    inner, nullable = _optional(hint)
    if nullable:
        return None
    if typing.get_origin(inner) is tuple:
        return ()
    if inner is ErrorCode:
        return ErrorCode.none
    if inner in (i32Timedelta, i64Timedelta):
        return timedelta(0)
    if inner is uuid.UUID:
        return uuid.UUID(int=0)
    if inner is str:
        return ""
    if inner is bool:
        return False
    if dataclasses.is_dataclass(inner):
        return build(inner, {})  # type: ignore[arg-type]
    return 0
