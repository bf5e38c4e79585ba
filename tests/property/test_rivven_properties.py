"""Properties of the Rivven codec: every message survives encode/decode, requests and
responses survive the framing and both connections, and the events do not depend on how
the bytes are split."""

from __future__ import annotations

import itertools
import random
import struct

import pytest
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import given, settings
from hypothesis import strategies as st
from rivven_strategies import ALL_MESSAGE_TYPES, messages, requests, responses

from headwater.protocols.rivven import (
    PROTOCOL_VERSION,
    ClientConnection,
    RequestFrame,
    ServerConnection,
    ServerEvent,
    decode_postcard_error,
    decode_request,
    decode_response,
    encode_postcard_error,
    pb,
)

PER_TYPE = settings(max_examples=25, deadline=None)
MANY = settings(max_examples=150, deadline=None)


def test_the_strategies_cover_every_message_of_the_schema() -> None:
    assert len(ALL_MESSAGE_TYPES) == len(pb.DESCRIPTOR.message_types_by_name) > 90


@pytest.mark.parametrize("name", ALL_MESSAGE_TYPES)
@PER_TYPE
@given(data=st.data())
def test_every_message_round_trips(name: str, data: st.DataObject) -> None:
    descriptor = pb.DESCRIPTOR.message_types_by_name[name]
    message: Message = data.draw(messages(descriptor))
    decoded = GetMessageClass(descriptor).FromString(message.SerializeToString())
    assert decoded == message


@MANY
@given(requests(handshake=True))
def test_decode_request_inverts_encoding(request: pb.Request) -> None:
    assert decode_request(request.SerializeToString()) == request


@MANY
@given(responses())
def test_decode_response_inverts_encoding(response: pb.Response) -> None:
    assert decode_response(response.SerializeToString()) == response


@MANY
@given(st.lists(requests(), min_size=1, max_size=5))
def test_requests_cross_the_wire_in_order(sent: list[pb.Request]) -> None:
    client = ClientConnection("prop")
    server = ServerConnection()
    framed = [client.send_request(request) for request in sent]
    events = server.receive_data(b"".join(data for _, data in framed))
    assert [type(event) for event in events] == [RequestFrame] * len(sent)
    for (correlation_id, _), request, event in zip(framed, sent, events, strict=True):
        assert isinstance(event, RequestFrame)
        assert event.correlation_id == correlation_id
        expected = pb.Request()
        expected.CopyFrom(request)
        expected.header.CopyFrom(
            pb.Header(version=PROTOCOL_VERSION, correlation_id=correlation_id, client_id="prop")
        )
        assert event.request == expected


@MANY
@given(st.lists(responses(), min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_responses_reach_their_requests_in_any_order(
    answers: list[pb.Response], rng: random.Random
) -> None:
    client = ClientConnection()
    server = ServerConnection()
    ids = [client.send_request(pb.PingRequest())[0] for _ in answers]
    order = list(range(len(answers)))
    rng.shuffle(order)
    data = b"".join(server.send(ids[i], answers[i]) for i in order)
    received = client.receive_data(data)
    assert [r.correlation_id for r in received] == [ids[i] for i in order]
    for i, frame in zip(order, received, strict=True):
        assert frame.response.WhichOneof("response_type") == answers[i].WhichOneof("response_type")
        expected = pb.Response()
        expected.CopyFrom(answers[i])
        expected.header.CopyFrom(pb.Header(version=PROTOCOL_VERSION, correlation_id=ids[i]))
        assert frame.response == expected
    assert client.pending == frozenset()


@MANY
@given(responses(), st.integers(0, 2**32 - 1), st.booleans())
def test_send_writes_the_canonical_bytes(
    answer: pb.Response, correlation_id: int, with_header: bool
) -> None:
    if with_header:
        answer.header.client_id = "replaced"
    expected = pb.Response()
    expected.CopyFrom(answer)
    expected.header.CopyFrom(pb.Header(version=PROTOCOL_VERSION, correlation_id=correlation_id))
    data = ServerConnection().send(correlation_id, answer)
    assert data[9:] == expected.SerializeToString(deterministic=True)
    assert answer.header.client_id == ("replaced" if with_header else "")  # not mutated


@MANY
@given(st.text(max_size=300))
def test_postcard_error_round_trips(message: str) -> None:
    assert decode_postcard_error(encode_postcard_error(message)) == message


def _frame(wire_format: int, correlation_id: int, payload: bytes) -> bytes:
    body = struct.pack(">BI", wire_format, correlation_id) + payload
    return struct.pack(">I", len(body)) + body


@st.composite
def server_input(draw: st.DrawFn) -> bytes:
    """Frames of every kind the server meets: requests, handshakes (good and bad
    versions), postcard, unknown formats, short bodies, undecodable payloads, and maybe
    an oversized length or a cut-off frame at the end."""
    parts: list[bytes] = []
    for correlation_id in range(1, draw(st.integers(1, 6)) + 1):
        kind = draw(st.sampled_from(["request", "handshake", "postcard", "format", "short", "bad"]))
        if kind == "request":
            payload = draw(requests()).SerializeToString()
            parts.append(_frame(1, correlation_id, payload))
        elif kind == "handshake":
            version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 1, 3]))
            payload = pb.Request(
                handshake=pb.HandshakeRequest(protocol_version=version)
            ).SerializeToString()
            parts.append(_frame(1, correlation_id, payload))
        elif kind == "postcard":
            parts.append(_frame(0, correlation_id, draw(st.binary(max_size=8))))
        elif kind == "format":
            parts.append(_frame(draw(st.integers(2, 255)), correlation_id, b""))
        elif kind == "short":
            body = draw(st.binary(max_size=4))
            parts.append(struct.pack(">I", len(body)) + body)
        else:
            parts.append(_frame(1, correlation_id, draw(st.binary(min_size=1, max_size=12))))
    tail = draw(st.sampled_from(["", "oversized", "cut"]))
    if tail == "oversized":
        parts.append(struct.pack(">I", 0xFFFF_FFFF))
    elif tail == "cut":
        parts.append(_frame(1, 99, b"\xf2\x01\x00")[:-1])
    return b"".join(parts)


def _events(chunks: list[bytes]) -> list[ServerEvent]:
    server = ServerConnection()
    events: list[ServerEvent] = []
    for chunk in chunks:
        events += server.receive_data(chunk)
    return [*events, *server.receive_eof()]


@st.composite
def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@MANY
@given(st.data())
def test_any_split_gives_the_same_server_events(data: st.DataObject) -> None:
    stream = data.draw(server_input())
    whole = _events([stream])
    assert whole, "every input yields at least one event"
    assert _events(data.draw(split(stream))) == whole
    assert _events([bytes([byte]) for byte in stream]) == whole


@MANY
@given(st.lists(responses(), min_size=1, max_size=4), st.data())
def test_any_split_gives_the_same_client_answers(
    answers: list[pb.Response], data: st.DataObject
) -> None:
    server = ServerConnection()
    stream = b"".join(server.send(i + 1, answer) for i, answer in enumerate(answers))

    def received(chunks: list[bytes]) -> list[object]:
        client = ClientConnection()
        for _ in answers:
            client.send_request(pb.PingRequest())
        out: list[object] = []
        for chunk in chunks:
            out += client.receive_data(chunk)
        assert client.at_frame_boundary
        return out

    assert received(data.draw(split(stream))) == received([stream])
