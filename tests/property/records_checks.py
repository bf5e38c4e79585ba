"""The check the records-path property tests share: the records columns and the
projection's value column of some stored pieces equal their events decoded one by one."""

from __future__ import annotations

from itertools import islice

import pyarrow as pa

from headwater.sql.projection import _Piece, piece_columns
from headwater.sql.records import records_batch
from headwater.storage.batch import Event


def one_by_one(chosen: list[_Piece]) -> list[Event]:
    return [
        event
        for piece in chosen
        for event in islice(piece.batch.events(piece.start), piece.stop - piece.start)
    ]


def check_records_columns(chosen: list[_Piece]) -> tuple[pa.RecordBatch, list[Event]]:
    """Assert the shared columns; return the records and the events for more checks."""
    events = one_by_one(chosen)
    records = records_batch(chosen)
    assert records.column("offset").to_pylist() == [e.offset for e in events]
    assert records.column("data").to_pylist() == [None if e.tombstone else e.value for e in events]
    assert records.column("key").to_pylist() == [e.key for e in events]
    assert records.column("headers").to_pylist() == [
        [{"key": k.decode("utf-8", "replace"), "value": v} for k, v in e.headers] or None
        for e in events
    ]
    # The projection shows a tombstone's value as the empty bytes it stores.
    assert piece_columns(chosen)[3].to_pylist() == [e.value for e in events]
    return records, events
