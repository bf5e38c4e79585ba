"""Byte-exact Ripple vectors (spec/PROTOCOLS.md §4, seed 003, docs/protocols/ripple.md).

The seed gives the envelope layout and its 63-byte overhead but no hex examples, so the
envelope vectors below are written by hand from the layout (their CRC-32C trailers are
cross-checked against an independent bitwise CRC-32C). The bin_prot vectors are derived
by hand from Jane Street's bin_prot format (write.ml / read.ml), as summarised in the
docstring of headwater.protocols.ripple.bin_prot.
"""

from __future__ import annotations

import struct

import pytest

from headwater.errors import ProtocolError, UsageError
from headwater.protocols.ripple import (
    FINGERPRINT_SIZE,
    FLAG_HANDSHAKE_AUTH,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    OVERHEAD,
    ZERO_FINGERPRINT,
    Atom,
    BadMagicError,
    CheckpointAck,
    CheckpointRequest,
    ClientConnection,
    Close,
    CrcMismatchError,
    DecodeError,
    DeltaMsg,
    DeltaReceived,
    Envelope,
    EnvelopeDecoder,
    EnvelopeError,
    Field,
    FieldRemove,
    FieldSet,
    FieldType,
    Handshake,
    HandshakeAuth,
    HandshakeReceived,
    Heartbeat,
    MapRemove,
    MapSet,
    MessageReceived,
    MessageType,
    Patch,
    PayloadLengthError,
    Reject,
    Remove,
    Schema,
    SchemaNegotiation,
    SequenceTracker,
    ServerConnection,
    Set,
    SexpList,
    TrailingBytesError,
    TruncatedEnvelopeError,
    UnknownMessageTypeError,
    UnsupportedFlagsError,
    UnsupportedVersionError,
    check_backward,
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
)
from headwater.protocols.ripple import bin_prot as bp
from headwater.protocols.ripple.envelope import crc32c


def h(text: str) -> bytes:
    return bytes.fromhex(text)


def crc32c_reference(data: bytes) -> int:
    """Bitwise CRC-32C: reflected polynomial 0x82F63B78 (0x1EDC6F41), init/xorout ~0."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


# --- envelope ------------------------------------------------------------------------

ZEROS32 = "00" * 32
HEARTBEAT = Heartbeat(worker_id="w1", timestamp_ns=1000, load=0.5)
HEARTBEAT_PAYLOAD = "02 7731" + " fe e803" + " 000000000000e03f"
HEARTBEAT_ENVELOPE = h(
    "52 49 50 50"  # magic "RIPP"
    " 01"  # version
    " 04"  # type Heartbeat
    " 00"  # flags
    " 01 00 00 00 00 00 00 00"  # sequence 1
    " e8 03 00 00 00 00 00 00"  # timestamp 1000 ns
    f" {ZEROS32}"  # fingerprint: zeros for every message but Delta
    " 0e 00 00 00"  # payload length 14
    f" {HEARTBEAT_PAYLOAD}"
    " 77 0d 85 63"  # CRC-32C of the 73 bytes before it, LE
)
VWAP_FP = "76 77 61 70 2f 76 32" + " 00" * 25  # "vwap/v2" zero-padded
DELTA_ENVELOPE = h(
    "52 49 50 50 01 01 00"  # magic, version 1, type Delta, flags 0
    " 02 00 00 00 00 00 00 00"  # sequence 2
    " 00 00 00 00 00 00 00 00"  # timestamp 0
    f" {VWAP_FP}"
    " 17 00 00 00"  # payload length 23
    " 04 76776170"  # source_output "vwap"
    " 04 4141504c"  # key "AAPL"
    " 01 02"  # delta_bytes: 1 byte, Remove (constructor 2)
    " 2a"  # sequence_no 42
    " 01 fc 00 00 00 80 00 00 00 00"  # watermark_ns Some 2**31 (int64 form)
    " c6 0f 4e 28"  # CRC-32C
)


def test_layout_constants() -> None:
    assert OVERHEAD == 63  # the seed's "total overhead per message: 63 bytes"
    assert HEADER_SIZE == 59
    assert FINGERPRINT_SIZE == 32
    assert MAGIC == b"RIPP" == h("52 49 50 50")
    assert MAX_PAYLOAD == 16 * 1024 * 1024


def test_crc32c_is_castagnoli() -> None:
    assert crc32c(b"123456789") == 0xE3069283 == crc32c_reference(b"123456789")


def test_empty_payload_envelope_is_exactly_the_overhead() -> None:
    data = encode_envelope(MessageType.HANDSHAKE, b"", sequence=0)
    assert len(data) == 63
    assert data[:59] == h("52495050 01 00 00" + "00" * 8 + "00" * 8 + ZEROS32 + "00000000")
    assert data[59:] == struct.pack("<I", crc32c_reference(data[:59]))


def test_heartbeat_envelope_vector() -> None:
    assert len(HEARTBEAT_ENVELOPE) == OVERHEAD + 14
    assert int.from_bytes(HEARTBEAT_ENVELOPE[-4:], "little") == crc32c_reference(
        HEARTBEAT_ENVELOPE[:-4]
    )
    assert encode_message(HEARTBEAT, sequence=1, timestamp_ns=1000) == HEARTBEAT_ENVELOPE
    envelope = decode_envelope(HEARTBEAT_ENVELOPE)
    assert envelope == Envelope(
        MessageType.HEARTBEAT, 1, 1000, ZERO_FINGERPRINT, h(HEARTBEAT_PAYLOAD), 0, 1
    )
    assert decode_message(envelope) == HEARTBEAT


def test_delta_envelope_vector() -> None:
    assert int.from_bytes(DELTA_ENVELOPE[-4:], "little") == crc32c_reference(DELTA_ENVELOPE[:-4])
    message = DeltaMsg("vwap", b"AAPL", b"\x02", 42, 2**31)
    assert encode_message(message, sequence=2, fingerprint=fingerprint("vwap", 2)) == DELTA_ENVELOPE
    envelope = decode_envelope(DELTA_ENVELOPE)
    assert envelope.fingerprint == h(VWAP_FP)
    assert decode_message(envelope) == message


@pytest.mark.parametrize("vector", [HEARTBEAT_ENVELOPE, DELTA_ENVELOPE])
def test_every_single_bit_flip_is_caught(vector: bytes) -> None:
    for bit in range(len(vector) * 8):
        corrupt = bytearray(vector)
        corrupt[bit // 8] ^= 1 << (bit % 8)
        # The CRC alone detects every single-bit error...
        assert crc32c(corrupt[:-4]) != int.from_bytes(corrupt[-4:], "little"), bit
        # ...and the decoder refuses the envelope before any payload decoding.
        with pytest.raises(EnvelopeError) as caught:
            decode_envelope(bytes(corrupt))
        offset = bit // 8
        if offset < 4:
            assert isinstance(caught.value, BadMagicError)
        elif offset == 4:
            assert isinstance(caught.value, UnsupportedVersionError)
        elif 55 <= offset < 59:  # payload length: too big, too short, or negative
            assert isinstance(
                caught.value, PayloadLengthError | TruncatedEnvelopeError | CrcMismatchError
            )
        else:
            assert isinstance(caught.value, CrcMismatchError), bit


def test_envelope_errors_in_check_order() -> None:
    good = bytearray(HEARTBEAT_ENVELOPE)
    bad_magic = b"RIPQ" + bytes(good[4:])
    with pytest.raises(BadMagicError):
        decode_envelope(bad_magic)
    v2 = encode_envelope(4, h(HEARTBEAT_PAYLOAD), sequence=1, version=2)
    with pytest.raises(UnsupportedVersionError) as exc:
        decode_envelope(v2)
    assert exc.value.version == 2
    for length in (-1, MAX_PAYLOAD + 1, 2**31 - 1):
        header = bytearray(good[:HEADER_SIZE])
        struct.pack_into("<i", header, 55, length)
        with pytest.raises(PayloadLengthError):
            decode_envelope(bytes(header))  # refused from the header alone
    with pytest.raises(TruncatedEnvelopeError):
        decode_envelope(HEARTBEAT_ENVELOPE[:-1])
    with pytest.raises(TrailingBytesError):
        decode_envelope(HEARTBEAT_ENVELOPE + b"R")
    good[-1] ^= 0xFF
    with pytest.raises(CrcMismatchError):
        decode_envelope(bytes(good))


def test_header_fields_are_checked_as_they_arrive() -> None:
    decoder = EnvelopeDecoder()
    decoder.feed(b"RI")
    assert decoder.next_envelope() is None
    decoder.feed(b"Px")
    with pytest.raises(BadMagicError):
        decoder.next_envelope()
    decoder = EnvelopeDecoder()
    decoder.feed(b"RIPP\x07")
    with pytest.raises(UnsupportedVersionError):
        decoder.next_envelope()
    decoder = EnvelopeDecoder(max_payload=10)
    decoder.feed(HEARTBEAT_ENVELOPE[:HEADER_SIZE])
    with pytest.raises(PayloadLengthError):  # 14 > 10, known before the payload arrives
        decoder.next_envelope()


def test_decoder_yields_envelopes_byte_by_byte() -> None:
    decoder = EnvelopeDecoder()
    got = []
    for byte in HEARTBEAT_ENVELOPE + DELTA_ENVELOPE:
        decoder.feed(bytes([byte]))
        got.extend(decoder)
    assert [e.sequence for e in got] == [1, 2]
    assert decoder.at_boundary
    decoder.feed(HEARTBEAT_ENVELOPE[:10])
    with pytest.raises(TruncatedEnvelopeError):
        decoder.finish()


def test_unknown_type_and_flags_are_refused_by_the_message_layer() -> None:
    unknown = decode_envelope(encode_envelope(6, b"", sequence=1))
    with pytest.raises(UnknownMessageTypeError):
        decode_message(unknown)
    flagged = decode_envelope(encode_envelope(4, h(HEARTBEAT_PAYLOAD), sequence=1, flags=1))
    with pytest.raises(UnsupportedFlagsError):
        decode_message(flagged)


def test_envelope_encoder_refuses_what_the_wire_cannot_carry() -> None:
    with pytest.raises(UsageError):
        encode_envelope(4, b"", sequence=2**63)
    with pytest.raises(UsageError):
        encode_envelope(256, b"", sequence=0)
    with pytest.raises(UsageError):
        encode_envelope(4, b"", sequence=0, fingerprint=b"short")
    with pytest.raises(UsageError):
        encode_message(DeltaMsg("o", b"", b"\x02", 1), sequence=1)  # Delta needs a fingerprint
    with pytest.raises(UsageError):
        encode_message(HEARTBEAT, sequence=1, fingerprint=fingerprint("vwap", 2))


# --- fingerprints --------------------------------------------------------------------


def test_fingerprints() -> None:
    assert fingerprint("vwap", 2) == h(VWAP_FP)
    assert fingerprint("a" * 28, 10) == b"a" * 28 + b"/v10"  # exactly 32: no padding
    with pytest.raises(UsageError):
        fingerprint("a" * 29, 10)  # 33 bytes
    for name, version in (("", 1), ("a\x00b", 1), ("vwap", -1)):
        with pytest.raises(UsageError):
            fingerprint(name, version)
    schema = Schema("vwap", 2, ())
    assert schema.fingerprint == h(VWAP_FP)


# --- bin_prot ------------------------------------------------------------------------

INT_VECTORS = [
    (0, "00"),
    (1, "01"),
    (127, "7f"),
    (128, "fe 80 00"),
    (255, "fe ff 00"),
    (256, "fe 00 01"),
    (32767, "fe ff 7f"),
    (32768, "fd 00 80 00 00"),
    (65536, "fd 00 00 01 00"),
    (2**31 - 1, "fd ff ff ff 7f"),
    (2**31, "fc 00 00 00 80 00 00 00 00"),
    (-1, "ff ff"),
    (-128, "ff 80"),
    (-129, "fe 7f ff"),
    (-32768, "fe 00 80"),
    (-32769, "fd ff 7f ff ff"),
    (-(2**31), "fd 00 00 00 80"),
    (-(2**31) - 1, "fc ff ff ff 7f ff ff ff ff"),
    (2**62 - 1, "fc ff ff ff ff ff ff ff 3f"),
    (-(2**62), "fc 00 00 00 00 00 00 00 c0"),
]


@pytest.mark.parametrize(("value", "wire"), INT_VECTORS)
def test_int_vectors(value: int, wire: str) -> None:
    assert bp.INT.encode(value) == h(wire)
    assert bp.INT.decode(h(wire)) == value
    assert bp.INT64.encode(value) == h(wire)  # Int64.t: the same compact scheme


@pytest.mark.parametrize(
    ("value", "wire"),
    [
        (1000, "fe e8 03"),
        (2**63 - 1, "fc ff ff ff ff ff ff ff 7f"),
        (-(2**63), "fc 00 00 00 00 00 00 00 80"),
        (2**62, "fc 00 00 00 00 00 00 00 40"),
    ],
)
def test_int64_vectors(value: int, wire: str) -> None:
    assert bp.INT64.encode(value) == h(wire)
    assert bp.INT64.decode(h(wire)) == value


@pytest.mark.parametrize(
    ("value", "wire"),
    [
        (0, "00"),
        (127, "7f"),
        (128, "fe 80 00"),
        (40000, "fe 40 9c"),  # unsigned 16 bits (the int form would need fd)
        (65535, "fe ff ff"),
        (65536, "fd 00 00 01 00"),
        (2**32 - 1, "fd ff ff ff ff"),
        (2**32, "fc 00 00 00 00 01 00 00 00"),
    ],
)
def test_nat0_vectors(value: int, wire: str) -> None:
    assert bp.NAT0.encode(value) == h(wire)
    assert bp.NAT0.decode(h(wire)) == value


@pytest.mark.parametrize(
    ("codec", "wire", "value"),
    [
        (bp.INT, "fe 05 00", 5),  # wider than needed: accepted, as bin_prot's reader does
        (bp.INT, "fd 80 00 00 00", 128),
        (bp.INT, "fc ff ff ff ff ff ff ff ff", -1),
        (bp.NAT0, "fd 05 00 00 00", 5),
        (bp.INT64, "fe ff ff", -1),
    ],
)
def test_non_canonical_integer_forms_are_accepted(
    codec: bp.Codec[int], wire: str, value: int
) -> None:
    assert codec.decode(h(wire)) == value


@pytest.mark.parametrize(
    ("codec", "wire"),
    [
        (bp.INT, "ff 05"),  # the ff form must be negative (bin_prot's Neg_int8)
        (bp.INT, "80"),  # 80..fb start no integer
        (bp.INT, "fb"),
        (bp.INT, "fc 00 00 00 00 00 00 00 40"),  # 2**62: not an OCaml int
        (bp.INT, "fe 00"),  # truncated
        (bp.NAT0, "ff 01"),  # ff never starts a nat0
        (bp.NAT0, "fc 00 00 00 00 00 00 00 40"),  # above 2**62-1
        (bp.NAT0, ""),
        (bp.INT64, "fd 00 00"),
        (bp.BOOL, "02"),
        (bp.option(bp.INT), "02 00"),
        (bp.STRING, "05 61 62"),  # length beyond the input
        (bp.STRING, "01 ff"),  # not UTF-8
        (bp.FLOAT, "00 00 00"),
        (bp.INT, "01 02"),  # trailing byte
    ],
)
def test_malformed_values(codec: bp.Codec[object], wire: str) -> None:
    with pytest.raises(DecodeError):
        codec.decode(h(wire))


def test_float_vectors() -> None:
    for value, wire in [
        (0.0, "00 00 00 00 00 00 00 00"),
        (-0.0, "00 00 00 00 00 00 00 80"),
        (1.0, "00 00 00 00 00 00 f0 3f"),
        (0.5, "00 00 00 00 00 00 e0 3f"),
        (-2.0, "00 00 00 00 00 00 00 c0"),
        (150.5, "00 00 00 00 00 d0 62 40"),
        (float("inf"), "00 00 00 00 00 00 f0 7f"),
    ]:
        assert bp.FLOAT.encode(value) == h(wire)
        assert bp.FLOAT.decode(h(wire)) == value


def test_string_option_list_pair_and_variant_vectors() -> None:
    assert bp.STRING.encode("") == h("00")
    assert bp.STRING.encode("AAPL") == h("04 41 41 50 4c")
    assert bp.STRING.encode("é") == h("02 c3 a9")
    assert bp.STRING.encode("a" * 128) == h("fe 80 00") + b"a" * 128
    assert bp.BYTES.encode(b"\xff\x00") == h("02 ff 00")
    assert bp.BOOL.encode(False) == h("00") and bp.BOOL.encode(True) == h("01")
    assert bp.option(bp.INT).encode(None) == h("00")
    assert bp.option(bp.INT).encode(5) == h("01 05")
    assert bp.option(bp.INT).encode(-1) == h("01 ff ff")
    assert bp.list_of(bp.INT).encode(()) == h("00")
    assert bp.list_of(bp.INT).encode((1, 2, 3)) == h("03 01 02 03")
    assert bp.list_of(bp.INT).encode((128,)) == h("01 fe 80 00")
    assert bp.pair(bp.STRING, bp.INT).encode(("a", 1)) == h("01 61 01")
    from headwater.protocols.ripple.messages import FIELD_TYPE, SEXP

    assert [FIELD_TYPE.encode(t) for t in FieldType] == [h(f"0{i}") for i in range(5)]
    assert SEXP.encode(Atom("a")) == h("00 01 61")
    assert SEXP.encode(SexpList(())) == h("01 00")
    assert SEXP.encode(SexpList((Atom("a"), SexpList(())))) == h("01 02 00 01 61 01 00")
    with pytest.raises(DecodeError):
        FIELD_TYPE.decode(h("05"))


def test_encoders_refuse_out_of_range_values() -> None:
    for codec, value in [
        (bp.INT, 2**62),
        (bp.INT, -(2**62) - 1),
        (bp.INT64, 2**63),
        (bp.NAT0, -1),
        (bp.INT, "1"),
        (bp.BOOL, 1),
    ]:
        with pytest.raises(UsageError):
            codec.encode(value)  # type: ignore[arg-type]


def test_record_declaration_must_match_the_dataclass() -> None:
    with pytest.raises(UsageError):
        bp.record(Heartbeat, ("worker_id", bp.STRING), ("load", bp.FLOAT))


# --- records and deltas --------------------------------------------------------------

VWAP = Schema(
    "vwap",
    2,
    (
        Field("symbol", FieldType.STRING),
        Field("price", FieldType.FLOAT),
        Field("volume", FieldType.INT),
        Field("ts", FieldType.INT64),
        Field("live", FieldType.BOOL),
    ),
)
VWAP_RECORD = {"symbol": "AAPL", "price": 150.5, "volume": 128, "ts": -1, "live": True}
VWAP_RECORD_WIRE = "04 4141504c" + " 00000000 00d06240" + " fe 80 00" + " ff ff" + " 01"


def test_record_vector() -> None:
    assert encode_record(VWAP, VWAP_RECORD) == h(VWAP_RECORD_WIRE)
    assert decode_record(VWAP, h(VWAP_RECORD_WIRE)) == VWAP_RECORD


def test_record_encoding_checks_fields_and_types() -> None:
    for values in [
        {k: v for k, v in VWAP_RECORD.items() if k != "ts"},  # missing
        {**VWAP_RECORD, "extra": 1},  # unknown
        {**VWAP_RECORD, "volume": True},  # bool is not an Int
        {**VWAP_RECORD, "volume": 2**62},  # beyond OCaml's int
        {**VWAP_RECORD, "live": 1},
        {**VWAP_RECORD, "symbol": b"AAPL"},
    ]:
        with pytest.raises(UsageError):
            encode_record(VWAP, values)
    assert encode_record(VWAP, {**VWAP_RECORD, "price": 2}) == encode_record(
        VWAP, {**VWAP_RECORD, "price": 2.0}
    )  # an int is accepted as a Float


@pytest.mark.parametrize(
    ("delta", "wire"),
    [
        (Set(VWAP_RECORD), "00 " + VWAP_RECORD_WIRE),
        (Remove(), "02"),
        (Patch(()), "01 00"),
        (
            Patch((FieldSet("price", Atom("151.0")),)),
            "01 01 00 05 7072696365 00 05 3135312e30",
        ),
        (Patch((FieldRemove("volume"),)), "01 01 01 06 766f6c756d65"),
        (Patch((MapSet("x", SexpList((Atom("a"),))),)), "01 01 02 01 78 01 01 00 01 61"),
        (Patch((MapRemove("y"),)), "01 01 03 01 79"),
    ],
)
def test_delta_vectors(delta: object, wire: str) -> None:
    assert encode_delta(VWAP, delta) == h(wire)  # type: ignore[arg-type]
    assert decode_delta(VWAP, h(wire)) == delta


def test_malformed_deltas() -> None:
    for wire in ["03", "00 04 4141504c", "01 01 04 00", "01 02 02 01 79", "02 00"]:
        with pytest.raises(DecodeError):
            decode_delta(VWAP, h(wire))


# --- messages ------------------------------------------------------------------------

SCHEMA_PRICE = Schema("vwap", 2, (Field("price", FieldType.FLOAT),))
MESSAGE_VECTORS = [
    (
        Handshake("w1", (("vwap", SCHEMA_PRICE),), 1),
        "02 7731"  # source_worker_id
        " 01"  # one output
        " 04 76776170"  # output name
        " 04 76776170 02 01 05 7072696365 03 00"  # schema: name, version, fields, doc None
        " 01",  # protocol_version
    ),
    (
        Handshake("w1", (), 1),
        "02 7731 00 01",
    ),
    (
        Schema("s", 1, (), "d"),  # not a message, checked with the schema codec below
        "01 73 01 00 01 01 64",
    ),
    (SchemaNegotiation(True, ()), "01 00"),
    (
        SchemaNegotiation(False, ("missing field x",)),
        "00 01 0f 6d697373696e67206669656c642078",
    ),
    (DeltaMsg("vwap", b"AAPL", b"\x02", 42, None), "04 76776170 04 4141504c 01 02 2a 00"),
    (Heartbeat("w1", 1000, 0.5), HEARTBEAT_PAYLOAD),
    (CheckpointRequest("c1", 7), "02 6331 07"),
    (CheckpointAck("c1", "w1", 7, 300), "02 6331 02 7731 07 fe 2c 01"),
]


@pytest.mark.parametrize(("message", "wire"), MESSAGE_VECTORS)
def test_message_vectors(message: object, wire: str) -> None:
    if isinstance(message, Schema):
        from headwater.protocols.ripple.messages import SCHEMA

        assert SCHEMA.encode(message) == h(wire)
        assert SCHEMA.decode(h(wire)) == message
        return
    assert encode_payload(message) == h(wire)  # type: ignore[arg-type]
    kind = decode_envelope(encode_message(message, sequence=1, fingerprint=_fp(message)))
    assert decode_payload(kind.message_type, h(wire)) == message


def _fp(message: object) -> bytes | None:
    return fingerprint("vwap", 2) if isinstance(message, DeltaMsg) else None


# --- headwater's Handshake auth extension (docs/protocols/ripple.md) -------------------

AUTH_HANDSHAKE = Handshake("w1", (("vwap", SCHEMA_PRICE),), 1, HandshakeAuth("s3cret", 42))
AUTH_HANDSHAKE_ENVELOPE = h(
    "52 49 50 50 01 00"  # magic, version 1, type Handshake
    " 01"  # flags: FLAG_HANDSHAKE_AUTH
    " 01 00 00 00 00 00 00 00"  # sequence 1
    " 00 00 00 00 00 00 00 00"  # timestamp 0
    f" {ZEROS32}"  # fingerprint (not a Delta)
    " 23 00 00 00"  # payload length 35
    " 02 7731 01 04 76776170 04 76776170 02 01 05 7072696365 03 00 01"  # the contract's
    " 01 06 733363726574"  # token = Some "s3cret"
    " 01 2a"  # tenant = Some 42
    " 1d 9d ca af"  # CRC-32C
)


@pytest.mark.parametrize(
    ("auth", "wire"),
    [
        (HandshakeAuth("s3cret", 42), "01 06 733363726574 01 2a"),
        (HandshakeAuth("s3cret"), "01 06 733363726574 00"),
        (HandshakeAuth(None, 42), "00 01 2a"),
        (HandshakeAuth(), "00 00"),
    ],
)
def test_handshake_auth_vectors(auth: HandshakeAuth, wire: str) -> None:
    contract = h(MESSAGE_VECTORS[0][1])
    handshake = Handshake("w1", (("vwap", SCHEMA_PRICE),), 1, auth)
    assert encode_payload(handshake) == contract + h(wire)
    assert decode_payload(MessageType.HANDSHAKE, contract + h(wire), FLAG_HANDSHAKE_AUTH) == (
        handshake
    )


def test_handshake_auth_envelope_vector() -> None:
    assert FLAG_HANDSHAKE_AUTH == 0x01
    assert encode_message(AUTH_HANDSHAKE, sequence=1) == AUTH_HANDSHAKE_ENVELOPE
    data = AUTH_HANDSHAKE_ENVELOPE
    assert int.from_bytes(data[-4:], "little") == crc32c_reference(data[:-4])
    assert decode_message(decode_envelope(data)) == AUTH_HANDSHAKE
    client = ClientConnection("w1")
    assert client.handshake({"vwap": SCHEMA_PRICE}, auth=AUTH_HANDSHAKE.auth) == data
    (event,) = ServerConnection().receive_data(data)
    assert isinstance(event, HandshakeReceived) and event.handshake == AUTH_HANDSHAKE
    # Without a credential, a worker's Handshake is the contract's, flags 0.
    plain = ClientConnection("w1").handshake({"vwap": SCHEMA_PRICE})
    assert plain[6] == 0 and decode_envelope(plain).payload == h(MESSAGE_VECTORS[0][1])


@pytest.mark.parametrize(
    ("message_type", "flags", "payload", "reason"),
    [
        # the flag on any other message, and any other flag, are still refused
        (MessageType.HEARTBEAT, FLAG_HANDSHAKE_AUTH, h(HEARTBEAT_PAYLOAD), "flags 0x01"),
        (MessageType.HANDSHAKE, 0x02, h(MESSAGE_VECTORS[0][1]) + h("00 00"), "flags 0x02"),
        (MessageType.HANDSHAKE, 0x03, h(MESSAGE_VECTORS[0][1]) + h("00 00"), "flags 0x03"),
        # the flag promises an extension: missing, cut short or followed by more is an error
        (MessageType.HANDSHAKE, FLAG_HANDSHAKE_AUTH, h(MESSAGE_VECTORS[0][1]), "HandshakeAuth"),
        (
            MessageType.HANDSHAKE,
            FLAG_HANDSHAKE_AUTH,
            h(MESSAGE_VECTORS[0][1]) + h("01 06 73"),
            "token",
        ),
        (
            MessageType.HANDSHAKE,
            FLAG_HANDSHAKE_AUTH,
            h(MESSAGE_VECTORS[0][1]) + h("00 00 00"),
            "trailing bytes after handshake_auth",
        ),
        # an extension's bytes without the flag are the contract's trailing garbage
        (MessageType.HANDSHAKE, 0, h(MESSAGE_VECTORS[0][1]) + h("00 00"), "trailing"),
    ],
)
def test_the_auth_extension_is_refused_where_it_does_not_fit(
    message_type: MessageType, flags: int, payload: bytes, reason: str
) -> None:
    data = encode_envelope(message_type, payload, sequence=1, flags=flags)
    with pytest.raises(DecodeError, match=reason):
        decode_message(decode_envelope(data))
    server = ServerConnection()
    if message_type is not MessageType.HANDSHAKE:
        server.receive_data(encode_message(Handshake("w1", ()), sequence=1))
    (event,) = server.receive_data(data)
    assert isinstance(event, Reject) and server.closed


def test_message_type_numbers() -> None:
    assert [(t.name, int(t)) for t in MessageType] == [
        ("HANDSHAKE", 0),
        ("DELTA", 1),
        ("CHECKPOINT_REQUEST", 2),
        ("CHECKPOINT_ACK", 3),
        ("HEARTBEAT", 4),
        ("SCHEMA_NEGOTIATION", 5),
    ]


def test_schema_field_lookup() -> None:
    twice = Schema("s", 1, (Field("a", FieldType.INT), Field("a", FieldType.BOOL)))
    assert twice.field("a") == Field("a", FieldType.INT)  # the first declaration wins
    assert twice.field("b") is None
    assert twice == Schema("s", 1, (Field("a", FieldType.INT), Field("a", FieldType.BOOL)))


def test_check_backward() -> None:
    v2 = Schema("vwap", 2, (Field("price", FieldType.FLOAT),))
    v3 = Schema("vwap", 3, (Field("price", FieldType.FLOAT), Field("x", FieldType.INT)))
    assert check_backward(v2, v3) == []  # appending a field is fine
    assert check_backward(v3, v2) == ["missing field x"]
    changed = Schema("vwap", 3, (Field("price", FieldType.INT),))
    assert check_backward(v2, changed) == ["field price changed type from FLOAT to INT"]


# --- connections ---------------------------------------------------------------------


def _hello(schema: Schema = VWAP) -> tuple[ServerConnection, ClientConnection]:
    server, client = ServerConnection(), ClientConnection("w1")
    (event,) = server.receive_data(client.handshake({"vwap": schema}))
    assert isinstance(event, HandshakeReceived)
    assert event.handshake.output_schemas == (("vwap", schema),)
    return server, client


def _negotiation(data: bytes) -> SchemaNegotiation:
    message = decode_message(decode_envelope(data))
    assert isinstance(message, SchemaNegotiation)
    return message


def test_handshake_then_deltas() -> None:
    server, client = _hello()
    answer = server.accept_handshake()
    assert _negotiation(answer) == SchemaNegotiation(True, ())
    (_received,) = client.receive_data(answer)
    assert client.negotiated is True
    events = server.receive_data(
        client.send_delta("vwap", "AAPL", Set(VWAP_RECORD))
        + client.send_delta("vwap", "AAPL", Patch((FieldSet("price", Atom("151")),)))
        + client.heartbeat(7, 0.5)
        + client.checkpoint_ack("c1", 1, 2)
    )
    assert [type(e) for e in events] == [
        DeltaReceived,
        DeltaReceived,
        MessageReceived,
        MessageReceived,
    ]
    first, second = events[0], events[1]
    assert isinstance(first, DeltaReceived) and isinstance(second, DeltaReceived)
    assert first.delta == Set(VWAP_RECORD) and first.message.key == b"AAPL"
    assert [first.message.sequence_no, second.message.sequence_no] == [1, 2]
    assert first.envelope.fingerprint == VWAP.fingerprint
    assert [e.envelope.sequence for e in events] == [2, 3, 4, 5]  # 1 was the Handshake


def test_pipelined_deltas_are_checked_against_the_declared_schemas() -> None:
    client = ClientConnection("w1")
    data = client.handshake({"vwap": VWAP}) + client.send_delta("vwap", "k", Remove())
    server = ServerConnection()
    hello, delta = server.receive_data(data)
    assert isinstance(hello, HandshakeReceived) and isinstance(delta, DeltaReceived)


def test_anything_before_the_handshake_is_rejected() -> None:
    client = ClientConnection("w1")
    for message in [HEARTBEAT, CheckpointRequest("c", 1), SchemaNegotiation(True, ())]:
        server = ServerConnection()
        (event,) = server.receive_data(client.send(message))
        assert isinstance(event, Reject) and "Handshake must be the first message" in event.reason
        assert _negotiation(event.data).ok is False
        assert server.closed and server.receive_data(client.send(message)) == []
    server = ServerConnection()
    delta = encode_message(
        DeltaMsg("vwap", b"k", b"\x02", 1), sequence=1, fingerprint=VWAP.fingerprint
    )
    (event,) = server.receive_data(delta)
    assert isinstance(event, Reject) and "Handshake must be the first" in event.reason


def test_a_second_handshake_is_rejected() -> None:
    server, _client = _hello()
    (event,) = server.receive_data(encode_message(Handshake("w1", ()), sequence=9))
    assert isinstance(event, Reject)


@pytest.mark.parametrize(
    ("handshake", "reason"),
    [
        (Handshake("w", (), 2), "unsupported protocol_version 2"),
        (Handshake("w", (("o", VWAP), ("o", VWAP))), "declared twice"),
        (Handshake("w", (("o", Schema("x" * 40, 1, ())),)), "longer than 32 bytes"),
        (
            Handshake("w", (("o", Schema("s", 1, (Field("a", FieldType.INT),) * 2)),)),
            "declared twice",
        ),
    ],
)
def test_bad_handshakes_are_rejected(handshake: Handshake, reason: str) -> None:
    (event,) = ServerConnection().receive_data(encode_message(handshake, sequence=1))
    assert isinstance(event, Reject) and reason in event.reason


def test_reject_handshake_closes() -> None:
    server, client = _hello()
    answer = server.reject_handshake(["missing field x"])
    assert server.closed
    assert _negotiation(answer) == SchemaNegotiation(False, ("missing field x",))
    client.receive_data(answer)
    assert client.negotiated is False and client.errors == ("missing field x",)
    with pytest.raises(UsageError):
        client.send_delta("vwap", "k", Remove())


def test_a_foreign_fingerprint_is_refused_without_decoding_the_payload() -> None:
    server, _ = _hello()
    server.accept_handshake()
    garbage = encode_envelope(
        MessageType.DELTA, b"\xff" * 10, sequence=5, fingerprint=fingerprint("other", 1)
    )
    (event,) = server.receive_data(garbage)
    assert isinstance(event, Reject)
    assert "'other/v1' names no negotiated schema" in event.reason  # not a decode error


def test_a_fingerprint_must_match_the_deltas_own_output() -> None:
    other = Schema("other", 1, (Field("n", FieldType.INT),))
    server, client = ServerConnection(), ClientConnection("w1")
    server.receive_data(client.handshake({"vwap": VWAP, "counts": other}))
    # a Delta for "vwap" whose envelope carries the "counts" schema's fingerprint, with
    # delta_bytes that would not decode: the mismatch is found first
    message = DeltaMsg("vwap", b"k", b"\xff\xff", 1)
    data = encode_message(message, sequence=2, fingerprint=other.fingerprint)
    (event,) = server.receive_data(data)
    assert isinstance(event, Reject)
    assert "carries fingerprint 'other/v1', negotiated 'vwap/v2'" in event.reason


def test_undecodable_deltas_and_undeclared_outputs_are_rejected() -> None:
    for message, reason in [
        (DeltaMsg("vwap", b"k", b"\x07", 1), "undecodable delta_bytes"),
        (DeltaMsg("nope", b"k", b"\x02", 1), "undeclared output 'nope'"),
    ]:
        server, _ = _hello()
        data = encode_message(message, sequence=2, fingerprint=VWAP.fingerprint)
        (event,) = server.receive_data(data)
        assert isinstance(event, Reject) and reason in event.reason


def test_stream_level_failures() -> None:
    server, _ = _hello()
    (event,) = server.receive_data(b"XXXX")
    assert isinstance(event, Close) and "magic" in event.reason
    server, _ = _hello()
    corrupt = bytearray(HEARTBEAT_ENVELOPE)
    corrupt[60] ^= 1
    (event,) = server.receive_data(bytes(corrupt))
    assert isinstance(event, Close) and "CRC" in event.reason
    server, _ = _hello()
    assert server.receive_data(HEARTBEAT_ENVELOPE[:30]) == []
    (event,) = server.receive_eof()
    assert isinstance(event, Close)
    # Version and length problems are answered (the framing was still readable).
    server, _ = _hello()
    (event,) = server.receive_data(encode_envelope(4, b"", sequence=1, version=2))
    assert isinstance(event, Reject) and "version 2" in event.reason
    server, _ = _hello()
    header = bytearray(HEARTBEAT_ENVELOPE[:HEADER_SIZE])
    struct.pack_into("<i", header, 55, MAX_PAYLOAD + 1)
    (event,) = server.receive_data(bytes(header))
    assert isinstance(event, Reject) and server.buffered_bytes == 0


def test_flags_and_unknown_types_are_rejected_by_the_server() -> None:
    server, _ = _hello()
    (event,) = server.receive_data(encode_envelope(9, b"", sequence=2))
    assert isinstance(event, Reject) and "unknown message type 9" in event.reason
    server, _ = _hello()
    (event,) = server.receive_data(encode_envelope(4, h(HEARTBEAT_PAYLOAD), sequence=2, flags=4))
    assert isinstance(event, Reject) and "flags" in event.reason


def test_client_sequence_numbers_and_redelivery() -> None:
    client = ClientConnection("w1")
    client.handshake({"vwap": VWAP, "b": Schema("b", 1, ())})
    for expected in (1, 2, 3):
        message = decode_message(decode_envelope(client.send_delta("vwap", "k", Remove())))
        assert isinstance(message, DeltaMsg) and message.sequence_no == expected
    again = decode_message(decode_envelope(client.send_delta("vwap", "k", Remove(), sequence_no=2)))
    assert isinstance(again, DeltaMsg) and again.sequence_no == 2
    assert client.last_sequence_no("vwap") == 3 and client.last_sequence_no("b") == 0
    with pytest.raises(UsageError):
        client.send_delta("undeclared", "k", Remove())
    with pytest.raises(UsageError):
        ClientConnection("w").send_delta("vwap", "k", Remove())  # no Handshake yet


def test_client_raises_protocol_errors() -> None:
    client = ClientConnection("w1")
    with pytest.raises(ProtocolError):
        client.receive_data(b"NOPE")


def test_sequence_tracker() -> None:
    tracker = SequenceTracker()
    verdicts = [tracker.observe(("w1", "vwap"), n) for n in (42, 42, 41, 44, 45)]
    assert [(v.apply, v.missed) for v in verdicts] == [
        (True, 0),  # first seen: nothing known before it
        (False, 0),  # redelivery
        (False, 0),
        (True, 1),  # 43 was lost
        (True, 0),
    ]
    assert (tracker.duplicates, tracker.gaps, tracker.last(("w1", "vwap"))) == (2, 1, 45)
