"""Ripple decoders against hostile input: random bytes and mutated valid envelopes.

The only acceptable outcomes are a decoded value or a documented ProtocolError subclass
(EnvelopeError, DecodeError and their subclasses, PatchError); the server connection
never raises at all; huge lengths and counts never allocate; deep nesting never recurses
past its bound.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mutations import mutated as mutated_bytes
from ripple_strategies import messages, schemas, wire_deltas

from headwater.errors import ProtocolError
from headwater.protocols.ripple import (
    HEADER_SIZE,
    ZERO_FINGERPRINT,
    ClientConnection,
    Close,
    DecodeError,
    DeltaReceived,
    Envelope,
    EnvelopeDecoder,
    EnvelopeError,
    Field,
    FieldType,
    Handshake,
    HandshakeReceived,
    MessageReceived,
    MessageType,
    PatchError,
    PayloadLengthError,
    Reject,
    Schema,
    ServerConnection,
    apply,
    decode_delta,
    decode_envelope,
    decode_message,
    decode_payload,
    encode_delta,
    encode_envelope,
    encode_message,
    encode_payload,
    fingerprint,
)
from headwater.protocols.ripple import bin_prot as bp

pytestmark = pytest.mark.timeout(120)  # a hang fails instead of stalling the suite

FUZZ = settings(max_examples=200, deadline=None)
SCHEMA = Schema(
    "vwap",
    2,
    (
        Field("symbol", FieldType.STRING),
        Field("price", FieldType.FLOAT),
        Field("n", FieldType.INT),
        Field("t", FieldType.INT64),
        Field("ok", FieldType.BOOL),
    ),
)


# A bin_prot nat0/int of a huge value, or a huge int32 length.
HUGE_NUMBERS = [
    b"\xfc" + struct.pack("<Q", 2**62 - 1),
    b"\xfc" + struct.pack("<Q", 2**64 - 1),
    b"\xfd\xff\xff\xff\x7f",
    struct.pack("<i", 2**31 - 1),
    struct.pack("<i", -1),
]


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    return mutated_bytes(valid, HUGE_NUMBERS)


def _payload_or_decode_error(kind: int, payload: bytes) -> None:
    try:
        message = decode_payload(kind, payload)
    except DecodeError:
        return
    # whatever decodes re-decodes to the same value (compared by its canonical encoding,
    # which also makes NaN floats compare equal)
    canonical = encode_payload(message)
    again = encode_message(
        message, sequence=0, fingerprint=fingerprint("x", 1) if kind == 1 else None
    )
    assert encode_payload(decode_message(decode_envelope(again))) == canonical


@FUZZ
@given(st.integers(0, 6), st.binary(max_size=64))
def test_random_payloads_decode_or_raise_decode_error(kind: int, payload: bytes) -> None:
    _payload_or_decode_error(kind, payload)


@st.composite
def mutated_payloads(draw: st.DrawFn) -> tuple[int, bytes]:
    message = draw(messages)
    data = encode_message(
        message,
        sequence=1,
        fingerprint=fingerprint("x", 1) if type(message).__name__ == "DeltaMsg" else None,
    )
    envelope = decode_envelope(data)
    return envelope.message_type, draw(mutated(envelope.payload))


@FUZZ
@given(mutated_payloads())
def test_mutated_payloads_decode_or_raise_decode_error(case: tuple[int, bytes]) -> None:
    _payload_or_decode_error(*case)


@FUZZ
@given(st.binary(max_size=96))
def test_random_bytes_are_never_an_envelope(data: bytes) -> None:
    with pytest.raises(EnvelopeError):
        decode_envelope(data)


@FUZZ
@given(messages.flatmap(lambda m: mutated(_enveloped(m))))
def test_mutated_envelopes_fail_cleanly(data: bytes) -> None:
    try:
        envelope = decode_envelope(data)
    except EnvelopeError:
        return
    with contextlib.suppress(DecodeError):
        decode_message(envelope)


def _enveloped(message: object) -> bytes:
    fp = fingerprint("vwap", 2) if type(message).__name__ == "DeltaMsg" else None
    return encode_message(message, sequence=3, timestamp_ns=4, fingerprint=fp)  # type: ignore[arg-type]


@FUZZ
@given(st.binary(max_size=64))
def test_random_delta_bytes_decode_or_raise(data: bytes) -> None:
    try:
        delta = decode_delta(SCHEMA, data)
    except DecodeError:
        return
    with contextlib.suppress(PatchError):
        apply(delta, {}, SCHEMA)


@st.composite
def mutated_deltas(draw: st.DrawFn) -> tuple[Schema, bytes]:
    schema = draw(schemas(max_fields=3))
    return schema, draw(mutated(encode_delta(schema, draw(wire_deltas(schema)))))


@FUZZ
@given(mutated_deltas())
def test_mutated_deltas_decode_or_raise(case: tuple[Schema, bytes]) -> None:
    schema, data = case
    try:
        delta = decode_delta(schema, data)
    except DecodeError:
        return
    with contextlib.suppress(PatchError):
        apply(delta, None, schema)


# --- connections ---------------------------------------------------------------------


def _session_bytes() -> bytes:
    client = ClientConnection("w")
    parts = [client.handshake({"vwap": SCHEMA})]
    parts.append(
        client.send_delta(
            "vwap", "AAPL", encode_then_decode({"symbol": "A", "price": 1.5, "n": 1, "t": 2})
        )
    )
    parts.append(client.heartbeat(5, 0.25))
    parts.append(client.checkpoint_ack("c1", 1, 1))
    return b"".join(parts)


def encode_then_decode(values: dict) -> object:
    from headwater.protocols.ripple import Set

    return Set({**values, "ok": True})


SESSION = _session_bytes()


def _feed_server(data: bytes, cuts: list[int]) -> None:
    conn = ServerConnection()
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    events = []
    for a, b in itertools.pairwise(bounds):
        events.extend(conn.receive_data(data[a:b]))  # must never raise
    events.extend(conn.receive_eof())
    for i, event in enumerate(events):
        assert isinstance(
            event, HandshakeReceived | DeltaReceived | MessageReceived | Reject | Close
        )
        if isinstance(event, Reject | Close):
            assert i == len(events) - 1, "nothing may follow a Reject or Close"
        if isinstance(event, Reject):
            envelope = decode_envelope(event.data)
            assert envelope.message_type == MessageType.SCHEMA_NEGOTIATION
    assert conn.closed


@FUZZ
@given(mutated(SESSION), st.lists(st.integers(0, 10**6), max_size=6))
def test_server_never_raises_on_mutated_sessions(data: bytes, cuts: list[int]) -> None:
    _feed_server(data, cuts)


def _session_envelopes() -> list[Envelope]:
    decoder = EnvelopeDecoder()
    decoder.feed(SESSION)
    return list(decoder)


@st.composite
def recrc_sessions(draw: st.DrawFn) -> bytes:
    """The session with one envelope's payload (and maybe type, flags or fingerprint)
    mutated and a valid CRC recomputed: garbage the envelope layer cannot catch."""
    envelopes = _session_envelopes()
    i = draw(st.integers(0, len(envelopes) - 1))
    e = envelopes[i]
    kind = draw(st.sampled_from([e.message_type, e.message_type, 0, 1, 4, 6]))
    fp = draw(st.sampled_from([e.fingerprint, e.fingerprint, ZERO_FINGERPRINT, SCHEMA.fingerprint]))
    flags = draw(st.sampled_from([0, 0, 0, 1]))
    payload = draw(mutated(e.payload))
    rebuilt = encode_envelope(kind, payload, sequence=e.sequence, fingerprint=fp, flags=flags)
    return (
        b"".join(x.encode() for x in envelopes[:i])
        + rebuilt
        + b"".join(x.encode() for x in envelopes[i + 1 :])
    )


@FUZZ
@given(recrc_sessions(), st.lists(st.integers(0, 10**6), max_size=4))
def test_server_never_raises_on_payload_garbage_with_valid_crcs(
    data: bytes, cuts: list[int]
) -> None:
    _feed_server(data, cuts)


@FUZZ
@given(st.binary(max_size=200), st.lists(st.integers(0, 10**6), max_size=4))
def test_server_never_raises_on_random_bytes(data: bytes, cuts: list[int]) -> None:
    _feed_server(data, cuts)
    _feed_server(SESSION[:HEADER_SIZE] + data, cuts)


@FUZZ
@given(mutated(SESSION))
def test_client_raises_only_protocol_errors(data: bytes) -> None:
    client = ClientConnection("w")
    try:
        client.receive_data(data)
        client.receive_eof()
    except ProtocolError:
        pass


# --- bounds --------------------------------------------------------------------------


def test_huge_payload_length_is_refused_from_the_header() -> None:
    header = bytearray(encode_envelope(4, b"", sequence=1))[:HEADER_SIZE]
    struct.pack_into("<i", header, 55, 2**31 - 1)
    decoder = EnvelopeDecoder()
    tracemalloc.start()
    try:
        decoder.feed(bytes(header))
        with pytest.raises(PayloadLengthError):
            decoder.next_envelope()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert decoder.buffered_bytes == 0
    decoder.feed(b"x" * 1000)  # a dead decoder drops input
    assert decoder.buffered_bytes == 0


@pytest.mark.parametrize(
    "payload",
    [
        b"\xfc" + struct.pack("<Q", 2**62 - 1),  # string of 2**62-1 bytes
        b"\xfd\xff\xff\xff\xff",  # string of 4 GiB
        b"\x01\x02w1\xfc" + struct.pack("<Q", 2**62 - 1),  # output list of 2**62-1 items
    ],
)
def test_huge_lengths_and_counts_never_allocate(payload: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode_payload(MessageType.HANDSHAKE, payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_deep_sexp_nesting_is_bounded() -> None:
    # Patch [Field_set {field_name = "a"; value = List [List [List ...]]}], 10,000 deep
    deep = b"\x01\x01\x00\x01a" + b"\x01\x01" * 10_000 + b"\x00\x00"
    with pytest.raises(DecodeError, match="nested deeper"):
        decode_delta(SCHEMA, deep)
    shallow = b"\x01\x01\x00\x01a" + b"\x01\x01" * 10 + b"\x00\x00"
    decode_delta(SCHEMA, shallow)


def test_a_long_number_atom_is_refused_quickly() -> None:
    from headwater.protocols.ripple import Atom, value_of_sexp

    with pytest.raises(DecodeError):
        value_of_sexp(FieldType.FLOAT, Atom("1" * 1_000_000 + "x"))
    with pytest.raises(DecodeError):
        value_of_sexp(FieldType.INT, Atom("9" * 100_000))


def test_list_counts_are_checked_against_the_remaining_bytes() -> None:
    codec = bp.list_of(bp.FLOAT)  # 8 bytes per item at least
    with pytest.raises(DecodeError, match="cannot fit"):
        codec.decode(b"\x02" + bytes(15))
    assert codec.decode(b"\x02" + bytes(16)) == (0.0, 0.0)


def test_schema_and_output_counts_are_bounded() -> None:
    from headwater.protocols.ripple import MAX_OUTPUTS, MAX_SCHEMA_FIELDS
    from headwater.protocols.ripple.messages import SCHEMA

    too_many_fields = (
        b"\x01s\x01"
        + bp.NAT0.encode(MAX_SCHEMA_FIELDS + 1)
        + b"\x01a\x00" * (MAX_SCHEMA_FIELDS + 1)
        + b"\x00"
    )
    with pytest.raises(DecodeError, match="at most 1024"):
        SCHEMA.decode(too_many_fields)
    outputs = (
        b"\x01w"
        + bp.NAT0.encode(MAX_OUTPUTS + 1)
        + b"\x01o\x01s\x01\x00\x00" * (MAX_OUTPUTS + 1)
        + b"\x01"
    )
    with pytest.raises(DecodeError, match="at most 1024"):
        decode_payload(MessageType.HANDSHAKE, outputs)


def test_a_handshake_full_of_duplicate_fields_is_judged_in_linear_time() -> None:
    # 1024 fields all named "a": a quadratic duplicate check would still be quick here,
    # so also check the verdict itself
    schema = Schema("s", 1, (Field("a", FieldType.INT),) * 1024)
    handshake = encode_message(Handshake("w", (("o", schema),)), sequence=1)
    (event,) = ServerConnection().receive_data(handshake)
    assert isinstance(event, Reject) and "'a' is declared twice" in event.reason
