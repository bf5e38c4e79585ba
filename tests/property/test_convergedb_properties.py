"""ConvergeDB codec properties: every message and field value survives encode/decode
unchanged, and a byte stream of frames decodes the same however it is split."""

from __future__ import annotations

import binascii
import itertools

from convergedb_strategies import (
    blobs,
    client_frames,
    entity_ids,
    frames,
    messages,
    schema_and_prefix,
    schema_and_present,
    typed,
    u16,
    u64,
    write_ops,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from headwater.protocols.convergedb import (
    HEADER_SIZE,
    WRITE_OPCODES,
    Batch,
    Change,
    Connect,
    FieldSpec,
    FieldValue,
    Frame,
    FrameDecoder,
    Message,
    Reply,
    ServerConnection,
    ServerEvent,
    State,
    WriteOp,
    crc16_xmodem,
    decode_fields,
    decode_message,
    decode_present_fields,
    decode_record,
    default_values,
    encode_fields,
    encode_present_fields,
)

EXAMPLES = settings(max_examples=200, deadline=None)
FEWER = settings(max_examples=80, deadline=None)
CONNECT = Frame(1, Connect("p")).encode()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# --- round trips ---------------------------------------------------------------------


@EXAMPLES
@given(messages)
def test_message_round_trip(message: Message) -> None:
    payload = message.encode()
    decoded = decode_message(message.opcode, payload)
    assert decoded == message
    assert typed(decoded) == typed(message)
    assert type(message).decode(payload) == message


@EXAMPLES
@given(frames)
def test_frame_round_trip(frame: Frame) -> None:
    data = frame.encode()
    decoder = FrameDecoder()
    decoder.feed(data)
    (raw,) = list(decoder)
    assert (raw.stream_id, raw.opcode, raw.flags) == (frame.stream_id, frame.message.opcode, 0)
    assert len(raw.payload) == len(data) - HEADER_SIZE
    assert Frame.decode(raw) == frame


@EXAMPLES
@given(u16, entity_ids, u64, blobs, blobs, st.none() | blobs)
@example(7, b"\xee" * 32, 1, b"", b"", b"")  # an empty previous section
@example(7, b"\xee" * 32, 1, b"", b"\x00" * 4, b"")  # metadata that looks like prev_len 0
@example(7, b"\xee" * 32, 1, b"", b"\x00\x00", None)
@example(7, b"\xee" * 32, 1, b"", b"", b"\x00" * 65538)  # prev_len's low half is 2
def test_state_previous_section_is_recognised(
    kind_id: int, entity_id: bytes, version: int, data: bytes, meta: bytes, previous: bytes | None
) -> None:
    state = State(kind_id, entity_id, Change.UPDATED, version, 1, 1, data, previous, meta)
    assert State.decode(state.encode()) == state


@EXAMPLES
@given(write_ops)
def test_single_op_is_the_batch_sub_op_without_its_type_byte(op: WriteOp) -> None:
    assert Batch([op]).encode() == b"\x01\x00" + bytes([op.opcode]) + op.encode()


@EXAMPLES
@given(st.lists(write_ops, max_size=8))
def test_batch_keeps_its_sub_ops_in_order(ops: list[WriteOp]) -> None:
    batch = Batch.decode(Batch(ops).encode())
    assert list(batch.ops) == ops
    assert [op.key for op in batch.ops] == [(op.kind_id, op.entity_id) for op in ops]


@EXAMPLES
@given(schema_and_prefix())
def test_assert_field_data_round_trip(case: tuple[list[FieldSpec], list[FieldValue]]) -> None:
    schema, values = case
    data = encode_fields(schema, values)
    assert typed(decode_fields(schema, data)) == typed(values)
    full = decode_fields(schema, data, complete=True)
    assert typed(full) == typed(values + default_values(schema)[len(values) :])
    # A complete record re-encodes to what decode_record reads back.
    assert typed(decode_record(schema, encode_fields(schema, full))) == typed(full)


@EXAMPLES
@given(schema_and_present())
def test_patch_field_data_round_trip(case: tuple[list[FieldSpec], dict[int, FieldValue]]) -> None:
    schema, values = case
    mask, data = encode_present_fields(schema, values)
    assert mask == sum(1 << i for i in values)
    assert typed(decode_present_fields(schema, mask, data)) == typed(values)


@EXAMPLES
@given(st.binary(max_size=64), st.integers(0, 0xFFFF))
def test_crc16_matches_binascii(data: bytes, start: int) -> None:
    assert crc16_xmodem(data, start) == binascii.crc_hqx(data, start)


@EXAMPLES
@given(entity_ids)
def test_header_crc_covers_the_first_ten_bytes(entity: bytes) -> None:
    data = Frame(3, State(1, entity, Change.QUERY, 1, 1, 1)).encode()
    assert int.from_bytes(data[10:12], "little") == crc16_xmodem(data[:10])


# --- framing under arbitrary splits --------------------------------------------------


@FEWER
@given(st.lists(frames, min_size=1, max_size=5), st.lists(st.integers(0, 10**6), max_size=12))
def test_frame_decoder_is_split_invariant(batch: list[Frame], cuts: list[int]) -> None:
    stream = b"".join(f.encode() for f in batch)
    decoder = FrameDecoder()
    out: list[Frame] = []
    for chunk in split(stream, cuts):
        decoder.feed(chunk)
        out.extend(Frame.decode(raw) for raw in decoder)
    assert out == batch
    assert decoder.at_frame_boundary and decoder.buffered_bytes == 0


@FEWER
@given(st.lists(frames, min_size=1, max_size=3))
def test_frame_decoder_bytewise(batch: list[Frame]) -> None:
    stream = b"".join(f.encode() for f in batch)
    decoder = FrameDecoder()
    out: list[Frame] = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        out.extend(Frame.decode(raw) for raw in decoder)
    assert out == batch


def _server_events(chunks: list[bytes]) -> list[ServerEvent]:
    server = ServerConnection()
    events: list[ServerEvent] = []
    for chunk in chunks:
        events.extend(server.receive_data(chunk))
    return events


@FEWER
@given(
    st.booleans(),
    st.lists(client_frames, max_size=5),
    st.lists(st.integers(0, 10**6), max_size=12),
)
def test_server_connection_is_split_invariant(
    connect_first: bool, batch: list[Frame], cuts: list[int]
) -> None:
    stream = (CONNECT if connect_first else b"") + b"".join(f.encode() for f in batch)
    whole = _server_events([stream])
    assert _server_events(split(stream, cuts)) == whole
    # One event per frame; before any CONNECT every request is refused by the connection.
    assert len(whole) == len(batch) + connect_first
    connected, read_only = connect_first, False
    for frame, event in zip(batch, whole[connect_first:], strict=True):
        message = frame.message
        if isinstance(message, Connect):
            assert (event == frame) is not connected  # a second CONNECT is refused
            if not connected:
                connected, read_only = True, message.read_only
        elif not connected or (read_only and message.opcode in WRITE_OPCODES):
            assert isinstance(event, Reply)
            assert event.frame.stream_id == frame.stream_id
        else:
            assert event == frame
