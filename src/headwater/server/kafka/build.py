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
from collections.abc import Hashable, Mapping
from datetime import timedelta
from functools import cache
from typing import Any, TypeVar, cast

from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta, i64Timedelta

T = TypeVar("T")


@cache
def _hints(cls: Hashable) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type, required) of each field of a kio dataclass."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (
            f.name,
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    )


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of ``cls`` from ``values`` (extra keys are other versions' fields)."""
    kwargs: dict[str, Any] = {}
    for name, hint, required in _hints(cast(Hashable, cls)):
        if name in values:
            kwargs[name] = _convert(hint, values[name])
        elif required:
            kwargs[name] = _blank(hint)
    return cls(**kwargs)


def _optional(hint: Any) -> tuple[Any, bool]:
    """The type inside ``X | None`` and whether None was allowed."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    inner, _ = _optional(hint)
    if typing.get_origin(inner) is tuple:
        (element, *_rest) = typing.get_args(inner)
        return tuple(_convert(element, item) for item in value)
    if isinstance(value, Mapping) and dataclasses.is_dataclass(inner):
        return build(inner, value)  # type: ignore[arg-type]
    if inner in (i32Timedelta, i64Timedelta) and isinstance(value, int):
        return timedelta(milliseconds=value)
    return value


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
