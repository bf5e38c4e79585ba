"""A stream partition's stored records as Arrow record batches, keys and headers
included, read from the partition log itself: the SQL projection (:mod:`.projection`)
holds offsets, positions, timestamps and values only, and only what read_committed
readers see. Bulk readers that want Kafka's record (the Spark source) read this.

Columns are built as the projection builds its own (:func:`piece_columns`: numpy per
round, the values section sliced by Arrow in C); keys and headers are decoded only for
batches stored with them (a batch without keys costs one null array), and a tombstone's
value is NULL, as Kafka readers see it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from headwater.sql.projection import RANGE_SCHEMA, _Piece, piece_columns, read_round
from headwater.sql.sealed import TS_TYPE
from headwater.storage.batch import KEY_PRESENT, KEY_TOMBSTONE, key_spans

if TYPE_CHECKING:
    from headwater.storage.log import PartitionLog

HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
RECORDS_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("position", pa.int64(), nullable=False),
        pa.field("ts", TS_TYPE, nullable=False),
        pa.field("data", pa.binary()),  # NULL for a tombstone
        pa.field("key", pa.binary()),
        pa.field("headers", HEADERS_TYPE),  # NULL for a record without headers
    ]
)
assert RECORDS_SCHEMA.names[:4] == RANGE_SCHEMA.names


class RecordsCursor:
    """Offsets [start, end) of one partition, a round (at most 65,536 records or 8 MiB of
    values) per :meth:`next_batch`, so a long range never stands in memory at once.
    ``end`` is cut at the last stable offset (read_committed) or the committed offset
    (read_uncommitted); markers are never returned, nor aborted transactions' records
    under read_committed. :meth:`next_batch` reads files: call it off the event loop."""

    def __init__(self, plog: PartitionLog, start: int, end: int, *, committed_only: bool):
        self.plog = plog
        self.offset = start
        self.committed_only = committed_only
        limit = plog.last_stable_offset if committed_only else plog.readable_offset
        self.end = max(start, min(end, limit))

    def next_batch(self) -> pa.RecordBatch | None:
        """The next round's records; None when the range is done."""
        if self.offset >= self.end:
            return None
        pieces, next_offset = read_round(
            self.plog, self.offset, self.end, committed_only=self.committed_only
        )
        if not pieces:
            self.offset = self.end
            return None
        self.offset = next_offset
        return records_batch(pieces)


def records_batch(pieces: list[_Piece]) -> pa.RecordBatch:
    offsets, positions, stamps, data = piece_columns(pieces)
    rows = len(data)
    keys: list[pa.Array] = []
    headers: list[pa.Array] = []
    tombstones: list[np.ndarray] = []
    for piece in pieces:
        n = piece.stop - piece.start
        section = piece.batch.keys_section()
        if section is None:
            keys.append(pa.nulls(n, pa.binary()))
            tombstones.append(np.zeros(n, np.bool_))
        else:
            column, tombstone = key_column(section, piece.batch.count, piece.start, piece.stop)
            keys.append(column)
            tombstones.append(tombstone)
        stored_headers = piece.batch.headers()
        if stored_headers is None:
            headers.append(pa.nulls(n, HEADERS_TYPE))
        else:  # only batches stored with headers pay a Python step per event
            headers.append(
                pa.array(
                    [
                        [{"key": k.decode("utf-8", "replace"), "value": v} for k, v in h]
                        if h
                        else None
                        for h in stored_headers[piece.start : piece.stop]
                    ],
                    HEADERS_TYPE,
                )
            )
    tombstone = np.concatenate(tombstones)
    if tombstone.any():
        data = pc.if_else(pa.array(tombstone), pa.scalar(None, pa.binary()), data)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(offsets),
            pa.array(positions),
            pa.Array.from_buffers(TS_TYPE, rows, [None, pa.py_buffer(stamps)]),
            data,
            pa.concat_arrays(keys),
            pa.concat_arrays(headers),
        ],
        schema=RECORDS_SCHEMA,
    )


def key_column(
    section: memoryview, count: int, start: int, stop: int
) -> tuple[pa.Array, np.ndarray]:
    """Keys ``start..stop-1`` of a batch's keys section (``u8 flags | u32 len | bytes``
    per event) as an Arrow binary array (NULL where an event has no key) and the events'
    tombstone flags. The record boundaries come from :func:`key_spans` (numpy over the
    whole section for many short keys, else a walk of the lengths); the array is the
    section's own bytes with each 5-byte head sliced off in C."""
    bounds = key_spans(section, count)
    pos = int(bounds[-1])
    edges = bounds[start : stop + 1]
    flags = np.frombuffer(section, np.uint8)[edges[:-1]]
    first = int(edges[0])
    records = pa.Array.from_buffers(
        pa.binary(),
        stop - start,
        [None, pa.py_buffer((edges - first).astype(np.int32)), pa.py_buffer(section[first:pos])],
    )
    longest = int(np.diff(edges).max()) if stop > start else 5
    column = pc.binary_slice(records, 5, longest)
    present = (flags & KEY_PRESENT) != 0
    if not present.all():
        column = pc.if_else(pa.array(present), column, pa.scalar(None, pa.binary()))
    return column, (flags & KEY_TOMBSTONE) != 0
