"""Byte-exact Kimberlite vectors: the seed's "Binary Encoding" examples (golden) and one
vector per request, response and frame case written by hand from spec/PROTOCOLS.md §1."""

from __future__ import annotations

import re

import pytest

from headwater.errors import InvalidRequest, StreamNotFound, UnknownError, UsageError
from headwater.protocols.kimberlite import (
    MAX_FRAME,
    AppendEventsRequest,
    AppendEventsResponse,
    AppendIdempotentRequest,
    ClientConnection,
    Close,
    CloseReason,
    CreateStreamRequest,
    CreateStreamResponse,
    DataClass,
    DeleteStreamRequest,
    ErrorCode,
    ErrorResponse,
    EventBatch,
    FatalFrameError,
    FrameDecoder,
    HandshakeRequest,
    HandshakeResponse,
    ListStreamsRequest,
    Placement,
    QueryAtRequest,
    QueryAtResponse,
    QueryRequest,
    QueryResponse,
    ReadEventsRequest,
    ReadEventsResponse,
    Reject,
    RejectFrameError,
    Reply,
    Request,
    RequestPayload,
    Response,
    ResponsePayload,
    ServerConnection,
    StreamDeletedResponse,
    StreamInfo,
    StreamsResponse,
    SubscribeCreditRequest,
    SubscribeRequest,
    SubscribeResponse,
    SubscriptionClosedResponse,
    SubscriptionCreditResponse,
    SubscriptionEventsResponse,
    SyncRequest,
    SyncResponse,
    Timestamp,
    UnsubscribeRequest,
    decode_request,
    decode_request_body,
    decode_response,
    decode_response_body,
    encode_body,
    encode_frame,
    encode_frame_chunks,
    encode_read_events_response,
    encode_request,
    encode_response,
    encode_subscription_events,
)


def h(text: str) -> bytes:
    """Hex with ``//`` comments and any whitespace, as the seed writes its examples."""
    return bytes.fromhex(re.sub(r"//[^\n]*", "", text))


# --- the seed's golden vectors -------------------------------------------------------

SEED_CREATE_STREAM = h("""
    06 00 00 00 00 00 00 00  // name length (6)
    65 76 65 6E 74 73        // "events" (UTF-8)
    00 00 00 00              // data_class discriminant (0 = PHI)
    00 00 00 00              // placement discriminant (0 = Global)
""")

SEED_APPEND_EVENTS = h("""
    2A 00 00 00 00 00 00 00  // stream_id (42)
    02 00 00 00 00 00 00 00  // events.len (2)
    03 00 00 00 00 00 00 00  // events[0].len (3)
    01 02 03                 // events[0] bytes
    02 00 00 00 00 00 00 00  // events[1].len (2)
    04 05                    // events[1] bytes
""")

SEED_HANDSHAKE_REQUEST = h("""
    01 00 00 00 00 00 00 00  // id (1)
    2A 00 00 00 00 00 00 00  // tenant_id (42)
    00 00 00 00              // payload discriminant (0 = Handshake)
    01 00                    // client_version (1)
    00 00 00 00              // auth_token discriminant (0 = None)
""")


def test_seed_create_stream_body() -> None:
    message = CreateStreamRequest("events", DataClass.PHI, Placement.GLOBAL)
    assert encode_body(message) == SEED_CREATE_STREAM
    assert decode_request_body(1, SEED_CREATE_STREAM) == message


def test_seed_append_events_body() -> None:
    message = AppendEventsRequest(42, EventBatch.of([b"\x01\x02\x03", b"\x04\x05"]))
    assert encode_body(message) == SEED_APPEND_EVENTS
    decoded = decode_request_body(2, SEED_APPEND_EVENTS)
    assert decoded == message
    assert isinstance(decoded, AppendEventsRequest)
    assert decoded.events.values() == [b"\x01\x02\x03", b"\x04\x05"]
    # The events section is exposed raw: exactly the bytes after the u64 count.
    assert bytes(decoded.events.section) == SEED_APPEND_EVENTS[16:]
    assert decoded.events.count == 2


def test_seed_request_with_tenant_context() -> None:
    message = Request(1, 42, HandshakeRequest(client_version=1, auth_token=None))
    assert encode_request(message) == SEED_HANDSHAKE_REQUEST
    assert decode_request(SEED_HANDSHAKE_REQUEST) == message


# --- requests, from §1 ---------------------------------------------------------------

ENVELOPE_7_0 = "07 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00"  # id 7, tenant 0

REQUEST_VECTORS: list[tuple[RequestPayload, str]] = [
    (
        HandshakeRequest(1, "tok"),
        """00 00 00 00  01 00  01 00 00 00  03 00 00 00 00 00 00 00  74 6f 6b""",
    ),
    (
        CreateStreamRequest("s_1", DataClass.DEIDENTIFIED, Placement.REGIONAL),
        """01 00 00 00  03 00 00 00 00 00 00 00 73 5f 31  02 00 00 00  01 00 00 00""",
    ),
    (
        AppendEventsRequest(1, EventBatch.of([b""])),
        """02 00 00 00  01 00 00 00 00 00 00 00  01 00 00 00 00 00 00 00
           00 00 00 00 00 00 00 00""",
    ),
    (
        QueryRequest("q", [None, -2, "x", True, Timestamp(5)]),
        """03 00 00 00  01 00 00 00 00 00 00 00 71
           05 00 00 00 00 00 00 00
           00 00 00 00                                          // Null
           01 00 00 00  fe ff ff ff ff ff ff ff                 // BigInt(-2)
           02 00 00 00  01 00 00 00 00 00 00 00 78              // Text("x")
           03 00 00 00  01                                      // Boolean(true)
           04 00 00 00  05 00 00 00 00 00 00 00                 // Timestamp(5)""",
    ),
    (
        QueryAtRequest("q", [], 258),
        """04 00 00 00  01 00 00 00 00 00 00 00 71  00 00 00 00 00 00 00 00
           02 01 00 00 00 00 00 00""",
    ),
    (
        ReadEventsRequest(1, 2, 65536),
        """05 00 00 00  01 00 00 00 00 00 00 00  02 00 00 00 00 00 00 00
           00 00 01 00 00 00 00 00""",
    ),
    (
        SubscribeRequest(1, 2**64 - 1, 10, "g"),
        """06 00 00 00  01 00 00 00 00 00 00 00  ff ff ff ff ff ff ff ff  0a 00 00 00
           01 00 00 00  01 00 00 00 00 00 00 00 67""",
    ),
    (
        SubscribeRequest(1, 0, 0, None),
        """06 00 00 00  01 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00  00 00 00 00
           00 00 00 00""",
    ),
    (SyncRequest(), "07 00 00 00"),
    (
        SubscribeCreditRequest(9, 5),
        "08 00 00 00  09 00 00 00 00 00 00 00  05 00 00 00",
    ),
    (UnsubscribeRequest(9), "09 00 00 00  09 00 00 00 00 00 00 00"),
    (
        AppendIdempotentRequest(1, 2, 3, EventBatch.of([b"x"])),
        """0a 00 00 00  01 00 00 00 00 00 00 00  02 00 00 00 00 00 00 00
           03 00 00 00 00 00 00 00  01 00 00 00 00 00 00 00  01 00 00 00 00 00 00 00 78""",
    ),
    (DeleteStreamRequest(4), "0b 00 00 00  04 00 00 00 00 00 00 00"),
    (ListStreamsRequest(), "0c 00 00 00"),
]


@pytest.mark.parametrize(
    ("payload", "hex_body"), REQUEST_VECTORS, ids=[type(p).__name__ for p, _ in REQUEST_VECTORS]
)
def test_request_vector(payload: RequestPayload, hex_body: str) -> None:
    wire = h(ENVELOPE_7_0 + hex_body)
    request = Request(7, 0, payload)
    assert encode_request(request) == wire
    assert decode_request(wire) == request
    assert encode_body(payload) == wire[20:]


def test_every_request_type_has_a_vector() -> None:
    assert sorted({p.discriminant for p, _ in REQUEST_VECTORS}) == list(range(13))


# --- responses, from §1 --------------------------------------------------------------

RESPONSE_ID_7 = "07 00 00 00 00 00 00 00"

RESPONSE_VECTORS: list[tuple[ResponsePayload, str]] = [
    (
        ErrorResponse(ErrorCode.STREAM_NOT_FOUND, "no"),
        "00 00 00 00  05 00  02 00 00 00 00 00 00 00 6e 6f",
    ),
    (
        HandshakeResponse(1, True, ["query", "sync"]),
        """01 00 00 00  01 00  01  02 00 00 00 00 00 00 00
           05 00 00 00 00 00 00 00 71 75 65 72 79  04 00 00 00 00 00 00 00 73 79 6e 63""",
    ),
    (CreateStreamResponse(100), "02 00 00 00  64 00 00 00 00 00 00 00"),
    (AppendEventsResponse(3, 2), "03 00 00 00  03 00 00 00 00 00 00 00  02 00 00 00"),
    (
        QueryResponse(["count"], [[2], [None]]),
        """04 00 00 00  01 00 00 00 00 00 00 00  05 00 00 00 00 00 00 00 63 6f 75 6e 74
           02 00 00 00 00 00 00 00
           01 00 00 00 00 00 00 00  01 00 00 00  02 00 00 00 00 00 00 00
           01 00 00 00 00 00 00 00  00 00 00 00""",
    ),
    (QueryAtResponse([], []), "05 00 00 00" + " 00" * 16),
    (
        ReadEventsResponse(EventBatch.of([b"ab"]), 11),
        """06 00 00 00  01 00 00 00 00 00 00 00  02 00 00 00 00 00 00 00 61 62
           01 00 00 00  0b 00 00 00 00 00 00 00""",
    ),
    (
        ReadEventsResponse(EventBatch.of([]), None),
        "06 00 00 00  00 00 00 00 00 00 00 00  00 00 00 00",
    ),
    (
        SubscribeResponse(77, 5, 10),
        "07 00 00 00  4d 00 00 00 00 00 00 00  05 00 00 00 00 00 00 00  0a 00 00 00",
    ),
    (SyncResponse(True), "08 00 00 00  01"),
    (SyncResponse(False), "08 00 00 00  00"),
    (
        SubscriptionEventsResponse(77, 5, EventBatch.of([b"e"]), 9),
        """09 00 00 00  4d 00 00 00 00 00 00 00  05 00 00 00 00 00 00 00
           01 00 00 00 00 00 00 00  01 00 00 00 00 00 00 00 65  09 00 00 00""",
    ),
    (
        SubscriptionClosedResponse(77, CloseReason.CLIENT_CANCELLED),
        "0a 00 00 00  4d 00 00 00 00 00 00 00  00 00 00 00",
    ),
    (
        SubscriptionClosedResponse(77, CloseReason.PROTOCOL_ERROR),
        "0a 00 00 00  4d 00 00 00 00 00 00 00  04 00 00 00",
    ),
    (
        SubscriptionCreditResponse(77, 15),
        "0b 00 00 00  4d 00 00 00 00 00 00 00  0f 00 00 00",
    ),
    (StreamDeletedResponse(4), "0c 00 00 00  04 00 00 00 00 00 00 00"),
    (
        StreamsResponse([StreamInfo(1, "a", 2, 300, -1)]),
        """0d 00 00 00  01 00 00 00 00 00 00 00
           01 00 00 00 00 00 00 00  01 00 00 00 00 00 00 00 61  02 00 00 00 00 00 00 00
           2c 01 00 00 00 00 00 00  ff ff ff ff ff ff ff ff""",
    ),
]


@pytest.mark.parametrize(
    ("payload", "hex_body"),
    RESPONSE_VECTORS,
    ids=[type(p).__name__ for p, _ in RESPONSE_VECTORS],
)
def test_response_vector(payload: ResponsePayload, hex_body: str) -> None:
    wire = h(RESPONSE_ID_7 + hex_body)
    response = Response(7, payload)
    assert encode_response(response) == wire
    assert decode_response(wire) == response
    assert decode_response_body(payload.discriminant, wire[12:]) == payload


def test_every_response_type_has_a_vector() -> None:
    assert sorted({p.discriminant for p, _ in RESPONSE_VECTORS}) == list(range(14))


def test_read_events_from_stored_chunks_matches_the_plain_encoding() -> None:
    stored = EventBatch.of([b"one", b"two", b"three"]).section
    view = memoryview(stored)
    # Split the records section across chunks the way a reader of two batches would.
    chunks = [view[:11], view[11:]]
    expected = encode_response(
        Response(7, ReadEventsResponse(EventBatch.of([b"one", b"two", b"three"]), 3))
    )
    assert b"".join(encode_read_events_response(7, 3, chunks, 3)) == expected
    pushed = encode_subscription_events(7, 77, 0, 3, chunks, 4)
    assert b"".join(pushed) == encode_response(
        Response(7, SubscriptionEventsResponse(77, 0, EventBatch.of([b"one", b"two", b"three"]), 4))
    )


def test_unknown_error_codes_survive_decoding() -> None:
    wire = h(RESPONSE_ID_7 + "00 00 00 00  10 00  00 00 00 00 00 00 00 00")
    decoded = decode_response(wire)
    assert decoded.payload == ErrorResponse(16, "")
    assert isinstance(decoded.payload, ErrorResponse)
    assert isinstance(decoded.payload.to_exception(), UnknownError)


def test_error_response_maps_to_headwater_errors() -> None:
    assert isinstance(ErrorResponse(5, "gone").to_exception(), StreamNotFound)
    assert ErrorResponse.from_exception(InvalidRequest("bad")) == ErrorResponse(2, "bad")
    assert [code.retryable for code in ErrorCode].count(True) == 5
    assert {int(c) for c in ErrorCode if c.retryable} == {1, 12, 13, 14, 15}


# --- frames --------------------------------------------------------------------------


def test_frame_header_vector() -> None:
    # CRC-32 (IEEE) of "123456789" is the standard check value 0xCBF43926.
    assert (
        encode_frame(b"123456789")
        == h("""
        56 44 42 20   // magic "VDB "
        00 01         // version 1
        00 00 00 09   // payload_len 9
        CB F4 39 26   // crc32
    """)
        + b"123456789"
    )
    assert encode_frame(b"") == h("56 44 42 20 00 01 00 00 00 00 00 00 00 00")


def test_framed_seed_handshake() -> None:
    frame = encode_frame(SEED_HANDSHAKE_REQUEST)
    # payload_len 26; CRC-32 cc6eb6bf
    assert frame == h("56 44 42 20  00 01  00 00 00 1a  cc 6e b6 bf") + SEED_HANDSHAKE_REQUEST
    assert (
        b"".join(encode_frame_chunks([SEED_HANDSHAKE_REQUEST[:5], SEED_HANDSHAKE_REQUEST[5:]]))
        == frame
    )
    decoder = FrameDecoder()
    decoder.feed(frame)
    assert list(decoder) == [SEED_HANDSHAKE_REQUEST]
    assert decoder.at_frame_boundary


REJECT_REPLY = "00 00 00 00 00 00 00 00  00 00 00 00  02 00"  # request 0, Error, InvalidRequest


@pytest.mark.parametrize(
    ("header", "outcome"),
    [
        ("56 44 42 21 00 01 00 00 00 00 00 00 00 00", FatalFrameError),  # magic
        ("47 45 54 20", FatalFrameError),  # "GET " is refused after 4 bytes
        ("56 44 42 20 00 02 00 00 00 00 00 00 00 00", RejectFrameError),  # version 2
        ("56 44 42 20 00 00 00 00 00 00 00 00 00 00", RejectFrameError),  # version 0
        ("56 44 42 20 00 01 01 00 00 01 00 00 00 00", RejectFrameError),  # 16 MiB + 1
        ("56 44 42 20 00 01 FF FF FF FF", RejectFrameError),  # 4 GiB, refused at 10 bytes
        ("56 44 42 20 00 01 00 00 00 01 00 00 00 00 00", FatalFrameError),  # CRC
        # Order: a bad magic wins over a bad version, a bad version over a bad length.
        ("00 00 00 00 00 09 FF FF FF FF", FatalFrameError),
        ("56 44 42 20 00 09 FF FF FF FF", RejectFrameError),
    ],
)
def test_frame_validation(header: str, outcome: type[Exception]) -> None:
    decoder = FrameDecoder()
    decoder.feed(h(header))
    with pytest.raises(outcome):
        decoder.next_payload()
    assert decoder.buffered_bytes == 0
    with pytest.raises(outcome):  # stays failed
        decoder.next_payload()


def test_exactly_16_mib_is_accepted_by_the_header_check() -> None:
    decoder = FrameDecoder()
    decoder.feed(h("56 44 42 20 00 01 01 00 00 00 00 00 00 00"))
    assert decoder.next_payload() is None
    assert not decoder.failed


def test_oversize_frame_gets_the_reject_reply_bytes() -> None:
    server = ServerConnection()
    events = server.receive_data(h("56 44 42 20 00 01 FF FF FF FF"))
    assert len(events) == 1
    reject = events[0]
    assert isinstance(reject, Reject)
    assert reject.data[:6] == h("56 44 42 20 00 01")
    assert reject.data[14:28] == h(REJECT_REPLY)
    assert decode_response(reject.data[14:]) == reject.response
    assert server.closed
    assert server.receive_data(b"more") == []


def test_bad_crc_closes_silently() -> None:
    frame = bytearray(encode_frame(SEED_HANDSHAKE_REQUEST))
    frame[-1] ^= 1
    events = ServerConnection().receive_data(bytes(frame))
    assert len(events) == 1
    assert isinstance(events[0], Close)


# --- connection semantics ------------------------------------------------------------


def _reply(event: object) -> Response:
    assert isinstance(event, Reply)
    return event.response


def _invalid_request(response: Response) -> int:
    """The request id of an InvalidRequest error response (fails on anything else)."""
    assert isinstance(response.payload, ErrorResponse)
    assert response.payload.code == ErrorCode.INVALID_REQUEST
    assert response.payload.message
    return response.request_id


def test_requests_before_handshake_get_invalid_request_with_their_id() -> None:
    server = ServerConnection()
    client = ClientConnection(tenant_id=42)
    create_id, create = client.send_request(CreateStreamRequest("s"))
    hs_id, hs = client.handshake("tok")
    _, sync = client.send_request(SyncRequest())
    events = server.receive_data(create + hs + sync)
    assert [type(e).__name__ for e in events] == ["Reply", "Request", "Request"]
    reply = events[0]
    assert isinstance(reply, Reply)
    (answer,) = client.receive_data(reply.data)
    assert answer == reply.response
    assert _invalid_request(answer) == create_id
    assert events[1] == Request(hs_id, 42, HandshakeRequest(1, "tok"))
    assert server.handshake_received


def test_client_request_ids_increase_from_one() -> None:
    client = ClientConnection()
    ids = [client.send_request(SyncRequest())[0] for _ in range(3)]
    assert ids == [1, 2, 3]


def test_undecodable_payload_in_an_intact_frame_gets_a_reply_and_keeps_the_connection() -> None:
    server = ServerConnection()
    hello = encode_frame(encode_request(Request(1, 0, HandshakeRequest())))
    bad = encode_frame(h("05 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00  63 00 00 00"))
    sync = encode_frame(encode_request(Request(6, 0, SyncRequest())))
    events = server.receive_data(hello + bad + sync)
    assert [type(e).__name__ for e in events] == ["Request", "Reply", "Request"]
    assert _invalid_request(_reply(events[1])) == 5
    assert not server.closed


def test_append_limits_are_invalid_request() -> None:
    def frame(request_id: int, events: list[bytes]) -> bytes:
        append = AppendEventsRequest(1, EventBatch.of(events))
        return encode_frame(encode_request(Request(request_id, 0, append)))

    server = ServerConnection()
    hello = encode_frame(encode_request(Request(1, 0, HandshakeRequest())))
    empty = frame(2, [])
    many = frame(3, [b""] * 10_001)  # refused from the count alone
    big = frame(4, [b"x" * (4 << 20), b"y"])
    exact = frame(5, [b"x" * (4 << 20)])
    events = server.receive_data(hello + empty + many + big + exact)
    assert [type(e).__name__ for e in events] == ["Request", "Reply", "Reply", "Reply", "Request"]
    assert [_invalid_request(_reply(e)) for e in events[1:4]] == [2, 3, 4]


# --- API misuse is UsageError, never ProtocolError -----------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        Request(2**64, 0, SyncRequest()),
        Request(1, -1, SyncRequest()),
        Request(1, 0, ReadEventsRequest(1, 2**64, 0)),
        Request(1, 0, HandshakeRequest(2**16)),
        Request(1, 0, QueryRequest("q", [2**63])),
        Request(1, 0, QueryRequest("q", [1.5])),  # type: ignore[list-item]
        Request(1, 0, CreateStreamRequest("\ud800")),
    ],
)
def test_unencodable_requests_are_usage_errors(request_: Request) -> None:
    with pytest.raises(UsageError):
        encode_request(request_)


def test_oversized_frames_are_usage_errors() -> None:
    with pytest.raises(UsageError):
        encode_frame(bytes(MAX_FRAME + 1))
    with pytest.raises(UsageError):
        encode_frame_chunks([bytes(MAX_FRAME), b"x"])
    with pytest.raises(UsageError):
        encode_read_events_response(1, 2**64, [], None)
