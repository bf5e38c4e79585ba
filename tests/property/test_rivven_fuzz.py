"""Rivven decoders against hostile input: random bytes and mutated valid frames.

The only acceptable outcomes are a decoded value or a documented error (DecodeError for
a payload, FrameError for framing, ProtocolError from the client); the server connection
never raises at all; a length field claiming gigabytes allocates nothing.
"""

from __future__ import annotations

import contextlib
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mutations import mutated as mutated_bytes
from rivven_strategies import requests, responses

from headwater.errors import ProtocolError
from headwater.protocols.rivven import (
    MAX_FRAME,
    ClientConnection,
    Close,
    DecodeError,
    FrameDecoder,
    FrameError,
    Reject,
    Reply,
    RequestFrame,
    ServerConnection,
    decode_postcard_error,
    decode_request,
    decode_response,
    pb,
)

pytestmark = pytest.mark.timeout(120)  # a hang fails instead of stalling the suite

FUZZ = settings(max_examples=400, deadline=None)


def _frame(wire_format: int, correlation_id: int, payload: bytes) -> bytes:
    body = struct.pack(">BI", wire_format, correlation_id) + payload
    return struct.pack(">I", len(body)) + body


# A huge protobuf varint (a length or a value), spliced in whole.
HUGE_VARINT = b"\xff\xff\xff\xff\x0f"


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    return mutated_bytes(valid, [HUGE_VARINT], splice=True)


def valid_payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(
        requests(handshake=True).map(lambda r: r.SerializeToString()),
        responses().map(lambda r: r.SerializeToString()),
    )


def hostile_payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64), valid_payloads().flatmap(mutated))


def _check_server(data: bytes) -> None:
    server = ServerConnection()
    events = server.receive_data(data) + server.receive_eof()
    for index, event in enumerate(events):
        assert isinstance(event, RequestFrame | Reply | Reject | Close)
        if isinstance(event, Reject | Close):
            assert index == len(events) - 1, "nothing follows a Reject or Close"
    assert server.receive_data(data) == []  # closed by the end of input: all ignored


@FUZZ
@given(hostile_payloads())
def test_decode_request_raises_only_decode_error(payload: bytes) -> None:
    try:
        request = decode_request(payload)
    except DecodeError:
        return
    assert request.WhichOneof("request_type") is not None


@FUZZ
@given(hostile_payloads())
def test_decode_response_raises_only_decode_error(payload: bytes) -> None:
    try:
        response = decode_response(payload)
    except DecodeError:
        return
    assert response.WhichOneof("response_type") is not None


@FUZZ
@given(st.one_of(st.binary(max_size=32), st.binary(max_size=8).map(lambda b: b"\x12" + b)))
def test_decode_postcard_error_raises_only_decode_error(payload: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_postcard_error(payload)


@FUZZ
@given(st.binary(max_size=128))
def test_server_never_raises_on_random_bytes(data: bytes) -> None:
    _check_server(data)


@FUZZ
@given(hostile_payloads(), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_server_never_raises_on_mutated_frames(
    payload: bytes, wire_format: int, correlation_id: int
) -> None:
    _check_server(_frame(wire_format, correlation_id, payload))


@FUZZ
@given(valid_payloads().map(lambda p: _frame(1, 1, p)).flatmap(mutated))
def test_server_never_raises_on_mutated_framing(data: bytes) -> None:
    _check_server(data)


@FUZZ
@given(st.one_of(st.binary(max_size=128), hostile_payloads().map(lambda p: _frame(1, 1, p))))
def test_client_raises_only_protocol_error(data: bytes) -> None:
    client = ClientConnection()
    client.send_request(pb.PingRequest())
    with contextlib.suppress(ProtocolError):
        client.receive_data(data)


@FUZZ
@given(st.binary(max_size=64))
def test_frame_decoder_raises_only_frame_error(data: bytes) -> None:
    decoder = FrameDecoder()
    decoder.feed(data)
    try:
        for _ in decoder:
            pass
    except FrameError:
        pass


def _peak_allocation(action: object) -> int:
    tracemalloc.start()
    try:
        action()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("length", [MAX_FRAME + 1, 2**31, 2**32 - 1])
def test_a_huge_length_allocates_nothing(length: int) -> None:
    server = ServerConnection()
    events: list[object] = []
    peak = _peak_allocation(
        lambda: events.extend(server.receive_data(struct.pack(">I", length) + b"\x01" * 64))
    )
    assert isinstance(events[0], Reject)
    assert peak < 64 * 1024
    assert server.buffered_bytes == 0


def test_a_length_within_the_limit_holds_only_what_arrived() -> None:
    server = ServerConnection()
    peak = _peak_allocation(lambda: server.receive_data(struct.pack(">I", MAX_FRAME) + b"\x01"))
    assert peak < 64 * 1024
    assert server.buffered_bytes == 5


@pytest.mark.parametrize(
    "payload",
    [
        b"\x52\xff\xff\xff\xff\x07",  # publish claiming a 2 GiB body
        b"\x0a\xff\xff\xff\xff\x0f",  # header claiming 4 GiB
        b"\x0b" * 10_000,  # unknown groups nested 10,000 deep
        b"\xfa\x07\x80\x80\x80\x80\x10",  # unknown field with an overlong length
    ],
)
def test_a_huge_inner_length_or_depth_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_request(payload)
    server = ServerConnection()
    peak = _peak_allocation(lambda: server.receive_data(_frame(1, 3, payload)))
    assert peak < 256 * 1024
