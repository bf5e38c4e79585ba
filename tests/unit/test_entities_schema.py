"""headwater.entities: dataclass -> kind schema mapping, values, keys (no server)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Annotated, Optional

import pytest

from headwater import entities
from headwater.entities.schema import (
    Kind,
    entity_id,
    key_text,
    parse_key,
    parse_type,
    schema_fields,
)
from headwater.errors import UsageError
from headwater.protocols.convergedb.fields import (
    FieldType,
    decode_prefix,
    encode_fields,
)


@dataclass
class Everything:
    flag: bool
    count: int
    ratio: float
    name: str
    blob: bytes
    seen: dt.datetime
    small: entities.U8
    medium: entities.U16
    wide: entities.U32
    huge: entities.U64
    tiny: entities.I8
    short: entities.I16
    mid: entities.I32
    long: entities.I64
    single: entities.F32
    double: entities.F64
    ns: entities.Timestamp
    explicit: Annotated[int, FieldType.U16] = 7


def test_every_type_maps_to_its_code() -> None:
    fields = entities.dataclass_fields(Everything)
    assert [(f.name, f.type) for f in fields] == [
        ("flag", FieldType.BOOL),
        ("count", FieldType.I64),
        ("ratio", FieldType.F64),
        ("name", FieldType.STRING),
        ("blob", FieldType.BYTES),
        ("seen", FieldType.TIMESTAMP),
        ("small", FieldType.U8),
        ("medium", FieldType.U16),
        ("wide", FieldType.U32),
        ("huge", FieldType.U64),
        ("tiny", FieldType.I8),
        ("short", FieldType.I16),
        ("mid", FieldType.I32),
        ("long", FieldType.I64),
        ("single", FieldType.F32),
        ("double", FieldType.F64),
        ("ns", FieldType.TIMESTAMP),
        ("explicit", FieldType.U16),
    ]
    assert [f.name for f in fields if f.as_datetime] == ["seen"]


def _kind(cls: type, name: str = "k") -> Kind:  # type: ignore[type-arg]
    fields = entities.dataclass_fields(cls)
    return Kind(name, 5, 1, len(fields), cls, fields)


def test_values_round_trip_through_field_data() -> None:
    kind = _kind(Everything)
    when = dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC)
    value = Everything(
        True, -(2**62), 0.25, "héllo", b"\x00\xff", when, 255, 65535, 2**32 - 1, 2**64 - 1,
        -128, -32768, -(2**31), 2**63 - 1, 1.5, -2.5, 1_700_000_000_123_456_789,
    )  # fmt: skip
    assert kind.decode(kind.encode(value)) == value


def test_naive_datetime_is_utc_and_ints_fill_float_fields() -> None:
    @dataclass
    class Reading:
        at: dt.datetime
        temp: float

    kind = _kind(Reading)
    decoded = kind.decode(kind.encode(Reading(dt.datetime(2000, 1, 1), 21)))  # type: ignore[arg-type]
    assert decoded == Reading(dt.datetime(2000, 1, 1, tzinfo=dt.UTC), 21.0)
    assert isinstance(decoded.temp, float)
    # An int no float can hold: UsageError, as every other value that does not fit.
    with pytest.raises(UsageError, match=r"field temp: 1000\d* is past what a F64 holds"):
        kind.encode(Reading(dt.datetime(2000, 1, 1), 10**400))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="field temp"):
        kind.encode_patch({"temp": 10**400})


def test_wrong_values_are_refused_before_anything_is_sent() -> None:
    @dataclass
    class Small:
        level: entities.U8
        label: str

    kind = _kind(Small)
    with pytest.raises(UsageError, match=r"field 0 \(level\).*256 does not fit U8"):
        kind.encode(Small(256, "x"))
    with pytest.raises(UsageError, match="string field needs a str, not int"):
        kind.encode(Small(1, 5))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="takes Small values, not Everything"):
        kind.encode(object.__new__(Everything))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="has no field 'nope'"):
        kind.encode_patch({"nope": 1})
    with pytest.raises(UsageError, match="at least one field"):
        kind.encode_patch({})
    mask, data = kind.encode_patch({"label": "y"})
    assert mask == 0b10 and data == b"\x01\x00y"


@pytest.mark.parametrize(
    ("annotation", "message"),
    [
        (Optional[int], "ConvergeDB has no nulls"),  # noqa: UP045 - the spelling under test
        (int | None, "ConvergeDB has no nulls"),
        (list[int], "does not map to a field type"),
        (dict, "does not map to a field type"),
        (Annotated[str, FieldType.U8], "U8 field cannot be declared as <class 'str'>"),
        (Annotated[int, "meta"], "exactly one headwater FieldType"),
        (Annotated[float, FieldType.I32], "I32 field cannot be declared"),
    ],
)
def test_unmappable_annotations_are_refused(annotation: object, message: str) -> None:
    cls = type("Bad", (), {"__annotations__": {"x": annotation}})
    with pytest.raises(UsageError, match=message):
        entities.dataclass_fields(dataclass(cls))


def test_not_a_dataclass_or_too_many_fields() -> None:
    class Plain:
        x: int

    with pytest.raises(UsageError, match="declared as a dataclass"):
        entities.dataclass_fields(Plain)
    many = dataclass(type("Many", (), {"__annotations__": {f"f{i}": int for i in range(65)}}))
    with pytest.raises(UsageError, match="at most 64 fields"):
        entities.dataclass_fields(many)
    empty = dataclass(type("Empty", (), {}))
    with pytest.raises(UsageError, match="declares no fields"):
        entities.dataclass_fields(empty)


def test_kind_name_and_non_init_fields() -> None:
    @dataclass
    class Named:
        __kind__ = "sensor_v2"
        a: int
        b: str = field(default="")

    from headwater.entities.schema import kind_name_of

    assert kind_name_of(Named) == "sensor_v2"
    assert kind_name_of(Everything) == "Everything"
    assert [f.name for f in entities.dataclass_fields(Named)] == ["a", "b"]


def test_a_reader_with_a_prefix_schema_reads_longer_records() -> None:
    """After another writer appended fields, a dataclass of the old fields still reads."""

    @dataclass
    class Old:
        name: str
        temp: float

    wide = [("name", FieldType.STRING), ("temp", FieldType.F64), ("extra", FieldType.STRING)]
    record = encode_fields(wide, ["lab", 1.5, "appended later"])
    assert decode_prefix(wide[:2], record) == ["lab", 1.5]
    kind = Kind("k", 1, 2, 3, Old, entities.dataclass_fields(Old))
    assert kind.decode(record) == Old("lab", 1.5)


def test_dict_kinds_from_a_described_schema() -> None:
    specs = [("name", 12), ("at", 14), ("n", 4)]
    fields = schema_fields(specs)
    kind: Kind[dict[str, object]] = Kind("k", 1, 1, 3, dict, fields)
    when = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    data = kind.encode({"name": "a", "at": when})  # "n" left out: its zero value
    assert kind.decode(data) == {"name": "a", "at": when, "n": 0}
    with pytest.raises(UsageError, match="no field"):
        kind.encode({"zzz": 1})


def test_keys_and_entity_ids() -> None:
    assert entity_id("s1") == b"s1" + bytes(30)
    assert entity_id(b"\x01" * 32) == b"\x01" * 32
    long_key = "k" * 40
    assert len(entity_id(long_key)) == 32 and entity_id(long_key) != entity_id("k" * 41)
    assert key_text(entity_id("sensor-7")) == "sensor-7"
    raw = bytes(range(32))
    assert key_text(raw) == "0x" + raw.hex()
    assert parse_key(key_text(raw)) == raw
    assert parse_key("sensor-7") == entity_id("sensor-7")
    with pytest.raises(UsageError, match="str or bytes"):
        entity_id(5)  # type: ignore[arg-type]


def test_type_names() -> None:
    assert parse_type("u8") is FieldType.U8
    assert parse_type("STRING") is FieldType.STRING
    assert parse_type("float") is FieldType.F64
    assert parse_type("14") is FieldType.TIMESTAMP
    with pytest.raises(UsageError, match="unknown field type 'f128'"):
        parse_type("f128")
    with pytest.raises(UsageError, match="unknown field type '99'"):
        parse_type("99")
