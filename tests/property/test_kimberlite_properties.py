"""Kimberlite codec properties: every message survives encode/decode unchanged, and frames
decode to the same messages however the byte stream is split."""

from __future__ import annotations

import itertools

from hypothesis import example, given, settings
from hypothesis import strategies as st
from kimberlite_strategies import (
    batches,
    request_payloads,
    requests,
    response_payloads,
    responses,
    typed,
    u32,
    u64,
)

from headwater.protocols.kimberlite import (
    ClientConnection,
    EventBatch,
    FrameDecoder,
    HandshakeRequest,
    ReadEventsResponse,
    Request,
    RequestPayload,
    Response,
    ResponsePayload,
    ServerConnection,
    ServerEvent,
    SubscriptionEventsResponse,
    decode_request,
    decode_request_body,
    decode_response,
    decode_response_body,
    encode_body,
    encode_frame,
    encode_frame_chunks,
    encode_read_events_response,
    encode_request,
    encode_request_chunks,
    encode_response,
    encode_subscription_events,
)

EXAMPLES = settings(max_examples=300, deadline=None)
FEWER = settings(max_examples=120, deadline=None)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# --- round trips ---------------------------------------------------------------------


@EXAMPLES
@given(requests)
def test_request_round_trip(request: Request) -> None:
    decoded = decode_request(encode_request(request), enforce_limits=False)
    assert decoded == request
    assert typed(decoded) == typed(request)


@EXAMPLES
@given(responses)
@example(
    # The events end in bytes that look like Option::Some's tag, followed by None.
    Response(1, ReadEventsResponse(EventBatch.of([b"\x01\x00\x00\x00" + bytes(8)]), None))
)
@example(Response(1, ReadEventsResponse(EventBatch.of([bytes(12)]), 0)))
def test_response_round_trip(response: Response) -> None:
    decoded = decode_response(encode_response(response))
    assert decoded == response
    assert typed(decoded) == typed(response)


@EXAMPLES
@given(request_payloads)
def test_request_body_round_trip(payload: RequestPayload) -> None:
    assert decode_request_body(payload.discriminant, encode_body(payload)) == payload


@EXAMPLES
@given(response_payloads)
def test_response_body_round_trip(payload: ResponsePayload) -> None:
    assert decode_response_body(payload.discriminant, encode_body(payload)) == payload


@EXAMPLES
@given(st.lists(st.binary(max_size=30), max_size=8))
def test_event_batch_keeps_values(values: list[bytes]) -> None:
    batch = EventBatch.of(values)
    assert batch.values() == values
    assert len(batch) == len(values)
    assert batch.event_bytes == sum(map(len, values))


# --- chunked encoders ----------------------------------------------------------------


@EXAMPLES
@given(u64, batches, st.none() | u64, st.lists(st.integers(0, 10_000), max_size=4))
def test_read_events_from_chunks_equals_plain_encoding(
    request_id: int, batch: EventBatch, next_offset: int | None, cuts: list[int]
) -> None:
    chunks = [memoryview(c) for c in split(bytes(batch.section), cuts)]
    payload = encode_read_events_response(request_id, batch.count, chunks, next_offset)
    expected = encode_response(Response(request_id, ReadEventsResponse(batch, next_offset)))
    assert b"".join(payload) == expected
    assert b"".join(encode_frame_chunks(payload)) == encode_frame(expected)


@EXAMPLES
@given(u64, u64, u64, batches, u32, st.lists(st.integers(0, 10_000), max_size=4))
def test_subscription_events_from_chunks_equals_plain_encoding(
    request_id: int,
    subscription_id: int,
    start: int,
    batch: EventBatch,
    credits: int,
    cuts: list[int],
) -> None:
    chunks = split(bytes(batch.section), cuts)
    payload = encode_subscription_events(
        request_id, subscription_id, start, batch.count, chunks, credits
    )
    push = SubscriptionEventsResponse(subscription_id, start, batch, credits)
    assert b"".join(payload) == encode_response(Response(request_id, push))


@EXAMPLES
@given(requests)
def test_request_chunks_join_to_the_request(request: Request) -> None:
    assert b"".join(encode_request_chunks(request)) == encode_request(request)


# --- framing under arbitrary splits --------------------------------------------------


@FEWER
@given(st.lists(requests, min_size=1, max_size=4), st.lists(st.integers(0, 10**6), max_size=12))
def test_frame_decoder_is_split_invariant(batch: list[Request], cuts: list[int]) -> None:
    payloads = [encode_request(r) for r in batch]
    stream = b"".join(encode_frame(p) for p in payloads)
    decoder = FrameDecoder()
    out: list[bytes] = []
    for chunk in split(stream, cuts):
        decoder.feed(chunk)
        out.extend(decoder)
    assert out == payloads
    assert decoder.at_frame_boundary


def test_frame_decoder_every_split_point_and_bytewise() -> None:
    payloads = [b"", b"x", bytes(range(40)), b"\x00" * 14]
    stream = b"".join(encode_frame(p) for p in payloads)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        out: list[bytes] = []
        for chunk in (stream[:cut], stream[cut:]):
            decoder.feed(chunk)
            out.extend(decoder)
        assert out == payloads, cut
    decoder = FrameDecoder()
    out = []
    for i in range(len(stream)):
        decoder.feed(stream[i : i + 1])
        out.extend(decoder)
    assert out == payloads


def _server_events(chunks: list[bytes]) -> list[ServerEvent]:
    server = ServerConnection(enforce_limits=False)
    events: list[ServerEvent] = []
    for chunk in chunks:
        events.extend(server.receive_data(chunk))
    return events


@FEWER
@given(
    st.booleans(),
    st.lists(requests, max_size=4),
    st.lists(st.integers(0, 10**6), max_size=12),
)
def test_server_connection_is_split_invariant(
    handshake_first: bool, batch: list[Request], cuts: list[int]
) -> None:
    if handshake_first:
        batch = [Request(1, 0, HandshakeRequest()), *batch]
    stream = b"".join(encode_frame(encode_request(r)) for r in batch)
    whole = _server_events([stream])
    assert _server_events(split(stream, cuts)) == whole
    # Before the first Handshake every request is answered by the connection itself.
    seen_handshake = False
    for request, event in zip(batch, whole, strict=True):
        seen_handshake = seen_handshake or isinstance(request.payload, HandshakeRequest)
        assert (event == request) is seen_handshake


@FEWER
@given(st.lists(responses, min_size=1, max_size=4), st.lists(st.integers(0, 10**6), max_size=12))
def test_client_connection_is_split_invariant(batch: list[Response], cuts: list[int]) -> None:
    server = ServerConnection()
    stream = b"".join(server.send(r) for r in batch)
    client = ClientConnection()
    received: list[Response] = []
    for chunk in split(stream, cuts):
        received.extend(client.receive_data(chunk))
    assert received == batch
    assert client.at_frame_boundary


@FEWER
@given(st.lists(request_payloads, min_size=1, max_size=5), u64)
def test_client_to_server(payloads: list[RequestPayload], tenant: int) -> None:
    client = ClientConnection(tenant)
    server = ServerConnection(enforce_limits=False)
    sent = [client.handshake()]
    sent += [client.send_request(p) for p in payloads]
    events = server.receive_data(b"".join(data for _, data in sent))
    assert events == [
        Request(request_id, tenant, payload)
        for (request_id, _), payload in zip(sent, [HandshakeRequest(), *payloads], strict=True)
    ]
