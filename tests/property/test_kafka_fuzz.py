"""Fuzz of the Kafka request decoder and the record batch reader: random and mutated
bytes give only the documented outcomes (requests, ApiVersions replies, a Close with a
reason; RecordBatchError with a Kafka error code), never an exception, a hang or an
allocation the input did not pay for."""

from __future__ import annotations

import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_strategies import message, records
from kio.schema.api_versions.v3.request import ApiVersionsRequest
from kio.schema.errors import ErrorCode

from headwater.protocols.kafka.apis import SUPPORTED, request_type
from headwater.protocols.kafka.connection import Close, Reply, Request, ServerConnection
from headwater.protocols.kafka.frames import encode_request
from headwater.protocols.kafka.records import (
    Compression,
    RecordBatchError,
    build_batch,
    decompress,
    split_batches,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VERSIONS = [
    (key, version)
    for key, versions in sorted(SUPPORTED.items())
    for version in range(versions.min_version, versions.max_version + 1)
]


def drive(data: bytes) -> list[Request | Reply | Close]:
    connection = ServerConnection(max_request=1 << 20)
    events = connection.receive_data(data) + connection.receive_eof()
    for index, event in enumerate(events):
        assert isinstance(event, Request | Reply | Close)
        if isinstance(event, Close):
            assert event.reason
            assert index == len(events) - 1  # nothing after a Close
    assert connection.receive_data(b"\x00" * 64) == []  # closed: later bytes ignored
    return events


@FUZZ
@given(data=st.binary(max_size=400))
def test_random_bytes(data: bytes) -> None:
    drive(data)


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    key, version = draw(st.sampled_from(VERSIONS))
    request = draw(message(request_type(key, version)))
    frame = bytearray(encode_request(draw(st.integers(0, 2**31 - 1)), request))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(4, len(frame) - 1))  # keep the size: hit the body
        frame[position] = draw(st.integers(0, 255))
    return bytes(frame)


@FUZZ
@given(data=mutated_requests())
def test_mutated_requests(data: bytes) -> None:
    drive(data)


def peak_bytes_while(data: bytes) -> tuple[list[Request | Reply | Close], int]:
    tracemalloc.start()
    try:
        events = drive(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return events, peak


def test_a_size_claiming_2_gib_allocates_nothing() -> None:
    events, peak = peak_bytes_while(b"\x7f\xff\xff\xff" + b"\x00" * 4096)
    assert isinstance(events[-1], Close) and "exceeds" in events[-1].reason
    assert peak < 1 << 20


def test_an_array_claiming_4_billion_elements_allocates_nothing() -> None:
    # Metadata v12 (flexible): header v2, then topics as a compact array whose length
    # varint says 2^32 - 2 elements, followed by 3 bytes. kio's own native reader
    # reserves 32 GiB for this and aborts the process; ours answers with a Close.
    header = bytes.fromhex("0003000c00000001ffff00")  # key 3, v12, id 1, no client id, no tags
    body = header + bytes.fromhex("ffffffff0f") + b"\x00" * 3
    events, peak = peak_bytes_while(len(body).to_bytes(4, "big") + body)
    [close] = events
    assert isinstance(close, Close) and "array of" in close.reason
    assert peak < 1 << 20
    # the legacy int32 array of Metadata v1: 2^31 - 1 elements
    header = bytes.fromhex("0003000100000001ffff")  # key 3, v1, id 1, no client id
    body = header + bytes.fromhex("7fffffff") + b"\x00" * 3
    events, peak = peak_bytes_while(len(body).to_bytes(4, "big") + body)
    [close] = events
    assert isinstance(close, Close) and "array of" in close.reason
    assert peak < 1 << 20


def test_a_bad_request_leaves_the_next_connection_working() -> None:
    assert isinstance(drive(b"\x00\x00\x00\x09\x00\x63\x00\x00\x00\x00\x00\x01\x00")[-1], Close)
    frame = encode_request(
        3, ApiVersionsRequest(client_software_name="fuzz", client_software_version="1")
    )
    [reply] = drive(frame)
    assert isinstance(reply, Reply)


def test_unknown_api_and_unsupported_version_close() -> None:
    unknown = bytes.fromhex("0000000a03e7000000000001ffff")
    assert drive(unknown)[-1] == Close("unknown API key 999")
    old_produce = bytes.fromhex("0000000a0000000200000001ffff")
    assert drive(old_produce)[-1] == Close("PRODUCE v2 is not supported")


@FUZZ
@given(data=st.binary(max_size=300), codec=st.integers(0, 7))
def test_random_compressed_bytes(data: bytes, codec: int) -> None:
    try:
        decompress(codec, data, max_bytes=1 << 16)
    except RecordBatchError as exc:
        assert exc.code in (
            ErrorCode.corrupt_message,
            ErrorCode.message_too_large,
            ErrorCode.unsupported_compression_type,
        )


@st.composite
def mutated_batches(draw: st.DrawFn) -> bytes:
    codec = draw(st.sampled_from(list(Compression)))
    batch = bytearray(
        build_batch(draw(records(max_records=4)), base_timestamp=0, compression=codec)
    )
    for _ in range(draw(st.integers(1, 4))):
        batch[draw(st.integers(0, len(batch) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        del batch[draw(st.integers(0, len(batch) - 1)) :]
    return bytes(batch)


@FUZZ
@given(data=mutated_batches() | st.binary(max_size=200))
def test_random_and_mutated_batches(data: bytes) -> None:
    try:
        for batch in split_batches(data):
            batch.records(max_decompressed=1 << 16)
    except RecordBatchError as exc:
        assert exc.code in (
            ErrorCode.corrupt_message,
            ErrorCode.invalid_record,
            ErrorCode.message_too_large,
            ErrorCode.unsupported_compression_type,
        )
