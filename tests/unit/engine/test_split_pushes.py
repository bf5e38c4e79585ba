"""Cutting one read into pushes: wire limits kept, every event once, offsets contiguous."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.engine.subscriptions import split_pushes
from headwater.storage.batch import value_spans
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.binary(max_size=40), min_size=1, max_size=30), min_size=1, max_size=8
    ),
    start=st.integers(0, 50),
    max_events=st.integers(1, 70),
    max_bytes=st.integers(1, 300),
)
def test_pushes_respect_limits_and_cover_the_read(
    tmp_path_factory: object,
    batches: list[list[bytes]],
    start: int,
    max_events: int,
    max_bytes: int,
) -> None:
    directory = Path(str(tmp_path_factory.mktemp("log")))  # type: ignore[attr-defined]
    plog = PartitionLog.open(directory, LogConfig(sync=SyncPolicy("none")))
    expected: list[bytes] = []
    for values in batches:
        plog.append(values, first_position=0, timestamp_ms=0)
        expected += values
    result = plog.read(start, 1 << 30)
    got: list[tuple[int, bytes]] = []
    for first, count, chunks in split_pushes(result, max_events, max_bytes):
        data = b"".join(chunks)
        bounds = value_spans(data, count)
        values = [data[bounds[i] + 8 : bounds[i + 1]] for i in range(count)]
        assert 1 <= count <= max_events
        assert count == 1 or sum(map(len, values)) <= max_bytes
        got += [(first + i, v) for i, v in enumerate(values)]
    assert got == list(enumerate(expected))[start:]
    plog.close()
