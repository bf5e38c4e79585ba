"""ConvergeDB decoders against hostile input: random bytes and mutated valid messages.

The only acceptable outcomes are a decoded message or a documented ProtocolError subclass
(DecodeError and its subclasses, FrameError, UnexpectedFrameError); the server connection
never raises at all; huge length fields never allocate and the buffers stay bounded.
"""

from __future__ import annotations

import binascii
import contextlib
import struct
import tracemalloc
from collections.abc import Callable

import pytest
from convergedb_strategies import client_frames, frames, messages, schemas, small_schemas
from hypothesis import given, settings
from hypothesis import strategies as st
from mutations import mutated as mutated_bytes

from headwater.errors import ProtocolError
from headwater.protocols.convergedb import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    ClientConnection,
    Close,
    Connect,
    DecodeError,
    FieldDataError,
    FieldSpec,
    Frame,
    FrameDecoder,
    FrameError,
    Message,
    Opcode,
    Reject,
    Reply,
    ServerConnection,
    UnexpectedFrameError,
    decode_fields,
    decode_message,
    decode_present_fields,
    decode_record,
    encode_frame,
)

pytestmark = pytest.mark.timeout(120)  # a hang fails instead of stalling the suite

FUZZ = settings(max_examples=200, deadline=None)
CONNECT = Frame(1, Connect("fuzz")).encode()
OPCODES = st.sampled_from(sorted(Opcode)) | st.integers(0, 0xFFFF)


# Huge u16 and u32 lengths, planted where a field might be.
HUGE_NUMBERS = [struct.pack("<H", n) for n in (0xFFFF, 0x8000, 64)] + [
    struct.pack("<I", n) for n in (2**32 - 1, 2**31, 2**24)
]


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    return mutated_bytes(valid, HUGE_NUMBERS)


def _message_or_decode_error(opcode: int, data: bytes) -> None:
    try:
        message = decode_message(opcode, data)
    except DecodeError:
        return
    # The encoding is canonical: whatever decodes re-encodes to the same bytes (CONNECT's
    # source_id byte is ignored without its flag, so only its meaning must survive).
    again = message.encode()
    if isinstance(message, Connect):
        assert decode_message(opcode, again) == message
    else:
        assert again == data


@FUZZ
@given(OPCODES, st.binary(max_size=120))
def test_random_payloads(opcode: int, data: bytes) -> None:
    _message_or_decode_error(opcode, data)


@FUZZ
@given(messages.flatmap(lambda m: st.tuples(st.just(m), mutated(m.encode()))))
def test_mutated_payloads(case: tuple[Message, bytes]) -> None:
    message, data = case
    _message_or_decode_error(message.opcode, data)


@FUZZ
@given(schemas, st.binary(max_size=80), st.integers(0, 2**64 - 1))
def test_random_field_data(schema: list[FieldSpec], data: bytes, mask: int) -> None:
    for decode in (
        lambda: decode_fields(schema, data, complete=True),
        lambda: decode_record(schema, data),
        lambda: decode_present_fields(schema, mask, data),
        lambda: decode_present_fields(schema, mask & ((1 << len(schema)) - 1), data),
    ):
        with contextlib.suppress(FieldDataError):
            decode()


def _feed_server(chunks: list[bytes]) -> list[object]:
    server = ServerConnection()
    events: list[object] = []
    total = sum(map(len, chunks))
    for chunk in chunks:
        events.extend(server.receive_data(chunk))  # must never raise
        assert server.buffered_bytes <= total
    events.extend(server.receive_eof())
    for event in events[:-1]:
        assert isinstance(event, Frame | Reply)  # closing events come last
    if events:
        assert isinstance(events[-1], Frame | Reply | Reject | Close)
    for event in events:
        if isinstance(event, Reply | Reject):
            assert Frame.decode(next(iter(_decoder(event.data)))) == event.frame
    return events


def _decoder(data: bytes) -> FrameDecoder:
    decoder = FrameDecoder()
    decoder.feed(data)
    return decoder


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_into_the_server(chunks: list[bytes]) -> None:
    _feed_server(chunks)


@FUZZ
@given(
    st.lists(client_frames, min_size=1, max_size=3).flatmap(
        lambda fs: mutated(CONNECT + b"".join(f.encode() for f in fs))
    ),
    st.integers(1, 64),
)
def test_mutated_frames_into_the_server(stream: bytes, chunk_size: int) -> None:
    _feed_server([stream[i : i + chunk_size] for i in range(0, len(stream), chunk_size)])


@FUZZ
@given(
    st.lists(
        st.tuples(OPCODES, st.integers(0, 0xFFFF), client_frames).flatmap(
            lambda t: mutated(t[2].message.encode()).map(lambda p: encode_frame(t[1], t[0], p))
        ),
        min_size=1,
        max_size=4,
    )
)
def test_corrupt_payloads_in_intact_frames_keep_the_connection(stream: list[bytes]) -> None:
    # Framing intact: every frame gets a Frame or an ERROR Reply, never a close.
    events = _feed_server([CONNECT, *stream])
    assert len(events) == 1 + len(stream)
    assert all(isinstance(e, Frame | Reply) for e in events)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_into_the_client(chunks: list[bytes]) -> None:
    client = ClientConnection()
    client.connect()
    try:
        for chunk in chunks:
            for frame in client.receive_data(chunk):
                assert isinstance(frame, Frame)
    except (FrameError, DecodeError, UnexpectedFrameError):
        pass


@FUZZ
@given(
    st.lists(frames, min_size=1, max_size=3).flatmap(
        lambda fs: mutated(b"".join(f.encode() for f in fs))
    )
)
def test_mutated_server_frames_into_the_client(stream: bytes) -> None:
    client = ClientConnection()
    for _ in range(4):
        client.connect()
    try:
        client.receive_data(stream)
    except ProtocolError as exc:
        assert isinstance(exc, FrameError | DecodeError | UnexpectedFrameError)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_into_the_frame_decoder(chunks: list[bytes]) -> None:
    decoder = FrameDecoder()
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            for raw in decoder:
                assert len(raw.payload) <= MAX_PAYLOAD
    except FrameError:
        assert decoder.failed
        assert decoder.buffered_bytes == 0


def _header(stream_id: int, opcode: int, length: int) -> bytes:
    head = struct.pack("<BBHHI", 1, 0, stream_id, opcode, length)
    return head + struct.pack("<H", binascii.crc_hqx(head, 0))


@pytest.mark.parametrize("claimed", [MAX_PAYLOAD + 1, 2**31, 2**32 - 1])
def test_huge_frame_length_is_refused_before_buffering(claimed: int) -> None:
    header = _header(5, 0x02, claimed)
    decoder = FrameDecoder()
    decoder.feed(header)  # the header alone is enough to refuse
    assert decoder.failed and decoder.buffered_bytes == 0
    for _ in range(64):  # a peer that keeps sending never grows the buffer
        decoder.feed(b"\x00" * 65536)
        assert decoder.buffered_bytes == 0

    server = ServerConnection()
    events = server.receive_data(CONNECT + header + b"\x00" * 65536)
    assert isinstance(events[0], Frame) and isinstance(events[1], Reject)
    assert server.buffered_bytes == 0
    assert server.receive_data(b"\x00" * 65536) == []
    assert server.buffered_bytes == 0


def test_valid_header_buffers_only_what_arrived() -> None:
    decoder = FrameDecoder()
    decoder.feed(_header(1, 0x02, MAX_PAYLOAD))
    decoder.feed(b"\x00" * 1000)
    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == HEADER_SIZE + 1000


E = b"\xee" * 32


@pytest.mark.parametrize(
    ("opcode", "payload"),
    [
        (0x02, struct.pack("<H", 7) + E + struct.pack("<I", 2**32 - 1) + b"x"),  # fd_len 4 GiB
        (0x08, struct.pack("<H", 7) + E + bytes(8) + struct.pack("<I", 2**31)),  # PATCH fd
        (0x0B, struct.pack("<H", 0xFFFF) + b"\x02" * 64),  # 65535 sub-ops in 64 bytes
        (0x01, b"\x00\x00" + bytes(4) + struct.pack("<H", 0xFFFF) + b"x"),  # name 64 KiB
        (0x10, struct.pack("<H", 0xFFFF) + b"x"),  # kind name 64 KiB
        (0x81, struct.pack("<H", 7) + E + b"\x01" + bytes(24) + bytes(4) + b"\xff" * 8),
        (0x87, struct.pack("<H", 7) + E + b"\x02\x00" + bytes(16) + b"\xff\xff\xff\xff"),
    ],
)
def test_huge_inner_lengths_never_allocate(opcode: int, payload: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode_message(opcode, payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


@given(small_schemas)
@settings(max_examples=30, deadline=None)
def test_huge_field_lengths_never_allocate(schema: list[FieldSpec]) -> None:
    data = b"\xff\xff" + b"x" * 8  # a string/bytes length of 65535 with 8 bytes behind it
    calls: list[Callable[[], object]] = [
        lambda: decode_fields(schema, data),
        lambda: decode_present_fields(schema, (1 << len(schema)) - 1, data),
    ]
    tracemalloc.start()
    try:
        for call in calls:
            with contextlib.suppress(FieldDataError):
                call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
