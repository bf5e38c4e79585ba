"""Byte-exact ConvergeDB vectors, one or more per frame type, written by hand from
spec/PROTOCOLS.md §2 and the seed's header, opcode and BATCH sub-op layouts (the seed
gives no hex examples of its own).

Every vector is a whole frame: the 12-byte header (version, flags, stream_id, opcode,
payload_len, CRC-16/XMODEM of the first 10 bytes) and the payload, annotated field by
field. ``E`` stands for the 32-byte entity id ``ee ee .. ee``.
"""

from __future__ import annotations

import binascii
import re
import struct
from typing import Any

import pytest

from headwater.errors import ProtocolError, UsageError
from headwater.protocols.convergedb import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    Ack,
    Assert,
    Batch,
    BootstrapBegin,
    BootstrapEnd,
    Change,
    ClientConnection,
    Close,
    Connect,
    ConnectAck,
    CreateKind,
    DecodeError,
    Deleted,
    EpochEndAck,
    ErrorCode,
    ErrorMessage,
    Event,
    FieldDataError,
    FieldSpec,
    FieldType,
    Frame,
    FrameDecoder,
    FrameTooLargeError,
    GetKind,
    Heartbeat,
    KindAck,
    LimitExceededError,
    Message,
    Opcode,
    Patch,
    Query,
    Reject,
    Reply,
    Retract,
    ServerConnection,
    SourceEpochBegin,
    SourceEpochEnd,
    State,
    Subscribe,
    UnexpectedFrameError,
    Unsubscribe,
    crc16_xmodem,
    decode_fields,
    decode_message,
    decode_present_fields,
    decode_record,
    encode_fields,
    encode_frame,
    encode_present_fields,
)
from headwater.protocols.convergedb.frames import BadFrameError

E = b"\xee" * 32
E_HEX = "ee" * 32


def h(text: str) -> bytes:
    """Hex with ``//`` comments and any whitespace; ``E`` is the 32-byte entity id."""
    text = re.sub(r"//[^\n]*", "", text)
    return bytes.fromhex(re.sub(r"\bE\b", E_HEX, text))


SCHEMA = [
    FieldSpec("temp", FieldType.F64),
    FieldSpec("label", FieldType.STRING),
    FieldSpec("ok", FieldType.BOOL),
]
# temp 21.5, label "hi", ok true
FIELDS_A = "0d000000  00 00 00 00 00 80 35 40  0200 6869  01"  # fd_len 13, then the fields
# temp 22.0, label "hi", ok false
FIELDS_B = "0d000000  00 00 00 00 00 00 36 40  0200 6869  00"

VECTORS: list[tuple[str, int, Message, str]] = [
    (
        "connect",
        1,
        Connect("sensor", "s3cret", source_id=5, liveness_deadline_ms=10_000),
        """
        01 00 0100 0100 16000000 0851   // v1, flags 0, stream 1, CONNECT, len 22, crc
        01                              // flags: bit0 source_id given
        05                              // source_id 5
        10 27 00 00                     // liveness_deadline_ms 10000
        0600 73 65 6e 73 6f 72          // name "sensor"
        0600 73 33 63 72 65 74          // auth_token "s3cret"
        """,
    ),
    (
        "connect read-only",
        2,
        Connect("dash", read_only=True),
        """
        01 00 0200 0100 0e000000 1907
        02 00 00000000                  // flags bit1 read-only, no source_id, deadline 0
        0400 64 61 73 68 0000           // name "dash", empty auth_token
        """,
    ),
    (
        "assert",
        0,
        Assert(7, E, h(FIELDS_A)[4:]),
        f"""
        01 00 0000 0200 35000000 a974   // stream 0, ASSERT, len 53
        0700 E                          // kind_id 7, entity_id
        {FIELDS_A}
        0000                            // no metadata
        """,
    ),
    (
        "assert prefix with metadata",
        9,
        Assert(7, E, h("00 00 00 00 00 80 35 40"), b"m1"),
        """
        01 00 0900 0200 32000000 8d7c
        0700 E
        08000000 00 00 00 00 00 80 35 40  // field 0 only: an older writer's prefix
        0200 6d 31                        // metadata "m1"
        """,
    ),
    (
        "retract",
        0,
        Retract(7, E, b"src"),
        """
        01 00 0000 0300 27000000 c6c7
        0700 E 0300 73 72 63
        """,
    ),
    (
        "patch",
        4,
        Patch(7, E, 0b10, h("0200 796f")),
        """
        01 00 0400 0800 34000000 728b
        0700 E
        02 00 00 00 00 00 00 00         // presence_mask: field 1
        04000000 0200 79 6f             // field 1 = "yo"
        0000
        """,
    ),
    (
        "query",
        3,
        Query(7, E),
        "01 00 0300 0400 22000000 b77b  0700 E",
    ),
    (
        "subscribe",
        5,
        Subscribe(7, bootstrap=True, include_previous=True),
        "01 00 0500 0500 03000000 26ff  0700 03",
    ),
    ("unsubscribe", 6, Unsubscribe(7), "01 00 0600 0600 02000000 078f  0700"),
    ("heartbeat (liveness)", 0, Heartbeat(), "01 00 0000 0700 00000000 04a7"),
    ("heartbeat (barrier)", 7, Heartbeat(), "01 00 0700 0700 00000000 1c60"),
    ("source epoch begin", 0, SourceEpochBegin(), "01 00 0000 0900 00000000 a727"),
    ("source epoch end", 8, SourceEpochEnd(), "01 00 0800 0a00 00000000 9df7"),
    (
        "batch",
        0,
        Batch(
            [
                Assert(1, E, b"\x01"),
                Retract(1, E),
                Patch(1, E, 0b1, b"\x00"),
            ]
        ),
        """
        01 00 0000 0b00 83000000 03ea   // BATCH, len 131
        0300                            // op_count 3
        02 0100 E 01000000 01 0000      // ASSERT kind 1, field_data [true]
        03 0100 E 0000                  // RETRACT kind 1
        08 0100 E 0100000000000000 01000000 00 0000  // PATCH kind 1, field 0 = false
        """,
    ),
    (
        "create kind",
        10,
        CreateKind("sensor", [SCHEMA[0], SCHEMA[1]]),
        """
        01 00 0a00 1000 19000000 6d0c
        0600 73 65 6e 73 6f 72          // name "sensor"
        00 02                           // flags 0, field_count 2
        0400 74 65 6d 70 0b             // "temp" f64
        0500 6c 61 62 65 6c 0c          // "label" string
        """,
    ),
    (
        "create event-stream kind",
        12,
        CreateKind("ticks", event_stream=True),
        "01 00 0c00 1000 09000000 0197  0500 74 69 63 6b 73  01 00",
    ),
    (
        "get kind",
        11,
        GetKind("sensor"),
        "01 00 0b00 1100 0a000000 658e  0600 73 65 6e 73 6f 72  00 00",
    ),
    (
        "state created",
        5,
        State(7, E, Change.CREATED, 42, 0x21, 0b111, h(FIELDS_A)[4:]),
        f"""
        01 00 0500 8100 4e000000 bd7a
        0700 E
        00                              // change: created
        2a 00 00 00 00 00 00 00         // version 42
        21 00 00 00 00 00 00 00         // source_set: sources 0 and 5
        07 00 00 00 00 00 00 00         // changed_fields: all three
        {FIELDS_A}
        0000
        """,
    ),
    (
        "state updated with previous",
        5,
        State(7, E, Change.UPDATED, 43, 0x21, 0b101, h(FIELDS_B)[4:], h(FIELDS_A)[4:]),
        f"""
        01 00 0500 8100 5f000000 ae17
        0700 E 01 2b00000000000000 2100000000000000
        05 00 00 00 00 00 00 00         // changed_fields: temp and ok
        {FIELDS_B}                      // the new state
        {FIELDS_A}                      // prev_len + the previous state
        0000
        """,
    ),
    (
        "state query",
        3,
        State(7, E, Change.QUERY, 43, 1, 0b111, h(FIELDS_B)[4:], metadata=b"m1"),
        f"""
        01 00 0300 8100 50000000 8b43
        0700 E 03 2b00000000000000 0100000000000000 0700000000000000
        {FIELDS_B}
        0200 6d 31
        """,
    ),
    (
        "deleted",
        5,
        Deleted(7, E, 44),
        "01 00 0500 8200 2c000000 e700  0700 E 2c00000000000000 0000",
    ),
    ("bootstrap begin", 5, BootstrapBegin(7), "01 00 0500 8300 02000000 53d0  0700"),
    ("bootstrap end", 5, BootstrapEnd(7), "01 00 0500 8400 02000000 1218  0700"),
    ("ack subscribe", 5, Ack(Opcode.SUBSCRIBE), "01 00 0500 8500 02000000 b25d  0500"),
    ("ack connect", 1, ConnectAck(5), "01 00 0100 8500 03000000 6b24  0100 05"),
    ("ack connect read-only", 2, ConnectAck(0xFF), "01 00 0200 8500 03000000 1eec  0100 ff"),
    (
        "ack create kind",
        10,
        KindAck(Opcode.CREATE_KIND, 7, 1, 2),
        "01 00 0a00 8500 07000000 3538  1000 0700 0100 02",
    ),
    (
        "ack get kind",
        11,
        KindAck(Opcode.GET_KIND, 7, 2, 3),
        "01 00 0b00 8500 07000000 e67f  1100 0700 0200 03",
    ),
    (
        "ack source epoch end",
        8,
        EpochEndAck(3),
        "01 00 0800 8500 06000000 27c1  0a00 03000000",
    ),
    (
        "error entity not found",
        3,
        ErrorMessage(ErrorCode.ENTITY_NOT_FOUND, Opcode.QUERY, "gone"),
        "01 00 0300 8600 0a000000 5a96  0b00 0400 0400 67 6f 6e 65",
    ),
    (
        "error bad frame",
        0,
        ErrorMessage(ErrorCode.BAD_FRAME, 0),
        "01 00 0000 8600 06000000 1d11  0100 0000 0000",
    ),
    (
        "event",
        5,
        Event(7, E, Opcode.ASSERT, 5, 1, 0b111, h(FIELDS_A)[4:]),
        f"""
        01 00 0500 8700 47000000 2b04
        0700 E
        02 05                           // op ASSERT, source 5
        01 00 00 00 00 00 00 00         // sequence 1
        07 00 00 00 00 00 00 00         // presence_mask: all three fields
        {FIELDS_A}
        0000
        """,
    ),
]


def typed(value: Any) -> Any:
    """``value`` with each leaf's type, so True vs 1 and 1 vs 1.0 differ."""
    if isinstance(value, list | tuple):
        return [typed(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        return (type(value), [typed(getattr(value, f)) for f in value.__dataclass_fields__])
    return (type(value), value)


IDS = [v[0] for v in VECTORS]


@pytest.mark.parametrize(("name", "stream_id", "message", "hex_text"), VECTORS, ids=IDS)
def test_vector_encodes(name: str, stream_id: int, message: Message, hex_text: str) -> None:
    assert Frame(stream_id, message).encode() == h(hex_text)


@pytest.mark.parametrize(("name", "stream_id", "message", "hex_text"), VECTORS, ids=IDS)
def test_vector_decodes(name: str, stream_id: int, message: Message, hex_text: str) -> None:
    data = h(hex_text)
    assert crc16_xmodem(data[:10]) == struct.unpack_from("<H", data, 10)[0]
    decoder = FrameDecoder()
    decoder.feed(data)
    (raw,) = list(decoder)
    assert decoder.at_frame_boundary
    frame = Frame.decode(raw)
    assert frame == Frame(stream_id, message)
    assert typed(frame.message) == typed(message)
    assert typed(decode_message(raw.opcode, data[HEADER_SIZE:])) == typed(message)
    assert type(message).decode(data[HEADER_SIZE:]) == message


def test_every_opcode_and_ack_body_has_a_vector() -> None:
    opcodes = {message.opcode for _, _, message, _ in VECTORS}
    assert opcodes == set(Opcode)
    kinds = {type(message) for _, _, message, _ in VECTORS}
    assert {Ack, ConnectAck, KindAck, EpochEndAck} <= kinds
    assert {Change(m.change) for _, _, m, _ in VECTORS if isinstance(m, State)} >= {
        Change.CREATED,
        Change.UPDATED,
        Change.QUERY,
    }


# --- CRC and header --------------------------------------------------------------------


def test_crc16_xmodem_check_value() -> None:
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert crc16_xmodem(b"") == 0
    # Continuing a running CRC equals one pass over the whole input.
    assert crc16_xmodem(b"56789", crc16_xmodem(b"1234")) == 0x31C3


@pytest.mark.parametrize("data", [b"\x00", b"\xff" * 10, bytes(range(256)), b"headwater"])
def test_crc16_matches_an_independent_implementation(data: bytes) -> None:
    assert crc16_xmodem(data) == binascii.crc_hqx(data, 0)


def test_header_layout() -> None:
    # stream 0x1234, opcode 0x0B, payload_len 0x01020304 (not sent): every field LE.
    header = encode_frame(0x1234, 0x0B, b"")[:10]
    assert header == h("01 00 3412 0b00 00000000")
    data = encode_frame(0x1234, 0x0B, b"abc")
    assert data[:10] == h("01 00 3412 0b00 03000000")
    assert data[10:12] == struct.pack("<H", binascii.crc_hqx(data[:10], 0))
    assert data[12:] == b"abc"


# --- field_data ------------------------------------------------------------------------

ALL_TYPES = [FieldSpec(f"f{int(t)}", t) for t in FieldType]
ALL_VALUES: list[Any] = [
    True,
    0xAB,
    0x1234,
    0xDEADBEEF,
    2**64 - 1,
    -2,
    -300,
    -70000,
    -(2**63),
    1.5,
    -0.25,
    "é",
    b"\x00\xff",
    1_700_000_000_000_000_000,
]
ALL_DATA = """
    01                          // 1 bool true
    ab                          // 2 u8
    34 12                       // 3 u16
    ef be ad de                 // 4 u32
    ff ff ff ff ff ff ff ff     // 5 u64 max
    fe                          // 6 i8 -2
    d4 fe                       // 7 i16 -300
    90 ee fe ff                 // 8 i32 -70000
    00 00 00 00 00 00 00 80     // 9 i64 min
    00 00 c0 3f                 // 10 f32 1.5
    00 00 00 00 00 00 d0 bf     // 11 f64 -0.25
    0200 c3 a9                  // 12 string "é"
    0200 00 ff                  // 13 bytes
    00 00 2a 36 fe 9c 97 17     // 14 timestamp ns
"""


def test_every_field_type() -> None:
    data = h(ALL_DATA)
    assert encode_fields(ALL_TYPES, ALL_VALUES) == data
    assert typed(decode_record(ALL_TYPES, data)) == typed(ALL_VALUES)


def test_assert_prefix_takes_defaults() -> None:
    data = h("01 ab 3412")  # fields 0..2 only
    assert decode_fields(ALL_TYPES, data) == [True, 0xAB, 0x1234]
    full = decode_fields(ALL_TYPES, data, complete=True)
    assert typed(full[3:]) == typed([0, 0, 0, 0, 0, 0, 0.0, 0.0, "", b"", 0])
    assert decode_fields(ALL_TYPES, b"", complete=True)[0] is False
    assert Assert(1, E, data).fields(ALL_TYPES) == full
    with pytest.raises(FieldDataError):  # a field cut in half
        decode_fields(ALL_TYPES, h("01 ab 34"))
    with pytest.raises(FieldDataError):  # more than the kind's fields
        decode_fields(SCHEMA[:1], h("0000000000000000 00"))
    with pytest.raises(FieldDataError):  # STATE carries every field
        decode_record(ALL_TYPES, data)


def test_patch_presence_mask() -> None:
    mask, data = encode_present_fields(SCHEMA, {2: True, 0: 1.0})
    assert mask == 0b101
    assert data == h("000000000000f03f 01")  # ordinal order, whatever the dict order
    assert decode_present_fields(SCHEMA, 0b101, data) == {0: 1.0, 2: True}
    patch = Patch.of(SCHEMA, 7, E, {1: "x"})
    assert (patch.presence_mask, patch.field_data) == (0b10, h("0100 78"))
    assert patch.fields(SCHEMA) == {1: "x"}
    assert decode_present_fields(SCHEMA, 0, b"") == {}
    with pytest.raises(FieldDataError):  # bit 3: the kind has 3 fields
        decode_present_fields(SCHEMA, 0b1000, b"")
    with pytest.raises(FieldDataError):  # bytes left over
        decode_present_fields(SCHEMA, 0b100, h("01 01"))
    with pytest.raises(FieldDataError):  # bool byte 2
        decode_present_fields(SCHEMA, 0b100, h("02"))
    with pytest.raises(FieldDataError):  # invalid UTF-8
        decode_present_fields(SCHEMA, 0b10, h("0100 ff"))


@pytest.mark.parametrize(
    ("field_type", "value"),
    [
        (FieldType.BOOL, 1),
        (FieldType.U8, 256),
        (FieldType.U8, -1),
        (FieldType.U16, True),
        (FieldType.I64, 2**63),
        (FieldType.F32, 1e300),
        (FieldType.F64, "1"),
        (FieldType.STRING, b"x"),
        (FieldType.STRING, "x" * 65536),
        (FieldType.STRING, "\ud800"),
        (FieldType.BYTES, b"x" * 65536),
        (FieldType.TIMESTAMP, 1.0),
    ],
)
def test_unencodable_field_values(field_type: FieldType, value: Any) -> None:
    with pytest.raises(UsageError):
        encode_fields([("f", field_type)], [value])


# --- malformed payloads ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("opcode", "payload", "error"),
    [
        (0x01, "04 00 00000000 0000 0000", DecodeError),  # CONNECT: undefined flag bit
        (0x01, "01 40 00000000 0000 0000", DecodeError),  # CONNECT: source_id 64
        (0x02, "0700 E 01000000", DecodeError),  # ASSERT: fd_len past the end
        (0x03, "0700 E 0000 00", DecodeError),  # RETRACT: a trailing byte
        (0x05, "0700 08", DecodeError),  # SUBSCRIBE: undefined flag bit
        (0x0B, "0100 04 0700 E 0000", DecodeError),  # BATCH: op_type QUERY
        (0x0B, "ffff 03 0700 E 0000", DecodeError),  # BATCH: 65535 ops in 37 bytes
        (0x10, "0100 78 00 01 0100 61 0f", DecodeError),  # CREATE_KIND: type code 15
        (0x10, "0100 78 02 00", DecodeError),  # CREATE_KIND: undefined flag bit
        (0x10, "0100 78 00 41", LimitExceededError),  # CREATE_KIND: 65 fields
        (0x81, "0700 E 04" + "00" * 24 + "00000000 0000", DecodeError),  # STATE change 4
        (0x85, "0200 05", DecodeError),  # ACK of ASSERT with a body
        (0x85, "0100 40", DecodeError),  # ACK of CONNECT: source 64
        (0x85, "1200", DecodeError),  # ACK of opcode 0x12
        (0x87, "0700 E 04 00" + "00" * 16 + "00000000 0000", DecodeError),  # EVENT op 4
        (0x86, "0100 0000 0100 ff", DecodeError),  # ERROR: invalid UTF-8
        (0x99, "", DecodeError),  # unknown opcode
    ],
)
def test_malformed_payloads(opcode: int, payload: str, error: type[DecodeError]) -> None:
    with pytest.raises(error):
        decode_message(opcode, h(payload))


def test_decode_error_codes() -> None:
    assert DecodeError("x").code == ErrorCode.BAD_FRAME
    assert FieldDataError("x").code == ErrorCode.BAD_FIELD_DATA
    assert LimitExceededError("x").code == ErrorCode.LIMIT_EXCEEDED
    assert issubclass(DecodeError, ProtocolError)


def test_state_update_without_previous() -> None:
    # change 1 on a subscription without include_previous: no previous section.
    message = State(7, E, Change.UPDATED, 43, 1, 0b1, h(FIELDS_B)[4:])
    payload = message.encode()
    assert payload.endswith(h(FIELDS_B) + b"\x00\x00")
    assert State.decode(payload) == message
    with_meta = State(7, E, Change.UPDATED, 43, 1, 0b1, b"", b"", b"\x00" * 5)
    assert State.decode(with_meta.encode()) == with_meta


@pytest.mark.parametrize(
    "message",
    [
        Assert(1, b"\x00" * 31),
        Query(1, b"\x00" * 33),
        Assert(65536, E),
        Connect(source_id=64),
        Connect(name="x" * 65536),
        Retract(1, E, b"m" * 65536),
        State(1, E, Change.CREATED, 1, 1, 1, b"", b""),  # previous on a created STATE
        Ack(Opcode.CONNECT),  # that ACK has a body: ConnectAck
        KindAck(Opcode.QUERY, 1, 1, 1),
        ConnectAck(64),
        Event(1, E, Opcode.QUERY, 0, 0),
        Event(1, E, Opcode.ASSERT, 64, 0),
        Batch([Query(1, E)]),  # type: ignore[list-item]
        CreateKind("k", [FieldSpec("f", FieldType.BOOL)] * 65),
        ErrorMessage(70000, 0),
    ],
)
def test_unencodable_messages(message: Message) -> None:
    with pytest.raises(UsageError):
        Frame(1, message).encode()


def test_unencodable_frames() -> None:
    with pytest.raises(UsageError):
        Frame(65536, Heartbeat()).encode()
    with pytest.raises(UsageError):
        encode_frame(1, 0x02, bytes(MAX_PAYLOAD + 1))
    with pytest.raises(UsageError):
        CreateKind("k", [("f", 99)])  # type: ignore[list-item]


def test_field_helpers_on_messages() -> None:
    a = Assert.of(SCHEMA, 7, E, [21.5, "hi", True])
    assert a.field_data == h(FIELDS_A)[4:]
    assert a.key == (7, E)
    state = State(7, E, Change.UPDATED, 43, 1, 0b101, h(FIELDS_B)[4:], h(FIELDS_A)[4:])
    assert state.fields(SCHEMA) == [22.0, "hi", False]
    assert state.previous_fields(SCHEMA) == [21.5, "hi", True]
    event = Event(7, E, Opcode.PATCH, 5, 2, 0b10, h("0200 6869"))
    assert event.fields(SCHEMA) == {1: "hi"}
    assert Connect().deadline_ms == 30_000
    assert Connect(liveness_deadline_ms=5).deadline_ms == 5
    assert ConnectAck(0xFF).read_only and not ConnectAck(0).read_only


# --- the server connection -------------------------------------------------------------


def vector(name: str) -> bytes:
    return next(h(text) for n, _, _, text in VECTORS if n == name)


def test_server_flow() -> None:
    server = ServerConnection()
    events = server.receive_data(vector("connect") + vector("create kind") + vector("assert"))
    assert [type(e) for e in events] == [Frame, Frame, Frame]
    assert events[0] == Frame(1, Connect("sensor", "s3cret", 5, False, 10_000))
    assert server.connected and not server.connect_acknowledged
    assert server.send(1, ConnectAck(5)) == vector("ack connect")
    assert server.connect_acknowledged and server.source_id == 5
    assert server.send(10, KindAck(Opcode.CREATE_KIND, 7, 1, 2)) == vector("ack create kind")
    assert server.send_error(3, 11, 4, "gone") == vector("error entity not found")


def test_not_connected() -> None:
    server = ServerConnection()
    (event,) = server.receive_data(vector("assert"))
    assert isinstance(event, Reply)
    # A fire-and-forget write: the ERROR goes to stream 0 and names ASSERT.
    assert event.frame == Frame(
        0, ErrorMessage(ErrorCode.NOT_CONNECTED, Opcode.ASSERT, "CONNECT must come first")
    )
    assert event.data[:6] == h("01 00 0000 8600")
    assert event.data[HEADER_SIZE : HEADER_SIZE + 4] == h("0300 0200")
    (event,) = server.receive_data(vector("query"))
    assert isinstance(event, Reply)
    assert (event.frame.stream_id, event.frame.message) == (
        3,
        ErrorMessage(ErrorCode.NOT_CONNECTED, Opcode.QUERY, "CONNECT must come first"),
    )
    # The connection stays open: CONNECT still works.
    (event,) = server.receive_data(vector("connect"))
    assert isinstance(event, Frame)


def test_refused_connect_can_be_retried() -> None:
    server = ServerConnection()
    server.receive_data(vector("connect"))
    server.send_error(1, ErrorCode.AUTH_FAILED, Opcode.CONNECT, "bad token")
    assert not server.connected
    (event,) = server.receive_data(vector("query"))
    assert isinstance(event, Reply)
    (event,) = server.receive_data(vector("connect"))
    assert isinstance(event, Frame)


def test_pull_api_lets_the_engine_answer_connect_before_the_next_frame() -> None:
    server = ServerConnection()
    server.feed(vector("connect") + vector("assert") + vector("connect"))
    assert isinstance(server.next_event(), Frame)
    server.send_error(1, ErrorCode.SOURCE_CONFLICT, Opcode.CONNECT, "source 5 is taken")
    event = server.next_event()  # the pipelined ASSERT now meets an unconnected connection
    assert isinstance(event, Reply)
    assert event.frame.message == ErrorMessage(
        ErrorCode.NOT_CONNECTED, Opcode.ASSERT, "CONNECT must come first"
    )
    assert isinstance(server.next_event(), Frame)  # the retried CONNECT
    assert server.next_event() is None


def test_second_connect_and_read_only() -> None:
    server = ServerConnection()
    server.receive_data(vector("connect read-only"))
    server.send(2, ConnectAck(0xFF))
    assert server.read_only and server.source_id == 0xFF
    events = server.receive_data(vector("connect") + vector("retract") + vector("query"))
    assert isinstance(events[0], Reply) and isinstance(events[1], Reply)
    assert events[0].frame.message.code == ErrorCode.SOURCE_CONFLICT  # type: ignore[union-attr]
    assert events[1].frame == Frame(  # fire-and-forget failure: stream 0, its opcode
        0, ErrorMessage(ErrorCode.READ_ONLY, Opcode.RETRACT, "the connection is read-only")
    )
    assert events[2] == Frame(3, Query(7, E))  # reads are fine


def _reject_of(data: bytes) -> Reject:
    server = ServerConnection()
    events = server.receive_data(data)
    assert len(events) == 1 and isinstance(events[0], Reject), events
    assert server.closed and server.buffered_bytes == 0
    assert server.receive_data(vector("connect")) == []
    return events[0]


def test_bad_crc_gets_bad_frame_then_close() -> None:
    data = bytearray(vector("connect"))
    data[10] ^= 0x01
    reject = _reject_of(bytes(data))
    assert reject.frame.stream_id == 0
    assert isinstance(reject.frame.message, ErrorMessage)
    assert (reject.frame.message.code, reject.frame.message.ref_opcode) == (1, 0)
    # The reply on the wire: ERROR header on stream 0, then code 1, ref_opcode 0.
    assert reject.data[:6] == h("01 00 0000 8600")
    assert reject.data[HEADER_SIZE : HEADER_SIZE + 4] == h("0100 0000")
    assert Frame.decode(next(iter(_decoded(reject.data)))) == reject.frame


def _decoded(data: bytes) -> FrameDecoder:
    decoder = FrameDecoder()
    decoder.feed(data)
    return decoder


@pytest.mark.parametrize("version", [0, 2, 0xFF])
def test_bad_version_gets_bad_frame_then_close(version: int) -> None:
    head = struct.pack("<BBHHI", version, 0, 1, 1, 0)
    data = head + struct.pack("<H", binascii.crc_hqx(head, 0))  # a correct CRC
    reject = _reject_of(data)
    assert reject.frame == Frame(0, ErrorMessage(ErrorCode.BAD_FRAME, 0, reject.reason))
    # The version byte alone is enough to refuse.
    server = ServerConnection()
    assert len(server.receive_data(bytes([version]))) == 1


def test_oversized_payload_len() -> None:
    head = struct.pack("<BBHHI", 1, 0, 9, 0x02, MAX_PAYLOAD + 1)
    data = head + struct.pack("<H", binascii.crc_hqx(head, 0))
    reject = _reject_of(data)
    assert reject.frame == Frame(
        9, ErrorMessage(ErrorCode.LIMIT_EXCEEDED, Opcode.ASSERT, reject.reason)
    )
    decoder = FrameDecoder()
    decoder.feed(data)
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()
    # Exactly 16 MiB is allowed: the decoder waits for the payload.
    head = struct.pack("<BBHHI", 1, 0, 9, 0x02, MAX_PAYLOAD)
    decoder = FrameDecoder()
    decoder.feed(head + struct.pack("<H", binascii.crc_hqx(head, 0)))
    assert decoder.next_frame() is None and not decoder.failed


def test_bad_crc_in_decoder_raises_bad_frame() -> None:
    data = bytearray(vector("heartbeat (liveness)"))
    data[11] ^= 0x80
    decoder = FrameDecoder()
    decoder.feed(bytes(data))
    with pytest.raises(BadFrameError):
        decoder.next_frame()


@pytest.mark.parametrize("opcode", [0x00, 0x0C, 0x12, 0x81, 0x85, 0xFFFF])
def test_unknown_or_server_opcode_is_bad_frame_and_stays_open(opcode: int) -> None:
    server = ServerConnection()
    server.receive_data(vector("connect"))
    events = server.receive_data(encode_frame(4, opcode, b"\x01\x02") + vector("query"))
    assert isinstance(events[0], Reply)
    assert events[0].frame.stream_id == 4
    message = events[0].frame.message
    assert isinstance(message, ErrorMessage)
    assert (message.code, message.ref_opcode) == (ErrorCode.BAD_FRAME, opcode)
    assert events[1] == Frame(3, Query(7, E))


def test_malformed_payload_in_intact_frame_stays_open() -> None:
    server = ServerConnection()
    server.receive_data(vector("connect"))
    events = server.receive_data(
        encode_frame(6, 0x04, b"\x07\x00")  # QUERY without its entity_id
        + encode_frame(7, 0x10, h("0100 78 00 41"))  # CREATE_KIND with 65 fields
        + encode_frame(8, 0x07, b"", flags=1)  # reserved header flag
        + vector("query")
    )
    codes = [(e.frame.stream_id, e.frame.message.code) for e in events[:3]]  # type: ignore[union-attr]
    assert codes == [
        (6, ErrorCode.BAD_FRAME),
        (7, ErrorCode.LIMIT_EXCEEDED),
        (8, ErrorCode.BAD_FRAME),
    ]
    assert events[3] == Frame(3, Query(7, E))


def test_eof_inside_a_frame() -> None:
    server = ServerConnection()
    server.receive_data(vector("connect")[:5])
    assert server.receive_eof() == [Close("connection ended inside a frame (5 bytes)")]
    server = ServerConnection()
    server.receive_data(vector("connect"))
    assert server.receive_eof() == []


# --- the client connection -------------------------------------------------------------


def test_client_flow() -> None:
    client = ClientConnection()
    sid, data = client.connect("sensor", "s3cret", source_id=5, liveness_deadline_ms=10_000)
    assert (sid, data) == (1, vector("connect"))
    assert client.send(Assert(7, E, h(FIELDS_A)[4:])) == (0, vector("assert"))
    sid, data = client.send(Query(7, E))
    assert sid == 2 and data == encode_frame(2, 0x04, vector("query")[HEADER_SIZE:])
    assert client.pending == {1: Opcode.CONNECT, 2: Opcode.QUERY}

    (frame,) = client.receive_data(vector("ack connect"))
    assert frame == Frame(1, ConnectAck(5))
    assert client.connected and client.source_id == 5
    state = State(7, E, Change.QUERY, 43, 1, 0b111, h(FIELDS_B)[4:], metadata=b"m1")
    assert client.receive_data(Frame(2, state).encode()) == [Frame(2, state)]
    assert client.pending == {}

    sid, _ = client.send(Subscribe(7, bootstrap=True))
    assert sid == 3
    with pytest.raises(UsageError):
        client.send(Subscribe(7))
    frames = client.receive_data(
        Frame(3, Ack(Opcode.SUBSCRIBE)).encode()
        + Frame(3, BootstrapBegin(7)).encode()
        + Frame(3, Deleted(7, E, 44)).encode()
        + Frame(3, BootstrapEnd(7)).encode()
    )
    assert [f.message.opcode for f in frames] == [0x85, 0x83, 0x82, 0x84]
    assert client.subscriptions == {7: 3}
    sid, _ = client.send(Unsubscribe(7))
    assert sid == 4
    client.receive_data(Frame(4, Ack(Opcode.UNSUBSCRIBE)).encode())
    assert client.subscriptions == {} and client.pending == {}

    sid, _ = client.send(SourceEpochEnd(), ack=True)
    assert sid == 5
    (frame,) = client.receive_data(Frame(5, EpochEndAck(3)).encode())
    assert frame.message == EpochEndAck(3)
    # A failed fire-and-forget write arrives on stream 0.
    error = ErrorMessage(ErrorCode.KIND_NOT_FOUND, Opcode.ASSERT, "no kind 7")
    assert client.receive_data(Frame(0, error).encode()) == [Frame(0, error)]


def test_client_subscription_ends_on_error() -> None:
    client = ClientConnection()
    sid, _ = client.send(Subscribe(7))
    client.receive_data(Frame(sid, Ack(Opcode.SUBSCRIBE)).encode())
    assert client.subscriptions == {7: sid}
    overflow = ErrorMessage(ErrorCode.SUBSCRIPTION_OVERFLOW, Opcode.SUBSCRIBE, "slow")
    client.receive_data(Frame(sid, overflow).encode())
    assert client.subscriptions == {}
    with pytest.raises(UnexpectedFrameError):  # nothing may follow on that stream
        client.receive_data(Frame(sid, Deleted(7, E, 1)).encode())


@pytest.mark.parametrize(
    "frame",
    [
        Frame(9, Ack(Opcode.ASSERT)),  # nothing sent on stream 9
        Frame(1, Ack(Opcode.QUERY)),  # stream 1 was a CONNECT
        Frame(1, Deleted(7, E, 1)),  # notification on a non-subscription stream
        Frame(0, State(7, E, Change.CREATED, 1, 1, 1)),
        Frame(1, Query(7, E)),  # a client opcode from the server
        Frame(9, ErrorMessage(1, 0)),
    ],
)
def test_client_refuses_stray_frames(frame: Frame) -> None:
    client = ClientConnection()
    client.connect()
    with pytest.raises(UnexpectedFrameError):
        client.receive_data(frame.encode())


def test_client_stream_ids_wrap_and_skip_ids_in_use() -> None:
    client = ClientConnection()
    ids = [client.send(Heartbeat(), ack=True)[0] for _ in range(3)]
    assert ids == [1, 2, 3]
    client.receive_data(Frame(2, Ack(Opcode.HEARTBEAT)).encode())
    client._next_id = 65535
    assert client.send(Heartbeat(), ack=True)[0] == 65535
    assert client.send(Heartbeat(), ack=True)[0] == 2  # 1 is still waiting, 2 is free
    with pytest.raises(UsageError):
        client.send(Ack(Opcode.ASSERT))  # type: ignore[arg-type]
