"""Hypothesis strategies for Kafka messages: any kio message class, built from its
fields' Kafka types (so every API and version gets one without a strategy per class),
and record batches."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.serial._introspect import (
    EntityField,
    EntityTupleField,
    PrimitiveField,
    PrimitiveTupleField,
    classify_field,
    get_field_tag,
    get_schema_field_type,
    is_optional,
)

from headwater.protocols.kafka.records import Record

_INTS = {
    "int8": 8,
    "int16": 16,
    "int32": 32,
    "int64": 64,
}
_UINTS = {"uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}


def _primitive(kafka_type: str) -> st.SearchStrategy[Any]:
    if kafka_type in _INTS:
        bits = _INTS[kafka_type]
        return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if kafka_type in _UINTS:
        return st.integers(0, 2 ** _UINTS[kafka_type] - 1)
    match kafka_type:
        case "string":
            return st.text(max_size=12)
        case "bytes" | "records":
            return st.binary(max_size=24)
        case "bool":
            return st.booleans()
        case "float64":
            return st.floats(allow_nan=False, allow_infinity=False)
        case "uuid":
            # the all-zero UUID reads back as None (Kafka's "no topic id")
            return st.uuids().filter(lambda value: value.int != 0)
        case "error_code":
            return st.sampled_from(list(ErrorCode))
        case "timedelta_i32":
            return st.integers(0, 2**31 - 1).map(lambda ms: timedelta(milliseconds=ms))
        case "timedelta_i64":
            return st.integers(0, 2**40).map(lambda ms: timedelta(milliseconds=ms))
        case "datetime_i64":
            return st.integers(0, 2**42).map(
                lambda ms: datetime.fromtimestamp(ms / 1000, UTC).replace(
                    microsecond=(ms % 1000) * 1000
                )
            )
    raise AssertionError(f"no strategy for {kafka_type}")


def _field(field: dataclasses.Field[Any], is_tag: bool) -> st.SearchStrategy[Any]:
    optional = is_optional(field) and not is_tag
    match classify_field(field):
        case PrimitiveField():
            value = _primitive(get_schema_field_type(field))
        case PrimitiveTupleField():
            value = st.lists(_primitive(get_schema_field_type(field)), max_size=3).map(tuple)
        case EntityField(nested):
            value = message(nested)
        case EntityTupleField(nested):
            value = st.lists(message(nested), max_size=2).map(tuple)
    return st.none() | value if optional else value


@cache
def message(cls: type) -> st.SearchStrategy[Any]:
    """Any instance of the kio class ``cls``."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in dataclasses.fields(cls):
        fields[field.name] = _field(field, get_field_tag(field) is not None)
    return st.builds(cls, **fields)


@st.composite
def records(draw: st.DrawFn, max_records: int = 12) -> list[Record]:
    """Records of one batch: offset deltas 0..n-1, any keys, values and headers."""
    count = draw(st.integers(1, max_records))
    optional_bytes = st.none() | st.binary(max_size=40)
    header = st.tuples(st.text(max_size=6), optional_bytes)
    return [
        Record(
            offset_delta=index,
            timestamp_delta=draw(st.integers(-(2**40), 2**40)),
            key=draw(optional_bytes),
            value=draw(optional_bytes | st.binary(min_size=200, max_size=2000)),
            headers=tuple(draw(st.lists(header, max_size=3))),
        )
        for index in range(count)
    ]


@st.composite
def uniform_records(draw: st.DrawFn, max_records: int = 150) -> list[Record]:
    """Records as a producer of fixed-size values sends them: one key and value size
    (a tombstone now and then), timestamp deltas mostly one byte, no headers; enough of
    them that the offset deltas take two bytes."""
    count = draw(st.integers(1, max_records))
    size = draw(st.integers(0, 200))
    key = draw(st.none() | st.binary(max_size=12))
    deltas = draw(st.sampled_from([st.integers(0, 30), st.integers(-3, 300)]))
    tombstones = draw(st.booleans())
    return [
        Record(
            offset_delta=index,
            timestamp_delta=draw(deltas),
            key=key,
            value=None if tombstones and index % 7 == 3 else bytes([index % 256]) * size,
            headers=(),
        )
        for index in range(count)
    ]
