"""Byte-exact Rivven vectors (seed 004 "Protocol", docs/protocols/rivven.md).

Neither the seed nor Rivven's repository gives hex examples, so every frame here is
written out by hand: the framing from the seed's diagram and rivvend's framing.rs
(``u32 BE length | format | u32 BE correlation id | payload``), protobuf payloads from
the protobuf encoding rules applied to rivven.proto. The vectors named "Rivven's" are
the bytes Rivven's own code produces: ``Request::to_wire(WireFormat::Protobuf, id)``
builds the proto message through proto_convert.rs, whose Header carries version 2 and
correlation_id 0 (to_wire calls to_proto_bytes, which passes 0), and postcard
``Response::Error`` is enum variant 18 (messages.rs's discriminant-stability test).
"""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pb2 import FileDescriptorProto

from headwater.errors import ProtocolError, UsageError
from headwater.protocols.rivven import (
    MAX_FRAME,
    MAX_NAME_LEN,
    ClientConnection,
    Close,
    DecodeError,
    ErrorCode,
    FrameDecoder,
    FrameTooLarge,
    FrameTooLargeError,
    Reject,
    Reply,
    RequestFrame,
    ServerConnection,
    WireFormat,
    decode_postcard_error,
    decode_request,
    encode_frame,
    encode_postcard_error,
    error_code_for,
    make_record,
    pb,
    record_key,
    regenerate,
)

# Rivven's Header as proto_convert.rs writes it: version 2, correlation_id 0 (omitted).
RIVVEN_HEADER = bytes.fromhex("0a020802")


def frame(correlation_id: int, payload: bytes, wire_format: int = 1) -> bytes:
    """A frame built by hand from the layout (not with the codec under test)."""
    body = bytes([wire_format]) + struct.pack(">I", correlation_id) + payload
    return struct.pack(">I", len(body)) + body


def only(events: list[object]) -> object:
    assert len(events) == 1, events
    return events[0]


# ---- Rivven's own encodings -----------------------------------------------------------


def test_rivven_ping_request_and_our_answer() -> None:
    # Request::Ping.to_wire(Protobuf, 42): Request{header, ping = 30 {}}; tag 30<<3|2 = f2 01
    wire = bytes.fromhex("0000000c 01 0000002a 0a020802 f20100")
    assert wire == frame(42, RIVVEN_HEADER + bytes.fromhex("f20100"))
    server = ServerConnection()
    event = only(server.receive_data(wire))
    assert isinstance(event, RequestFrame)
    assert event.correlation_id == 42
    assert event.operation == "ping"
    assert event.request.header.version == 2
    assert event.request.header.correlation_id == 0
    # Our Pong: Response{header{version 2, correlation_id 42}, ping {}}
    assert server.send(42, pb.PingResponse()) == bytes.fromhex(
        "0000000e 01 0000002a 0a04 0802 102a f20100"
    )


def test_rivven_pong_and_error_responses_decode() -> None:
    client = ClientConnection()
    client_ids = [client.send_request(pb.PingRequest())[0] for _ in range(7)]
    assert client_ids == [1, 2, 3, 4, 5, 6, 7]
    # Response::Pong.to_wire(Protobuf, 1): the same bytes as the Ping request.
    pong = bytes.fromhex("0000000c 01 00000001 0a020802 f20100")
    # Response::Error{message: "boom"}.to_wire(Protobuf, 7): error = 99 (tag 9a 06),
    # ErrorResponse{code: 1 (Rivven always sends UNKNOWN), message: "boom"}
    error = frame(7, RIVVEN_HEADER + bytes.fromhex("9a06 08 0801 1204") + b"boom")
    assert error[:4] == bytes.fromhex("00000014")
    answers = client.receive_data(pong + error)
    assert [(a.correlation_id, a.kind) for a in answers] == [(1, "ping"), (7, "error")]
    assert answers[1].response.error.code == ErrorCode.UNKNOWN
    assert answers[1].response.error.message == "boom"
    assert client.pending == frozenset({2, 3, 4, 5, 6})


def test_rivven_postcard_error_decodes() -> None:
    # rivvend's framing.rs answers an oversized frame with
    # Response::Error{..}.to_wire(Postcard, 0): variant 18, varint length, UTF-8.
    text = b"MESSAGE_TOO_LARGE: 99999999 bytes exceeds limit"
    wire = frame(0, bytes([18, len(text)]) + text, wire_format=0)
    answer = only(ClientConnection().receive_data(wire))
    assert answer.wire_format == WireFormat.POSTCARD
    assert answer.correlation_id == 0
    assert answer.response.error.message == text.decode()
    assert encode_postcard_error(text.decode()) == bytes([18, len(text)]) + text
    # a 200-byte message needs a two-byte varint length: c8 01
    long_text = "x" * 200
    assert encode_postcard_error(long_text) == b"\x12\xc8\x01" + long_text.encode()
    assert decode_postcard_error(b"\x12\xc8\x01" + long_text.encode()) == long_text


def test_rivven_handshake_and_our_answer() -> None:
    # Request::Handshake{protocol_version: 2, client_id: "my-app"}.to_wire(Protobuf, 1):
    # handshake = 90 (tag d2 05), HandshakeRequest{1: 2, 2: "my-app"}
    payload = RIVVEN_HEADER + bytes.fromhex("d205 0a 0802 1206") + b"my-app"
    wire = frame(1, payload)
    assert wire[:4] == bytes.fromhex("00000016")
    server = ServerConnection()
    reply = only(server.receive_data(wire))
    assert isinstance(reply, Reply)
    # Response{header{2, 1}, handshake_result = 90 {server_version 2, compatible, "OK"}}
    assert (
        reply.data
        == bytes.fromhex("00000016 01 00000001 0a04 0802 1001 d205 08 0802 1001 1a02") + b"OK"
    )
    assert server.handshake_received
    assert server.client_id == "my-app"
    assert not server.closed


def test_rivven_publish_without_key() -> None:
    # Request::Publish{topic "events", partition Some(0), key None, value "hi"}:
    # publish = 10 (tag 52); partition is proto3 optional, so Some(0) is on the wire.
    publish = bytes.fromhex("0a06") + b"events" + bytes.fromhex("1000 1a04 1202") + b"hi"
    wire = frame(3, RIVVEN_HEADER + bytes.fromhex("5210") + publish)
    event = only(ServerConnection().receive_data(wire))
    assert isinstance(event, RequestFrame)
    request = event.request.publish
    assert (event.correlation_id, request.topic) == (3, "events")
    assert request.HasField("partition") and request.partition == 0
    assert not request.HasField("leader_epoch")
    assert record_key(request.record) is None
    assert request.record.value == b"hi"


# ---- frames built by hand from the schema ---------------------------------------------


def test_publish_with_key_headers_timestamp_keeps_them() -> None:
    # Record{key "k", value "v", headers [{h: x}], timestamp 1000 (e8 07), has_key}
    record = bytes.fromhex("0a016b 120176 1a06 0a0168 120178 20e807 2801")
    assert len(record) == 0x13
    publish = bytes.fromhex("0a0174 1003 1a13") + record
    wire = frame(5, bytes.fromhex("521a") + publish)
    event = only(ServerConnection().receive_data(wire))
    assert isinstance(event, RequestFrame)
    sent = event.request.publish
    assert (sent.topic, sent.partition) == ("t", 3)
    assert record_key(sent.record) == b"k"
    assert [(h.key, h.value) for h in sent.record.headers] == [("h", b"x")]
    assert sent.record.timestamp == 1000
    # the same request built with the helpers encodes to the same bytes
    built = pb.Request(
        publish=pb.PublishRequest(
            topic="t",
            partition=3,
            record=make_record(b"v", key=b"k", headers=[("h", b"x")], timestamp_ms=1000),
        )
    )
    assert built.SerializeToString() == bytes.fromhex("521a") + publish


def test_empty_key_is_not_no_key() -> None:
    with_empty = make_record(b"v", key=b"")
    assert record_key(with_empty) == b""
    assert with_empty.SerializeToString() == bytes.fromhex("120176 2801")
    assert record_key(make_record(b"v")) is None
    assert make_record(b"v").SerializeToString() == bytes.fromhex("120176")


def test_consume_by_partition_and_offset() -> None:
    # ConsumeRequest{topic "t", partition 2, offset 300 (ac 02), max_messages 10,
    # isolation_level 1, max_wait_ms 0 (optional: present)}; consume = 11 (tag 5a)
    consume = bytes.fromhex("0a0174 1002 18ac02 200a 3001 3800")
    wire = frame(9, bytes.fromhex("5a0e") + consume)
    event = only(ServerConnection().receive_data(wire))
    assert isinstance(event, RequestFrame)
    request = event.request.consume
    assert (request.partition, request.offset, request.max_messages) == (2, 300, 10)
    assert request.isolation_level == 1
    assert request.HasField("max_wait_ms") and request.max_wait_ms == 0


def test_handshake_version_mismatch_is_answered_then_closed() -> None:
    server = ServerConnection()
    wire = frame(1, bytes.fromhex("d205 07 0801 1203") + b"old")
    text = b"Version mismatch: client=1, server=2"
    assert len(text) == 0x24
    events = server.receive_data(wire + frame(2, bytes.fromhex("f20100")))
    reject = only(events)
    assert isinstance(reject, Reject)
    assert reject.data == (
        bytes.fromhex("00000036 01 00000001 0a04 0802 1001 d205 28 0802 1a24") + text
    )
    assert server.closed
    assert server.receive_data(frame(3, bytes.fromhex("f20100"))) == []


def test_oversized_length_is_refused_from_its_four_bytes() -> None:
    server = ServerConnection()
    reject = only(server.receive_data(b"\xff\xff\xff\xff"))
    assert isinstance(reject, Reject)
    text = b"MESSAGE_TOO_LARGE: frame of 4294967295 bytes exceeds the 10485760-byte limit"
    # Response{header{version 2}, error{code 9, message}} with correlation id 0
    error = bytes.fromhex("0809 12") + bytes([len(text)]) + text
    payload = bytes.fromhex("0a020802 9a06") + bytes([len(error)]) + error
    assert reject.data == frame(0, payload)
    assert server.closed
    assert server.buffered_bytes == 0


def test_limit_is_the_length_field() -> None:
    limit = 64
    server = ServerConnection(max_frame=limit)
    # the largest allowed frame: length 64 = 5 header bytes + a 59-byte payload
    topic = b"a" * 55  # 59 = tag + length + tag + length + 55
    payload = bytes.fromhex("6a") + bytes([len(topic) + 2]) + b"\x0a" + bytes([len(topic)]) + topic
    assert len(payload) == 59
    event = only(server.receive_data(frame(4, payload)))
    assert isinstance(event, RequestFrame) and event.operation == "delete_topic"
    assert isinstance(only(server.receive_data(struct.pack(">I", limit + 1))), Reject)
    with pytest.raises(FrameTooLarge):
        encode_frame(1, 1, b"x" * 60, max_frame=limit)
    assert MAX_FRAME == 10 * 1024 * 1024


def test_short_frame_is_answered_and_the_stream_goes_on() -> None:
    server = ServerConnection()
    events = server.receive_data(
        bytes.fromhex("00000003 010203") + frame(8, bytes.fromhex("f20100"))
    )
    assert len(events) == 2
    reply, ping = events
    assert isinstance(reply, Reply)
    assert reply.response.error.code == ErrorCode.INVALID_REQUEST
    assert reply.data[5:9] == b"\x00\x00\x00\x00"  # correlation id 0: unattributable
    assert isinstance(ping, RequestFrame) and ping.correlation_id == 8


def test_postcard_request_is_refused_in_postcard() -> None:
    server = ServerConnection()
    # postcard Request::Ping: whatever its bytes, the format byte 0x00 decides
    reply = only(server.receive_data(frame(0x11, b"\x0c", wire_format=0)))
    assert isinstance(reply, Reply)
    text = (
        b"INVALID_REQUEST: headwater speaks Rivven's protobuf format (0x01) only;"
        b" postcard (0x00) is not accepted"
    )
    assert reply.data == frame(0x11, b"\x12" + bytes([len(text)]) + text, wire_format=0)
    assert not server.closed
    assert isinstance(only(server.receive_data(frame(2, bytes.fromhex("f20100")))), RequestFrame)


def test_unknown_format_byte_gets_an_error_with_its_correlation_id() -> None:
    reply = only(ServerConnection().receive_data(frame(9, b"", wire_format=7)))
    assert isinstance(reply, Reply)
    assert reply.response.error.message == (
        "INVALID_REQUEST: unknown wire format 0x07 (0x01 is protobuf)"
    )
    assert reply.data[4:9] == b"\x01\x00\x00\x00\x09"


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        (b"\xff", "is not a Request"),
        (RIVVEN_HEADER, "carries no operation"),
        (bytes.fromhex("c00c01"), "carries no operation"),  # field 200: not ours
        (bytes.fromhex("5202 0a00"), "publish carries no record"),
        (
            bytes.fromhex("ca02 06 28f0a204 1a00"),  # idempotent_publish, epoch 70000
            "producer_epoch 70000 exceeds 65535",
        ),
        (bytes.fromhex("5a02 3002"), "isolation_level 2"),
        (bytes.fromhex("a201 00"), "authenticate names no mechanism"),
        (
            bytes.fromhex("6a 8302 0a 8002") + b"a" * 256,
            None,  # exactly 256 bytes: allowed
        ),
        (
            bytes.fromhex("6a 8402 0a 8102") + b"a" * 257,
            "delete_topic.name is 257 bytes (at most 256)",
        ),
        (b"\x72\x03\x0a\x01\xff", "is not a Request"),  # a name that is not UTF-8
    ],
)
def test_invalid_payload_is_answered_and_the_connection_stays(
    payload: bytes, complaint: str | None
) -> None:
    server = ServerConnection()
    event = only(server.receive_data(frame(6, payload)))
    if complaint is None:
        assert isinstance(event, RequestFrame)
        assert len(event.request.delete_topic.name) == MAX_NAME_LEN
        return
    assert isinstance(event, Reply)
    error = event.response.error
    assert (error.code, event.response.header.correlation_id) == (ErrorCode.INVALID_REQUEST, 6)
    assert complaint in error.message
    with pytest.raises(DecodeError):
        decode_request(payload)
    assert isinstance(only(server.receive_data(frame(7, bytes.fromhex("f20100")))), RequestFrame)


def test_lists_past_the_limit_are_refused() -> None:
    topics = pb.GetMetadataRequest(topics=["t"] * 10_001)
    payload = pb.Request(get_metadata=topics).SerializeToString()
    event = only(ServerConnection().receive_data(frame(1, payload)))
    assert isinstance(event, Reply)
    assert "get_metadata.topics has 10001 entries" in event.response.error.message


# ---- the client: pipelining and the server's bytes ------------------------------------


def test_client_matches_out_of_order_answers() -> None:
    client = ClientConnection("sdk")
    first, _ = client.send_request(pb.PingRequest())
    second, data = client.send_request(pb.ListTopicsRequest())
    request = pb.Request()
    request.ParseFromString(data[9:])
    assert (request.header.version, request.header.correlation_id) == (2, second)
    assert request.header.client_id == "sdk"
    server = ServerConnection()
    answers = client.receive_data(
        server.send(second, pb.ListTopicsResponse(topics=["a"]))
        + server.send(first, pb.PingResponse())
    )
    assert [(a.correlation_id, a.kind) for a in answers] == [
        (second, "list_topics"),
        (first, "ping"),
    ]
    assert client.pending == frozenset()


def test_client_refuses_an_answer_to_nothing() -> None:
    client = ClientConnection()
    with pytest.raises(ProtocolError, match="not pending"):
        client.receive_data(frame(5, bytes.fromhex("f20100")))
    # an error with correlation id 0 is the server's word on the connection: accepted
    zero = ClientConnection().receive_data(frame(0, bytes.fromhex("9a06 02 0802")))
    assert zero[0].kind == "error"


def test_client_ids_wrap_past_u32_and_skip_zero() -> None:
    client = ClientConnection(first_correlation_id=0xFFFF_FFFF)
    assert client.send_request(pb.PingRequest())[0] == 0xFFFF_FFFF
    assert client.send_request(pb.PingRequest())[0] == 1
    with pytest.raises(UsageError):
        ClientConnection(first_correlation_id=0)
    with pytest.raises(UsageError):
        client.send_request(pb.Request())  # no operation
    with pytest.raises(UsageError):
        client.send_request(pb.PingResponse())  # not a request


def test_server_refuses_to_send_nothing_or_too_much() -> None:
    server = ServerConnection(max_frame=64)
    with pytest.raises(UsageError):
        server.send(1, pb.Response())  # no answer
    with pytest.raises(UsageError):
        server.send(1, pb.PingRequest())  # not a response
    with pytest.raises(FrameTooLarge):
        server.send(1, pb.ListTopicsResponse(topics=["t" * 64]))
    # its own error answers still go out under the tiny limit
    assert len(server.send_error(1, ErrorCode.TIMEOUT, "x" * 80)) > 64
    assert error_response_code_name(server.send_error(1, 999, "odd")) == "UNKNOWN: odd"


def error_response_code_name(data: bytes) -> str:
    response = pb.Response.FromString(data[9:])
    return response.error.message


def test_frame_decoder_cuts_bodies() -> None:
    decoder = FrameDecoder()
    decoder.feed(frame(1, b"ab")[:6])
    assert decoder.next_item() is None
    decoder.feed(frame(1, b"ab")[6:] + b"\x01\x00")
    assert decoder.next_item() == b"\x01\x00\x00\x00\x01ab"
    assert not decoder.at_boundary
    decoder.feed(b"\x00\x00")  # a length of 16 MiB
    with pytest.raises(FrameTooLargeError):
        decoder.next_item()


def test_engine_errors_map_to_error_codes() -> None:
    from headwater.errors import InternalError, InvalidOffset, StreamNotFound

    assert error_code_for(StreamNotFound("x")) == ErrorCode.TOPIC_NOT_FOUND
    assert error_code_for(InvalidOffset("x")) == ErrorCode.OFFSET_OUT_OF_RANGE
    assert error_code_for(InternalError("x")) == ErrorCode.UNKNOWN


def test_acks_all_errors_map_to_replica_not_available_and_timeout() -> None:
    from headwater.errors import (
        NotEnoughReplicas,
        NotEnoughReplicasAfterAppend,
        ReplicationTimedOut,
    )

    assert error_code_for(NotEnoughReplicas("x")) == ErrorCode.REPLICA_NOT_AVAILABLE
    after = NotEnoughReplicasAfterAppend("1 in-sync replicas")
    assert error_code_for(after) == ErrorCode.REPLICA_NOT_AVAILABLE
    assert after.message == "stored on the leader, unconfirmed: 1 in-sync replicas"
    assert error_code_for(ReplicationTimedOut("x")) == ErrorCode.TIMEOUT


def test_close_is_only_for_a_frame_cut_short() -> None:
    server = ServerConnection()
    assert server.receive_data(frame(1, bytes.fromhex("f20100"))[:7]) == []
    (close,) = server.receive_eof()
    assert isinstance(close, Close)


# ---- the generated module matches the schema ------------------------------------------


def _comparable(descriptor: FileDescriptorProto) -> FileDescriptorProto:
    """``descriptor`` less json_name, which protoc derives from the field name and writes
    into a descriptor set but not into the generated module."""
    messages = list(descriptor.message_type)
    while messages:
        message = messages.pop()
        for field in message.field:
            field.ClearField("json_name")
        messages.extend(message.nested_type)
    return descriptor


def _without_generator_version(source: str) -> list[str]:
    """The module's lines less those naming the protobuf release that generated it
    (the version comment and ValidateProtobufRuntimeVersion's numbers)."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "ValidateProtobufRuntimeVersion" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(")"))
    kept = lines[:start] + lines[end + 1 :]
    return [line for line in kept if not line.startswith("# Protobuf Python Version")]


def test_committed_generated_code_matches_the_schema() -> None:
    package = Path(regenerate.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        regenerate.compile_schema(out, descriptor_set=out / "schema.pb")
        schema = descriptor_pb2.FileDescriptorSet()
        schema.ParseFromString((out / "schema.pb").read_bytes())
        committed = FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
        assert _comparable(committed) == _comparable(schema.file[0]), (
            "rivven_pb2.py is stale: run make rivven-proto"
        )
        fresh_py = (out / "rivven_pb2.py").read_text()
        fresh_pyi = (out / "rivven_pb2.pyi").read_text()
    assert _without_generator_version(fresh_py) == _without_generator_version(
        (package / "rivven_pb2.py").read_text()
    )
    assert fresh_pyi == (package / "rivven_pb2.pyi").read_text(), "run make rivven-proto"
