"""Kimberlite decoders against hostile input: random bytes and mutated valid messages.

The only acceptable outcomes are a decoded message or a documented ProtocolError subclass;
the server connection never raises at all; huge length fields never allocate.
"""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kimberlite_strategies import requests, responses
from mutations import mutated as mutated_bytes

from headwater.errors import ProtocolError
from headwater.protocols.kimberlite import (
    HEADER_SIZE,
    ClientConnection,
    Close,
    DecodeError,
    FrameDecoder,
    FrameError,
    HandshakeRequest,
    Reject,
    RejectFrameError,
    Reply,
    Request,
    Response,
    ServerConnection,
    decode_request,
    decode_response,
    encode_frame,
    encode_request,
    encode_response,
)

pytestmark = pytest.mark.timeout(120)  # a hang fails instead of stalling the suite

FUZZ = settings(max_examples=400, deadline=None)
HANDSHAKE_FRAME = encode_frame(encode_request(Request(1, 0, HandshakeRequest())))


# Huge u64 counts/lengths, planted where a field might be.
HUGE_NUMBERS = [struct.pack("<Q", n) for n in (2**32, 2**63, 2**64 - 1)]


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    return mutated_bytes(valid, HUGE_NUMBERS)


def _request_or_decode_error(data: bytes) -> None:
    try:
        request = decode_request(data)
    except DecodeError:
        return
    # The encoding is canonical: whatever decodes re-encodes to the very same bytes.
    assert encode_request(request) == data


def _response_or_decode_error(data: bytes) -> None:
    try:
        response = decode_response(data)
    except DecodeError:
        return
    assert encode_response(response) == data


@FUZZ
@given(st.binary(max_size=120))
def test_random_payloads(data: bytes) -> None:
    _request_or_decode_error(data)
    _response_or_decode_error(data)


@FUZZ
@given(requests.flatmap(lambda r: mutated(encode_request(r))))
def test_mutated_requests(data: bytes) -> None:
    _request_or_decode_error(data)


@FUZZ
@given(responses.flatmap(lambda r: mutated(encode_response(r))))
def test_mutated_responses(data: bytes) -> None:
    _response_or_decode_error(data)


def _feed_server(chunks: list[bytes]) -> list[object]:
    server = ServerConnection()
    events: list[object] = []
    for chunk in chunks:
        events.extend(server.receive_data(chunk))  # must never raise
        assert server.buffered_bytes <= sum(map(len, chunks))
    events.extend(server.receive_eof())
    for event in events[:-1]:
        assert isinstance(event, Request | Reply)  # closing events come last
    if events:
        assert isinstance(events[-1], Request | Reply | Reject | Close)
    return events


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_into_the_server(chunks: list[bytes]) -> None:
    _feed_server(chunks)


@FUZZ
@given(
    st.lists(requests, min_size=1, max_size=3).flatmap(
        lambda rs: mutated(HANDSHAKE_FRAME + b"".join(encode_frame(encode_request(r)) for r in rs))
    ),
    st.integers(1, 64),
)
def test_mutated_frames_into_the_server(stream: bytes, chunk_size: int) -> None:
    _feed_server([stream[i : i + chunk_size] for i in range(0, len(stream), chunk_size)])


@FUZZ
@given(
    st.lists(requests, min_size=1, max_size=3).flatmap(
        lambda rs: st.lists(
            mutated(encode_request(rs[0])).map(lambda p: encode_frame(p)), min_size=1, max_size=3
        )
    )
)
def test_corrupt_payloads_in_intact_frames_keep_the_connection(frames: list[bytes]) -> None:
    # Framing intact: every payload gets a Request or an InvalidRequest Reply, never a close.
    events = _feed_server([HANDSHAKE_FRAME, *frames])
    assert len(events) == 1 + len(frames)
    assert all(isinstance(e, Request | Reply) for e in events)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_into_the_client(chunks: list[bytes]) -> None:
    client = ClientConnection()
    try:
        for chunk in chunks:
            for response in client.receive_data(chunk):
                assert isinstance(response, Response)
    except ProtocolError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_into_the_frame_decoder(chunks: list[bytes]) -> None:
    decoder = FrameDecoder()
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            for payload in decoder:
                assert isinstance(payload, bytes)
    except FrameError:
        assert decoder.failed
        assert decoder.buffered_bytes == 0


@pytest.mark.parametrize("claimed", [2**24 + 1, 2**31, 2**32 - 1])
def test_huge_frame_length_is_refused_before_buffering(claimed: int) -> None:
    header = b"VDB \x00\x01" + struct.pack(">I", claimed) + b"\x00\x00\x00\x00"
    decoder = FrameDecoder()
    decoder.feed(header[:10])  # the length field alone is enough to refuse
    assert decoder.failed
    with pytest.raises(RejectFrameError):
        decoder.next_payload()
    for _ in range(64):  # a peer that keeps sending never grows the buffer
        decoder.feed(b"\x00" * 65536)
        assert decoder.buffered_bytes == 0

    server = ServerConnection()
    events = server.receive_data(header + b"\x00" * 65536)
    assert len(events) == 1 and isinstance(events[0], Reject)
    assert server.buffered_bytes == 0
    assert server.receive_data(b"\x00" * 65536) == []
    assert server.buffered_bytes == 0


def test_valid_header_buffers_only_what_arrived() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"VDB \x00\x01" + struct.pack(">I", 2**24) + b"\x00" * 4)
    decoder.feed(b"\x00" * 1000)
    assert decoder.next_payload() is None
    assert decoder.buffered_bytes == HEADER_SIZE + 1000


@pytest.mark.parametrize(
    "payload",
    [
        # QueryRequest whose sql claims 2^63 bytes
        struct.pack("<QQIQ", 1, 0, 3, 2**63) + b"x",
        # CreateStream whose name claims 4 GiB
        struct.pack("<QQIQ", 1, 0, 1, 2**32) + b"x" * 16,
        # AppendEvents claiming 2^64-1 events, and one claiming a 4 GiB event
        struct.pack("<QQIQQ", 1, 0, 2, 1, 2**64 - 1) + b"\x00" * 64,
        struct.pack("<QQIQQQ", 1, 0, 2, 1, 1, 2**32) + b"\x00" * 64,
        # Query with 2^40 params
        struct.pack("<QQIQQ", 1, 0, 3, 0, 2**40) + b"\x00" * 64,
    ],
)
def test_huge_inner_lengths_never_allocate(payload: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode_request(payload, enforce_limits=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_huge_response_counts_never_allocate() -> None:
    payloads = [
        struct.pack("<QIQ", 1, 4, 2**62) + b"\x00" * 32,  # Query columns
        struct.pack("<QIQ", 1, 13, 2**60) + b"\x00" * 32,  # Streams
        struct.pack("<QIQ", 1, 6, 2**63) + b"\x00" * 32,  # ReadEvents events
    ]
    tracemalloc.start()
    try:
        for payload in payloads:
            with pytest.raises(DecodeError):
                decode_response(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
