"""Projection building blocks: bulk column building from stored batches, rounds that
start and stop inside batches, sparse batches, merging, and slicing by position."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from headwater.protocols.kafka.records import Record
from headwater.protocols.kafka.records import build_batch as build_kafka_batch
from headwater.sql import projection as projection_module
from headwater.sql.duck import Database
from headwater.sql.projection import (
    _JSON_VALID_SQL,
    JSON_FIRST_BYTES,
    SCHEMA,
    ChunkBuilder,
    _Piece,
    may_be_json,
    read_round,
    table_at,
)
from headwater.storage import kafka_batch
from headwater.storage.batch import Batch, build_batch, encode_values
from headwater.storage.kafka_batch import PREFIX_SIZE, check_section
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy


@pytest.fixture
def builder() -> Iterator[ChunkBuilder]:
    db = Database()
    chunk_builder = ChunkBuilder(db)
    yield chunk_builder
    chunk_builder.close()
    db.close()


def test_rounds_start_and_stop_inside_batches(tmp_path: Path, builder: ChunkBuilder) -> None:
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    values = [json.dumps({"i": i}).encode() if i % 3 else b"\x00raw" for i in range(12)]
    position = 100
    for first in range(0, 12, 4):
        plog.append(values[first : first + 4], first_position=position, timestamp_ms=5)
        position += 10  # positions interleave with other streams of the tenant
    pieces, next_offset = read_round(plog, 2, 9)
    assert next_offset == 9
    chunk = builder.build(pieces)
    table = pa.Table.from_batches([chunk.batch], SCHEMA)
    expected_positions = [102, 103, 110, 111, 112, 113, 120]
    assert table.column("offset").to_pylist() == list(range(2, 9))
    assert table.column("position").to_pylist() == expected_positions
    assert table.column("data").to_pylist() == values[2:9]
    assert table.column("json").to_pylist() == [
        None if i % 3 == 0 else values[i].decode() for i in range(2, 9)
    ]
    assert table.column("ts").cast(pa.int64()).to_pylist() == [5000] * 7
    assert (chunk.min_position, chunk.max_position, chunk.monotonic) == (102, 120, True)
    # Slicing by position is a prefix of the chunk.
    assert table_at([chunk], 111).column("offset").to_pylist() == [2, 3, 4]
    assert table_at([chunk], 102).num_rows == 0
    assert table_at([chunk], 10**9).num_rows == 7
    plog.close()


def test_sparse_batches_use_their_offset_deltas(builder: ChunkBuilder) -> None:
    values = [b'{"a":1}', b"x", b"[2]"]
    data = build_batch(
        encode_values(values),
        3,
        base_offset=10,
        first_position=50,
        timestamp_ms=1,
        deltas=[0, 2, 5],
    )
    batch = Batch(memoryview(data))
    chunk = builder.build([_Piece(batch, 1, 3)])
    assert chunk.batch.column(0).to_pylist() == [12, 15]
    assert chunk.batch.column(1).to_pylist() == [52, 55]
    assert chunk.batch.column(3).to_pylist() == [b"x", b"[2]"]
    assert chunk.batch.column(4).to_pylist() == [None, "[2]"]


def test_merge_keeps_rows_and_shares_bytes(builder: ChunkBuilder) -> None:
    chunks = []
    for first in range(0, 40, 4):
        values = [b"{}" if i % 2 else b"nope" for i in range(first, first + 4)]
        data = build_batch(
            encode_values(values), 4, base_offset=first, first_position=first, timestamp_ms=0
        )
        chunks.append(builder.build([_Piece(Batch(memoryview(data)), 0, 4)]))
    tail: list = []
    for chunk in chunks:
        tail = builder.extend(tail, chunk)
    assert [c.rows for c in tail] == [32, 8]  # a binary counter of small chunks
    merged = table_at(tail, 40)
    assert merged.column("offset").to_pylist() == list(range(40))
    assert merged.column("json").to_pylist() == [("{}" if i % 2 else None) for i in range(40)]
    batch = tail[0].batch
    assert batch.column(3).buffers()[2].address == batch.column(4).storage.buffers()[2].address


def test_out_of_order_positions_are_filtered_not_sliced(builder: ChunkBuilder) -> None:
    pieces = []
    for base, position in ((0, 20), (2, 10)):
        data = build_batch(
            encode_values([b"a", b"b"]),
            2,
            base_offset=base,
            first_position=position,
            timestamp_ms=0,
        )
        pieces.append(_Piece(Batch(memoryview(data)), 0, 2))
    chunk = builder.build(pieces)
    assert not chunk.monotonic
    assert table_at([chunk], 15).column("position").to_pylist() == [10, 11]
    assert table_at([chunk], 21).column("position").to_pylist() == [20, 10, 11]


# Text after a first byte that some JSON needs: the rest of true, false, null, NaN, nan,
# inf, Infinity (DuckDB's json_valid takes those), numbers, strings, containers.
_TAILS = [b"", b"1", b"rue", b"alse", b"ull", b"an", b"AN", b"nf", b"NF", b"nfinity"]
_TAILS += [b"}", b"]", b'"', b" 1", b"0", b".5", b"e5", b"{}", b"[]", b' "a"', b"\n[1]"]


def test_no_event_starting_with_another_byte_is_json_to_duckdb(builder: ChunkBuilder) -> None:
    # The projection asks DuckDB's json_valid only of chunks with an event starting with
    # one of JSON_FIRST_BYTES: with any other first byte, no event is JSON to DuckDB.
    others = [bytes([b]) + tail for b in range(256) if b not in JSON_FIRST_BYTES for tail in _TAILS]
    others.append(b"")
    cur = builder._cursor()
    cur.register("hw_chunk", pa.table({"data": pa.array(others, pa.binary())}))
    try:
        verdicts = cur.sql(_JSON_VALID_SQL).fetchall()
    finally:
        cur.unregister("hw_chunk")
    assert [v for (v,), event in zip(verdicts, others, strict=True) if v] == []
    # ... and each of those bytes starts some JSON text, so none is there for nothing.
    starting = [bytes([b]) + tail for b in JSON_FIRST_BYTES for tail in _TAILS]
    cur.register("hw_chunk", pa.table({"data": pa.array(starting, pa.binary())}))
    try:
        accepted = {
            event[0]
            for (v,), event in zip(cur.sql(_JSON_VALID_SQL).fetchall(), starting, strict=True)
            if v
        }
    finally:
        cur.unregister("hw_chunk")
    assert accepted == set(JSON_FIRST_BYTES)


def test_a_chunk_without_json_skips_duckdb_and_reads_the_same(builder: ChunkBuilder) -> None:
    binary = [b"\x00\x00\x00\x00\x07avro", b"v" * 100, b"", b"\xef\xbb\xbf{}"]
    assert not may_be_json(pa.array(binary, pa.binary()))
    assert not may_be_json(pa.array([b"x", b"{}", b"y"], pa.binary()).slice(2))
    assert may_be_json(pa.array([b"x", b"{}", b"y"], pa.binary()).slice(1))
    for values in (binary, [*binary, b'{"a": 1}', b" 7"]):
        stored = build_batch(
            encode_values(values), len(values), base_offset=0, first_position=0, timestamp_ms=1
        )
        batch = Batch(memoryview(stored))
        chunk = builder.build([_Piece(batch, 0, len(values))])
        assert chunk.batch.column("json").storage.to_pylist() == [
            None if i < len(binary) else v.decode() for i, v in enumerate(values)
        ]


def test_a_round_of_kafka_batches_is_read_where_the_log_read_them(
    tmp_path: Path, builder: ChunkBuilder
) -> None:
    # More than the log's default 1 MiB read: the round's batches still come from one
    # read, and their values are read in that buffer, not first joined into a copy.
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    values: list[bytes] = []
    for n in range(12):
        count = 1_000 if n != 5 else 40  # a short batch among long ones
        batch = [b"%02d-%05d" % (n, i) + b"v" * 92 for i in range(count)]
        records = [Record(i, i // 300, None, value) for i, value in enumerate(batch)]
        section = build_kafka_batch(records, base_timestamp=1_000)[PREFIX_SIZE:]
        header = check_section(section, 1 << 20)
        plog.append_encoded(
            section,
            header.records_count,
            first_position=plog.end_offset,
            timestamp_ms=header.max_timestamp,
            kafka=True,
        )
        values += batch
    assert plog.end_offset == len(values)
    pieces, next_offset = read_round(plog, 0, plog.end_offset)
    assert next_offset == len(values)
    sections = [piece.batch.kafka_section for piece in pieces]
    assert sum(map(len, filter(None, sections))) > 1 << 20
    spans = kafka_batch.sections_values([s for s in sections if s is not None])
    assert isinstance(spans.body, memoryview)  # in the read's buffer: no joined copy
    chunk = builder.build(pieces)
    assert chunk.batch.column(3).to_pylist() == values
    plog.close()


def test_a_full_round_is_cut_inside_a_batch_and_seals_as_built(
    tmp_path: Path, builder: ChunkBuilder, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rounds of several batches end at exactly ROUND_ROWS (= SEAL_ROWS) rows: a chunk
    # that is sealed as it is built, never first merged (copied) with the next one's.
    monkeypatch.setattr(projection_module, "ROUND_ROWS", 100)
    monkeypatch.setattr(projection_module, "SEAL_ROWS", 100)
    plog = PartitionLog.open(tmp_path, LogConfig(sync=SyncPolicy("none")))
    values = [b"%03d" % i for i in range(210)]
    for first in range(0, 210, 30):
        plog.append(values[first : first + 30], first_position=first, timestamp_ms=5)
    pieces, next_offset = read_round(plog, 0, 210)
    assert (next_offset, sum(p.stop - p.start for p in pieces)) == (100, 100)
    assert (pieces[-1].start, pieces[-1].stop) == (0, 10)  # 10 of the fourth batch's 30
    chunk = builder.build(pieces)
    assert not chunk.small
    pieces, next_offset = read_round(plog, next_offset, 210)
    assert next_offset == 200 and (pieces[0].start, pieces[0].stop) == (10, 30)
    assert builder.build(pieces).batch.column(3).to_pylist() == values[100:200]
    plog.close()
