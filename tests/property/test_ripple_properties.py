"""Ripple codec properties: every type round-trips, integers take their shortest form, and
any split of a byte stream of envelopes yields the same envelopes, messages and events."""

from __future__ import annotations

import itertools
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ripple_strategies import (
    handshake_auths,
    handshakes,
    int64s,
    messages,
    names,
    nat0s,
    ocaml_ints,
    records,
    schemas,
    texts,
    typed_deltas,
    wire_deltas,
)

from headwater.protocols.ripple import (
    FLAG_HANDSHAKE_AUTH,
    OVERHEAD,
    Atom,
    ClientConnection,
    DeltaReceived,
    Envelope,
    EnvelopeDecoder,
    FieldType,
    Handshake,
    HandshakeAuth,
    HandshakeReceived,
    Heartbeat,
    Message,
    MessageReceived,
    Schema,
    SequenceTracker,
    ServerConnection,
    apply,
    decode_delta,
    decode_envelope,
    decode_message,
    decode_payload,
    decode_record,
    encode_delta,
    encode_envelope,
    encode_message,
    encode_payload,
    encode_record,
    fingerprint,
    flags_of,
    text_of_value,
    value_of_sexp,
)
from headwater.protocols.ripple import bin_prot as bp
from headwater.protocols.ripple.envelope import crc32c

pytestmark = pytest.mark.timeout(120)

PROPS = settings(max_examples=120, deadline=None)
FEW = settings(max_examples=40, deadline=None)


def _compact_size(n: int) -> int:
    """Bytes the shortest bin_prot int form of ``n`` takes (the module docstring's table)."""
    if 0 <= n <= 0x7F:
        return 1
    if -0x80 <= n < 0:
        return 2
    if -0x8000 <= n <= 0x7FFF:
        return 3
    if -(2**31) <= n < 2**31:
        return 5
    return 9


# --- bin_prot primitives ---------------------------------------------------------------


@PROPS
@given(ocaml_ints)
def test_int_round_trips_in_its_shortest_form(n: int) -> None:
    data = bp.INT.encode(n)
    assert bp.INT.decode(data) == n
    assert len(data) == _compact_size(n)
    # Int64.t uses the very same scheme
    assert bp.INT64.encode(n) == data


@PROPS
@given(int64s)
def test_int64_round_trips(n: int) -> None:
    data = bp.INT64.encode(n)
    assert bp.INT64.decode(data) == n
    assert len(data) == _compact_size(n)


@PROPS
@given(nat0s)
def test_nat0_round_trips(n: int) -> None:
    data = bp.NAT0.encode(n)
    assert bp.NAT0.decode(data) == n
    assert len(data) == (1 if n < 0x80 else 3 if n < 0x1_0000 else 5 if n < 2**32 else 9)


@PROPS
@given(st.floats())
def test_float_round_trips_bit_for_bit(x: float) -> None:
    data = bp.FLOAT.encode(x)
    assert data == struct.pack("<d", x)
    assert struct.pack("<d", bp.FLOAT.decode(data)) == data


@PROPS
@given(st.text(), st.binary(), st.booleans())
def test_strings_bytes_and_bools_round_trip(text: str, blob: bytes, flag: bool) -> None:
    assert bp.STRING.decode(bp.STRING.encode(text)) == text
    assert bp.BYTES.decode(bp.BYTES.encode(blob)) == blob
    assert bp.BYTES.encode(blob) == bp.NAT0.encode(len(blob)) + blob
    assert bp.BOOL.decode(bp.BOOL.encode(flag)) is flag


@PROPS
@given(st.lists(st.tuples(texts, st.none() | ocaml_ints), max_size=6))
def test_composites_round_trip(items: list[tuple[str, int | None]]) -> None:
    codec = bp.list_of(bp.pair(bp.STRING, bp.option(bp.INT)))
    value = tuple(items)
    assert codec.decode(codec.encode(value)) == value


# --- records, deltas and messages ------------------------------------------------------


@st.composite
def schema_and_record(draw: st.DrawFn) -> tuple[Schema, dict]:
    schema = draw(schemas())
    return schema, draw(records(schema))


def _same_record(a: dict, b: dict) -> bool:
    if list(a) != list(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, float) and math.isnan(x):
            if not (isinstance(y, float) and math.isnan(y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


@PROPS
@given(schema_and_record())
def test_records_round_trip(case: tuple[Schema, dict]) -> None:
    schema, values = case
    decoded = decode_record(schema, encode_record(schema, values))
    assert _same_record(decoded, values)


@st.composite
def schema_and_delta(draw: st.DrawFn) -> tuple[Schema, object]:
    schema = draw(schemas())
    return schema, draw(wire_deltas(schema))


@PROPS
@given(schema_and_delta())
def test_deltas_round_trip(case: tuple[Schema, object]) -> None:
    schema, delta = case
    data = encode_delta(schema, delta)  # type: ignore[arg-type]
    again = decode_delta(schema, data)
    assert encode_delta(schema, again) == data  # NaN-proof equality: same bytes


@PROPS
@given(messages)
def test_message_payloads_round_trip(message: Message) -> None:
    payload = encode_payload(message)
    assert decode_payload(type_of(message), payload, flags_of(message)) == message


def type_of(message: Message) -> int:
    from headwater.protocols.ripple.messages import message_type_of

    return int(message_type_of(message))


@PROPS
@given(messages, st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1))
def test_enveloped_messages_round_trip(message: Message, sequence: int, ts: int) -> None:
    fp = fingerprint("out", 1) if type_of(message) == 1 else None
    data = encode_message(message, sequence=sequence, timestamp_ns=ts, fingerprint=fp)
    envelope = decode_envelope(data)
    assert (envelope.sequence, envelope.timestamp_ns) == (sequence, ts)
    assert len(data) == OVERHEAD + len(envelope.payload)
    assert decode_message(envelope) == message


@PROPS
@given(handshakes(), handshake_auths)
def test_the_auth_extension_follows_the_contracts_handshake(
    handshake: Handshake, auth: HandshakeAuth
) -> None:
    """With the extension, the payload is the contract's handshake record unchanged, then
    the handshake_auth record, under FLAG_HANDSHAKE_AUTH; the server's codec gives both
    back. Without it, the envelope is exactly the contract's (flags 0)."""
    plain = Handshake(handshake.source_worker_id, handshake.output_schemas, 1)
    extended = Handshake(plain.source_worker_id, plain.output_schemas, 1, auth)
    contract = encode_message(plain, sequence=1)
    data = encode_message(extended, sequence=1)
    envelope, contract_envelope = decode_envelope(data), decode_envelope(contract)
    assert (envelope.flags, contract_envelope.flags) == (FLAG_HANDSHAKE_AUTH, 0)
    assert envelope.payload.startswith(contract_envelope.payload)
    assert decode_message(contract_envelope) == plain
    events = ServerConnection().receive_data(data)
    assert len(events) == 1 and isinstance(events[0], HandshakeReceived)
    assert events[0].handshake == extended and events[0].handshake.auth == auth
    # The token is never in a log line: the extension's repr leaves it out.
    assert repr(events[0].handshake.auth) == f"HandshakeAuth(tenant={auth.tenant!r})"


@PROPS
@given(
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(-(2**63), 2**63 - 1),
    st.binary(min_size=32, max_size=32),
    st.binary(max_size=64),
)
def test_envelopes_round_trip(kind: int, flags: int, seq: int, fp: bytes, payload: bytes) -> None:
    envelope = Envelope(kind, seq, -seq - 1, fp, payload, flags)
    data = envelope.encode()
    assert len(data) == OVERHEAD + len(payload)
    assert int.from_bytes(data[-4:], "little") == crc32c(data[:-4])
    assert decode_envelope(data) == envelope


@PROPS
@given(st.sampled_from(list(FieldType)), st.data())
def test_field_text_forms_round_trip(field_type: FieldType, data: st.DataObject) -> None:
    from ripple_strategies import field_values

    value = data.draw(field_values(field_type))
    parsed = value_of_sexp(field_type, Atom(text_of_value(field_type, value)))
    if isinstance(value, float) and math.isnan(value):
        assert isinstance(parsed, float) and math.isnan(parsed)
    else:
        assert type(parsed) is type(value) and parsed == value


@PROPS
@given(st.from_regex(r"[A-Za-z0-9_]{1,24}", fullmatch=True), st.integers(0, 10**6))
def test_fingerprints_are_32_bytes_of_name_slash_v_version(name: str, version: int) -> None:
    text = f"{name}/v{version}".encode()
    if len(text) > 32:
        return
    fp = fingerprint(name, version)
    assert len(fp) == 32 and fp.rstrip(b"\x00") == text


# --- streams -------------------------------------------------------------------------


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@PROPS
@given(st.lists(messages, min_size=1, max_size=6), st.lists(st.integers(0, 10**6), max_size=12))
def test_any_split_of_a_stream_gives_the_same_envelopes(
    batch: list[Message], cuts: list[int]
) -> None:
    wire = b"".join(
        encode_message(m, sequence=i, fingerprint=fingerprint("o", 1) if type_of(m) == 1 else None)
        for i, m in enumerate(batch)
    )
    decoder = EnvelopeDecoder()
    got: list[Envelope] = []
    for chunk in _split(wire, cuts):
        decoder.feed(chunk)
        got.extend(decoder)
    assert decoder.at_boundary
    assert [decode_message(e) for e in got] == batch
    assert [e.sequence for e in got] == list(range(len(batch)))


@st.composite
def worker_sessions(draw: st.DrawFn) -> tuple[list[bytes], Schema]:
    """The byte chunks a worker sends: Handshake, then deltas and heartbeats."""
    schema = draw(schemas(max_fields=3))
    client = ClientConnection(draw(names))
    chunks = [client.handshake({"out": schema})]
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            delta = draw(typed_deltas(schema).filter(lambda d: _encodable(schema, d)))
            chunks.append(client.send_delta("out", draw(texts), delta))
        else:
            chunks.append(client.heartbeat(draw(int64s), draw(st.floats(0, 1))))
    return chunks, schema


def _encodable(schema: Schema, delta: object) -> bool:
    try:
        encode_delta(schema, delta)  # type: ignore[arg-type]
    except Exception:
        return False
    return True


@FEW
@given(worker_sessions(), st.lists(st.integers(0, 10**6), max_size=12))
def test_any_split_gives_the_same_server_events(
    session: tuple[list[bytes], Schema], cuts: list[int]
) -> None:
    chunks, schema = session
    wire = b"".join(chunks)
    whole = ServerConnection().receive_data(wire)
    split_conn = ServerConnection()
    pieces = []
    for chunk in _split(wire, cuts):
        pieces.extend(split_conn.receive_data(chunk))
    assert pieces == whole
    assert isinstance(whole[0], HandshakeReceived)
    assert all(isinstance(e, DeltaReceived | MessageReceived) for e in whole[1:])
    assert len(whole) == len(chunks)
    for event in whole:
        if isinstance(event, DeltaReceived):
            assert event.schema == schema
        if isinstance(event, MessageReceived):
            assert isinstance(event.message, Heartbeat)


@FEW
@given(st.data())
def test_client_deltas_reach_the_server_and_apply(data: st.DataObject) -> None:
    schema = data.draw(schemas(max_fields=4))
    client = ClientConnection("w")
    server = ServerConnection()
    (hello,) = server.receive_data(client.handshake([("out", schema)]))
    assert isinstance(hello, HandshakeReceived)
    client.receive_data(server.accept_handshake())
    assert client.negotiated is True
    sent_state: dict | None = None
    received_state: dict | None = None
    for seq in range(1, data.draw(st.integers(1, 4)) + 1):
        delta = data.draw(typed_deltas(schema).filter(lambda d: _encodable(schema, d)))
        (event,) = server.receive_data(client.send_delta("out", b"k", delta))
        assert isinstance(event, DeltaReceived)
        assert event.message.sequence_no == seq
        sent_state = apply(delta, sent_state, schema)
        received_state = apply(event.delta, received_state, schema)
        assert received_state == sent_state  # the strategies draw no NaN


@PROPS
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 20)), max_size=30))
def test_sequence_tracker_applies_each_number_once_in_increasing_order(
    observed: list[tuple[str, int]],
) -> None:
    tracker = SequenceTracker()
    applied: dict[str, list[int]] = {"a": [], "b": []}
    for source, seq in observed:
        if tracker.observe(source, seq).apply:
            applied[source].append(seq)
    for seqs in applied.values():
        assert seqs == sorted(set(seqs))


def test_encode_envelope_is_what_the_header_says() -> None:
    data = encode_envelope(4, b"xyz", sequence=7, timestamp_ns=9)
    assert data[:4] == b"RIPP" and data[4] == 1 and data[5] == 4 and data[6] == 0
    assert struct.unpack_from("<qq", data, 7) == (7, 9)
    assert struct.unpack_from("<i", data, 55) == (3,)
