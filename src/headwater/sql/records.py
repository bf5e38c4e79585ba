"""A stream partition's stored records as Arrow record batches, keys and headers
included, read from the partition log itself: the SQL projection (:mod:`.projection`)
holds offsets, positions, timestamps and values only, and only what read_committed
readers see. Bulk readers that want Kafka's record (the Spark source) read this.

Columns are built as the projection builds its own (:func:`piece_columns`: numpy per
round, the records walked by compiled kernels, :mod:`.kernels`); keys and headers are
decoded only for batches stored with them (a batch without keys costs one null array),
and a tombstone's value is NULL, as Kafka readers see it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from headwater.sql.kernels import HEADERS_TYPE, headers_column, keys_column
from headwater.sql.projection import (
    RANGE_SCHEMA,
    _Piece,
    kafka_pieces,
    piece_columns,
    read_round,
)
from headwater.sql.sealed import TS_TYPE
from headwater.storage.batch import KEY_TOMBSTONE

if TYPE_CHECKING:
    from headwater.storage.log import PartitionLog

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
    decoded = kafka_pieces(pieces)
    offsets, positions, stamps, data = piece_columns(pieces, decoded)
    rows = len(data)
    keys: list[pa.Array] = []
    headers: list[pa.Array] = []
    tombstones: list[np.ndarray] = []
    for piece, columns in zip(pieces, decoded, strict=True):
        batch = piece.batch
        n = piece.stop - piece.start
        if columns is not None:  # Kafka form: a null value is a tombstone
            keys.append(columns.keys().slice(piece.start, n))
            valid = columns.values.is_valid().slice(piece.start, n)
            tombstones.append(~valid.to_numpy(zero_copy_only=False))
            headers.append(columns.headers().slice(piece.start, n))
            continue
        section = batch.keys_section()
        if section is None:
            keys.append(pa.nulls(n, pa.binary()))
            tombstones.append(np.zeros(n, np.bool_))
        else:
            column, flags = keys_column(section, batch.count)
            keys.append(column.slice(piece.start, n))
            tombstones.append((flags[piece.start : piece.stop] & KEY_TOMBSTONE) != 0)
        stored = batch.headers_section()
        if stored is None:
            headers.append(pa.nulls(n, HEADERS_TYPE))
        else:
            headers.append(headers_column(stored, batch.count).slice(piece.start, n))
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
