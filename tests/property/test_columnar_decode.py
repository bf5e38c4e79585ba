"""The columnar decoders read what decoding events one by one reads: on any mix of
stored batch pieces of both forms (headwater's, with or without keys, tombstones,
headers and offset gaps; Kafka's, of every codec, with null keys and values, headers
and either timestamp type; of varying sizes, and of one size as numpy reads them), cut
anywhere, the records path's columns and the projection's data column equal the events
:meth:`Batch.events` (aiokafka's decoder for Kafka form) gives; the Arrow append's
sections are what encoding event by event stores."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_strategies import records, uniform_records
from records_checks import check_records_columns

from headwater.protocols.kafka.records import (
    CRC_OFFSET,
    Compression,
    TimestampType,
)
from headwater.protocols.kafka.records import (
    build_batch as build_kafka_batch,
)
from headwater.server.http.arrow import keys_section as arrow_keys_section
from headwater.server.http.arrow import values_section as arrow_values_section
from headwater.sql.projection import _Piece
from headwater.storage.batch import Batch, build_batch, encode_values

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = st.binary(max_size=5) | st.sampled_from([b"trace", b"\xff\xfe", "é".encode()])


@st.composite
def headwater_batch(draw: st.DrawFn, offset: int, position: int) -> Batch:
    n = draw(st.integers(1, 6))
    values = draw(st.lists(st.binary(max_size=30) | st.just(b'{"a":1}'), min_size=n, max_size=n))
    keys = tombstones = headers = deltas = None
    if draw(st.booleans()):
        keys = draw(st.lists(st.none() | st.binary(max_size=8), min_size=n, max_size=n))
        tombstones = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    if draw(st.booleans()):
        header = st.tuples(NAMES, st.binary(max_size=6))
        headers = draw(st.lists(st.lists(header, max_size=3), min_size=n, max_size=n))
    if n > 1 and draw(st.booleans()):
        deltas = [0]
        for gap in draw(st.lists(st.integers(1, 4), min_size=n - 1, max_size=n - 1)):
            deltas.append(deltas[-1] + gap)
    stored = build_batch(
        encode_values(values),
        n,
        base_offset=offset,
        first_position=position,
        timestamp_ms=draw(st.integers(0, 1 << 41)),
        keys=keys,
        tombstones=tombstones,
        headers=headers,
        deltas=deltas,
    )
    return Batch(memoryview(stored))


@st.composite
def kafka_batch(draw: st.DrawFn, offset: int, position: int) -> Batch:
    batch_records = draw(records(max_records=8) | uniform_records())
    log_append = draw(st.booleans())
    base = draw(st.integers(2**40, 2**41))
    section = build_kafka_batch(
        batch_records,
        base_timestamp=base,
        compression=draw(st.sampled_from(list(Compression))),
        timestamp_type=TimestampType.LOG_APPEND_TIME if log_append else TimestampType.CREATE_TIME,
        max_timestamp=base + 7 if log_append else None,
    )[CRC_OFFSET:]
    stored = build_batch(
        section,
        len(batch_records),
        base_offset=offset,
        first_position=position,
        timestamp_ms=base + 7 if log_append else base,
        kafka=True,
    )
    return Batch(memoryview(stored))


@st.composite
def pieces(draw: st.DrawFn) -> list[_Piece]:
    out: list[_Piece] = []
    offset = draw(st.integers(0, 1 << 40))
    position = draw(st.integers(0, 1 << 40))
    for _ in range(draw(st.integers(1, 8))):
        form = kafka_batch if draw(st.booleans()) else headwater_batch
        batch = draw(form(offset, position))
        start = draw(st.integers(0, batch.count - 1))
        stop = draw(st.integers(start + 1, batch.count))
        out.append(_Piece(batch, start, stop))
        offset = batch.next_offset + draw(st.integers(0, 3))
        position += draw(st.integers(batch.count, batch.count + 50))
    return out


@SETTINGS
@given(pieces())
def test_columns_equal_the_events_decoded_one_by_one(chosen: list[_Piece]) -> None:
    batch, events = check_records_columns(chosen)
    assert batch.column("position").to_pylist() == [e.position for e in events]
    assert batch.column("ts").cast("int64").to_pylist() == [e.timestamp_ms * 1000 for e in events]


@SETTINGS
@given(
    st.lists(st.tuples(st.binary(max_size=30), st.none() | st.binary(max_size=8)), min_size=1),
    st.integers(0, 3),
)
def test_an_arrow_append_stores_the_sections_encoding_event_by_event_stores(
    rows: list[tuple[bytes, bytes | None]], skip: int
) -> None:
    # The Arrow append handler's sections (one compiled pass) against the stored form
    # that encoding the events one by one gives; a sliced array (offset > 0) too.
    rows = rows[min(skip, len(rows) - 1) :]
    values = pa.array([b"x" * skip] + [v for v, _ in rows], pa.binary()).slice(1)
    keys = pa.array([None] + [k for _, k in rows], pa.binary()).slice(1)
    section, value_bytes = arrow_values_section(values)
    assert section == encode_values([v for v, _ in rows])
    assert value_bytes == sum(len(v) for v, _ in rows)
    stored = Batch(
        memoryview(
            build_batch(
                section,
                len(rows),
                base_offset=0,
                first_position=0,
                timestamp_ms=0,
                keys=[k for _, k in rows],
            )
        )
    )
    keys_section = stored.keys_section()
    assert keys_section is not None
    assert arrow_keys_section(keys) == bytes(keys_section)
