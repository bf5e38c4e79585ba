"""ReadEvents answered from stored batches (PartitionLog.read -> values chunks -> frame
chunks, the server's path) gives the bytes of the reference encoder, with every read going
through the pooled read buffers: earlier answers still held stay intact while later reads
reuse whatever buffers nobody refers to any more."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import hypothesis.strategies as st
from hypothesis import given, settings

from headwater.protocols.kimberlite import (
    EventBatch,
    ReadEventsResponse,
    Response,
    ServerConnection,
    encode_frame,
    encode_response,
)
from headwater.storage import segment
from headwater.storage.log import LogConfig, PartitionLog, ReadResult, SyncPolicy
from headwater.storage.segment import ReadBuffers, WouldBlock, no_wait

BATCHES = st.lists(
    st.lists(st.binary(max_size=200), min_size=1, max_size=12), min_size=1, max_size=10
)
# (start offset, max_bytes, read on the loop in no-wait mode?)
READS = st.lists(
    st.tuples(st.integers(0, 130), st.integers(0, 2500), st.booleans()), min_size=1, max_size=12
)


def read(plog: PartitionLog, start: int, max_bytes: int, nowait: bool) -> ReadResult:
    if nowait:
        with contextlib.suppress(WouldBlock), no_wait():
            return plog.read(start, max_bytes)
    return plog.read(start, max_bytes)


def wire(request_id: int, result: ReadResult) -> bytes:
    chunks = ServerConnection().send_read_events(
        request_id, result.count, result.values_chunks(), result.next_offset
    )
    return b"".join(bytes(c) for c in chunks)


@settings(max_examples=80, deadline=None)
@given(batches=BATCHES, reads=READS, segment_bytes=st.sampled_from([600, 2000, 1 << 20]))
def test_read_events_from_pooled_buffers_equals_the_reference_encoding(
    batches: list[list[bytes]], reads: list[tuple[int, int, bool]], segment_bytes: int
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="hw-readpath-"))
    # Every read of 64 bytes or more goes through a pool small enough to be full (and
    # to evict idle buffers) within a few reads.
    pool = ReadBuffers(3 << 10)
    config = LogConfig(segment_bytes=segment_bytes, sync=SyncPolicy.parse("none"))
    try:
        with (
            mock.patch.object(segment, "POOLED_READ", 64),
            mock.patch.object(segment, "BUFFER_ROUND", 256),
            mock.patch.object(segment, "READ_BUFFERS", pool),
        ):
            plog = PartitionLog.open(directory, config)
            values: list[bytes] = []
            try:
                for batch in batches:
                    plog.append(batch, first_position=len(values), timestamp_ms=1)
                    values += batch
                held: list[tuple[ReadResult, bytes]] = []
                for request_id, (start, max_bytes, nowait) in enumerate(reads):
                    start %= len(values) + 1
                    result = read(plog, start, max_bytes, nowait)
                    got = values[start : start + result.count]
                    assert result.count == len(got)
                    if start < len(values):
                        assert result.count >= 1  # at least one event when one exists
                    reference = Response(
                        request_id, ReadEventsResponse(EventBatch.of(got), result.next_offset)
                    )
                    expected = encode_frame(encode_response(reference))
                    assert wire(request_id, result) == expected
                    held.append((result, expected))
                    # Answers read earlier and still held were not overwritten.
                    for i, (earlier, bytes_then) in enumerate(held):
                        assert wire(i, earlier) == bytes_then
            finally:
                plog.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
