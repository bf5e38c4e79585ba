"""Projection building blocks: bulk column building from stored batches, rounds that
start and stop inside batches, sparse batches, merging, and slicing by position."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from headwater.sql.duck import Database
from headwater.sql.projection import (
    SCHEMA,
    ChunkBuilder,
    _Piece,
    read_round,
    table_at,
)
from headwater.storage.batch import Batch, build_batch, encode_values
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
