"""The Arrow append's client-side helpers shared by the Spark sink and the CLI: rows
grouped by partition in their order, and batches cut to the server's append limits
(10,000 events, 4 MiB of values and keys)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from headwater.client.arrow import append_pieces, by_partition
from headwater.protocols.kimberlite.messages import MAX_APPEND_BYTES, MAX_EVENTS


def batch_of(values: list[bytes], keys: list[bytes | None] | None = None) -> pa.RecordBatch:
    columns = {"value": pa.array(values, pa.binary())}
    if keys is not None:
        columns["key"] = pa.array(keys, pa.binary())
    return pa.RecordBatch.from_pydict(columns)


def sizes(pieces: list[pa.RecordBatch]) -> list[int]:
    return [piece.num_rows for piece in pieces]


def test_rows_are_grouped_by_partition_in_their_order() -> None:
    batch = batch_of([b"%d" % i for i in range(8)])
    target = np.array([2, 0, 2, 1, 0, 2, 1, 0])
    groups = by_partition(batch, target)
    assert [(p, rows.column("value").to_pylist()) for p, rows in groups] == [
        (0, [b"1", b"4", b"7"]),
        (1, [b"3", b"6"]),
        (2, [b"0", b"2", b"5"]),
    ]
    assert by_partition(batch, np.full(8, 3)) == [(3, batch)]


def test_a_batch_within_the_limits_is_one_piece() -> None:
    batch = batch_of([b"v"] * MAX_EVENTS, [b"k", None] * (MAX_EVENTS // 2))
    assert list(append_pieces(batch)) == [batch]


def test_pieces_stop_at_the_event_limit() -> None:
    batch = batch_of([b"v"] * (2 * MAX_EVENTS + 5)).slice(3)  # bounds not starting at 0
    pieces = list(append_pieces(batch))
    assert sizes(pieces) == [MAX_EVENTS, MAX_EVENTS, 2]
    assert pa.Table.from_batches(pieces).column("value").to_pylist() == [b"v"] * (
        2 * MAX_EVENTS + 2
    )


def test_pieces_stop_at_the_byte_limit_counting_keys() -> None:
    # 1 MiB values with 1 KiB keys: three fit (3 MiB + 3 KiB), the fourth would pass 4 MiB.
    value, key = b"x" * (1 << 20), b"k" * 1024
    batch = batch_of([value] * 7, [key] * 7)
    assert sizes(list(append_pieces(batch))) == [3, 3, 1]
    # The same values without keys: four fit exactly.
    assert sizes(list(append_pieces(batch_of([value] * 7)))) == [4, 3]
    # An event larger than an append stays alone (the server refuses it clearly).
    alone = batch_of([b"a", b"b" * (MAX_APPEND_BYTES + 1), b"c"])
    assert sizes(list(append_pieces(alone))) == [1, 1, 1]
