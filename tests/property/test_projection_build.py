"""A projection chunk built from any mix of stored batch pieces (one event or many, dense
or with offset gaps, cut anywhere, of any value sizes) holds exactly the pieces' events
in order: offset, position, timestamp and bytes of each, as decoding the events one by
one gives them; its json column shares the data's bytes."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.sql.duck import Database
from headwater.sql.projection import ChunkBuilder, _Piece
from headwater.storage.batch import Batch, build_batch, encode_values


@pytest.fixture(scope="module")
def builder() -> Iterator[ChunkBuilder]:
    db = Database()
    chunk_builder = ChunkBuilder(db)
    yield chunk_builder
    chunk_builder.close()
    db.close()


@st.composite
def pieces(draw: st.DrawFn) -> list[_Piece]:
    out: list[_Piece] = []
    offset = draw(st.integers(0, 1 << 40))
    position = draw(st.integers(0, 1 << 40))
    for _ in range(draw(st.integers(1, 12))):
        n = draw(st.integers(1, 6)) if draw(st.booleans()) else 1
        values = draw(
            st.lists(
                st.one_of(st.binary(max_size=30), st.just(b'{"a":1}'), st.just(b"[1,2]")),
                min_size=n,
                max_size=n,
            )
        )
        deltas = None
        if n > 1 and draw(st.booleans()):
            deltas = [0]
            for gap in draw(st.lists(st.integers(1, 4), min_size=n - 1, max_size=n - 1)):
                deltas.append(deltas[-1] + gap)
        batch = Batch(
            memoryview(
                build_batch(
                    encode_values(values),
                    n,
                    base_offset=offset,
                    first_position=position,
                    timestamp_ms=draw(st.integers(0, 1 << 41)),
                    deltas=deltas,
                )
            )
        )
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        out.append(_Piece(batch, start, stop))
        offset = batch.next_offset + draw(st.integers(0, 3))
        position += draw(st.integers(n, n + 50))
    return out


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pieces())
def test_a_chunk_holds_exactly_the_pieces_events(
    builder: ChunkBuilder, chosen: list[_Piece]
) -> None:
    events = [
        event
        for piece in chosen
        for event in islice(piece.batch.events(piece.start), piece.stop - piece.start)
    ]
    chunk = builder.build(chosen)
    batch = chunk.batch
    assert batch.column(0).to_pylist() == [e.offset for e in events]
    assert batch.column(1).to_pylist() == [e.position for e in events]
    assert [t.value for t in batch.column(2)] == [e.timestamp_ms * 1000 for e in events]
    assert batch.column(3).to_pylist() == [e.value for e in events]
    json_storage = batch.column(4).storage
    assert [None if v is None else v.encode() for v in json_storage.to_pylist()] == [
        e.value if json_storage[i].is_valid else None for i, e in enumerate(events)
    ]
    assert (chunk.first_offset, chunk.last_offset) == (events[0].offset, events[-1].offset)
    assert chunk.min_position == min(e.position for e in events)
    assert chunk.max_position == max(e.position for e in events)
