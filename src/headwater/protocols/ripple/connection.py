"""Sans-I/O Ripple connections: bytes in, events out; messages in, bytes out.

:class:`ServerConnection` is headwater's side of a worker connection. It decodes the
envelopes, enforces the protocol rules that need no engine and reports everything else
as events, in arrival order:

- :class:`HandshakeReceived`: the worker's Handshake, already checked for the things the
  codec can judge (protocol version, a usable fingerprint per output schema, no output
  named twice). The application checks the schemas against its kinds and answers with
  :meth:`ServerConnection.accept_handshake` or :meth:`ServerConnection.reject_handshake`.
- :class:`DeltaReceived`: a Delta whose fingerprint matched the schema negotiated for its
  output, with the decoded ``delta``.
- :class:`MessageReceived`: a Heartbeat, Checkpoint_request, Checkpoint_ack or
  Schema_negotiation.
- :class:`Reject`: the peer broke the protocol inside an intact envelope (or sent an
  unsupported version or an oversized payload): send ``data`` (a
  Schema_negotiation{ok=false; errors=[reason]}), then close.
- :class:`Close`: the byte stream cannot be trusted (bad magic, CRC mismatch, end of
  input inside an envelope): close without a word.

Handshake first: any message before the Handshake, and a second Handshake, gets a Reject
(Schema_negotiation ok=false "Handshake must be the first message") and the connection
closes; Ripple has no per-message error reply, and a worker that skipped the handshake
cannot be trusted with the data it sends next.

Deltas may follow the Handshake without waiting for the answer (pipelining). They are
checked against the schemas the Handshake declared, which become the negotiated ones when
the application accepts; when it rejects, the connection is closed and the application
must drop whatever events followed the Handshake (:attr:`ServerConnection.closed`).

A Delta's header fingerprint is compared before anything is deserialized: a fingerprint
that is none of the negotiated ones is refused without decoding the payload at all; then
the delta_msg record is decoded, its ``source_output`` must be a negotiated output whose
schema has exactly that fingerprint, and only then is ``delta_bytes`` decoded with it.

:class:`ClientConnection` is the worker's side (used by tests, tools and any Python
worker): it numbers envelopes and per-output ``sequence_no`` values and encodes deltas
with the right schema and fingerprint. Its :meth:`~ClientConnection.receive_data` raises
:class:`~headwater.errors.ProtocolError` on bad bytes; the caller should then close.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from headwater.errors import ProtocolError, UsageError
from headwater.protocols import _connection
from headwater.protocols._connection import Close as Close
from headwater.protocols._connection import Reject as Reject

from .bin_prot import Buffer, DecodeError
from .envelope import (
    MAX_PAYLOAD,
    Envelope,
    EnvelopeDecoder,
    MessageType,
    PayloadLengthError,
    UnsupportedVersionError,
    fingerprint_text,
)
from .messages import (
    PROTOCOL_VERSION,
    CheckpointAck,
    CheckpointRequest,
    Delta,
    DeltaMsg,
    Handshake,
    HandshakeAuth,
    Heartbeat,
    Message,
    Schema,
    SchemaNegotiation,
    decode_delta,
    decode_message,
    encode_delta,
    encode_message,
    schema_problems,
)


@dataclass(frozen=True, slots=True)
class HandshakeReceived:
    """The worker's Handshake; answer it with accept_handshake / reject_handshake."""

    envelope: Envelope
    handshake: Handshake


@dataclass(frozen=True, slots=True)
class DeltaReceived:
    """A Delta checked against its output's negotiated schema, ``delta`` decoded."""

    envelope: Envelope
    message: DeltaMsg
    schema: Schema
    delta: Delta


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """A message in its envelope: on the server any but a Handshake or a Delta (Heartbeat,
    Checkpoint_request/_ack, Schema_negotiation), on the worker side every message."""

    envelope: Envelope
    message: Message


Received = MessageReceived
"""What the worker side's :meth:`ClientConnection.receive_data` gives: every message."""


ServerEvent = (
    HandshakeReceived | DeltaReceived | MessageReceived | Reject[SchemaNegotiation] | Close
)


class _Sender:
    """Numbers outgoing envelopes: sequence 1, 2, 3, ... per connection."""

    __slots__ = ("_next_sequence",)

    def __init__(self) -> None:
        self._next_sequence = 1

    def envelope(
        self, message: Message, timestamp_ns: int, fingerprint: bytes | None = None
    ) -> bytes:
        data = encode_message(
            message,
            sequence=self._next_sequence,
            timestamp_ns=timestamp_ns,
            fingerprint=fingerprint,
        )
        self._next_sequence += 1
        return data


class ServerConnection(_connection.ServerConnection[Envelope, ServerEvent]):
    """headwater's view of one Ripple worker connection (see the module docstring)."""

    __slots__ = ("_accepted", "_envelope", "_fingerprints", "_handshake", "_outputs")

    eof_reason = "input ended inside an envelope ({} bytes held)"

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        super().__init__(EnvelopeDecoder(max_payload))
        self._envelope = _Sender().envelope
        self._handshake: Handshake | None = None
        self._outputs: dict[str, Schema] = {}
        self._fingerprints: frozenset[bytes] = frozenset()
        self._accepted = False

    @property
    def handshake(self) -> Handshake | None:
        return self._handshake

    @property
    def worker_id(self) -> str | None:
        return None if self._handshake is None else self._handshake.source_worker_id

    @property
    def outputs(self) -> Mapping[str, Schema]:
        """Output name -> schema, as declared by the Handshake (negotiated once accepted)."""
        return self._outputs

    @property
    def handshake_accepted(self) -> bool:
        return self._accepted

    def _on_broken(self, exc: ProtocolError) -> ServerEvent:
        if isinstance(exc, UnsupportedVersionError | PayloadLengthError):
            return self._reject(str(exc))
        return Close(str(exc))

    def _reject(self, reason: str) -> ServerEvent:
        self._closed = True
        answer = SchemaNegotiation(False, (reason,))
        return Reject(answer, self._envelope(answer, 0), reason)

    def _on_item(self, envelope: Envelope) -> ServerEvent:
        if envelope.message_type == MessageType.DELTA and self._handshake is not None:
            return self._on_delta(envelope)
        try:
            message = decode_message(envelope)
        except DecodeError as exc:
            return self._reject(f"undecodable message: {exc}")
        if isinstance(message, Handshake):
            if self._handshake is not None:
                return self._reject("Handshake must be sent once")
            return self._on_handshake(envelope, message)
        if self._handshake is None:
            return self._reject(
                f"Handshake must be the first message, got {type(message).__name__}"
            )
        return MessageReceived(envelope, message)

    def _on_handshake(self, envelope: Envelope, handshake: Handshake) -> ServerEvent:
        problems = []
        if handshake.protocol_version != PROTOCOL_VERSION:
            problems.append(f"unsupported protocol_version {handshake.protocol_version}")
        outputs: dict[str, Schema] = {}
        for output, schema in handshake.output_schemas:
            if output in outputs:
                problems.append(f"output {output!r} is declared twice")
            outputs[output] = schema
            problems.extend(schema_problems(schema))
        if problems:
            return self._reject("; ".join(problems))
        self._handshake = handshake
        self._outputs = outputs
        self._fingerprints = frozenset(schema.fingerprint for schema in outputs.values())
        return HandshakeReceived(envelope, handshake)

    def _on_delta(self, envelope: Envelope) -> ServerEvent:
        if envelope.fingerprint not in self._fingerprints:
            # Refused on the header alone: the payload is never deserialized.
            return self._reject(
                f"Delta fingerprint {fingerprint_text(envelope.fingerprint)!r}"
                " names no negotiated schema"
            )
        try:
            message = decode_message(envelope)
        except DecodeError as exc:
            return self._reject(f"undecodable Delta: {exc}")
        assert isinstance(message, DeltaMsg)
        schema = self._outputs.get(message.source_output)
        if schema is None:
            return self._reject(f"Delta for undeclared output {message.source_output!r}")
        if schema.fingerprint != envelope.fingerprint:
            return self._reject(
                f"Delta for {message.source_output!r} carries fingerprint"
                f" {fingerprint_text(envelope.fingerprint)!r}, negotiated"
                f" {fingerprint_text(schema.fingerprint)!r}"
            )
        try:
            delta = decode_delta(schema, message.delta_bytes)
        except DecodeError as exc:
            return self._reject(f"undecodable delta_bytes for {message.source_output!r}: {exc}")
        return DeltaReceived(envelope, message, schema, delta)

    # --- answers ---------------------------------------------------------------------

    def accept_handshake(self, *, timestamp_ns: int = 0) -> bytes:
        """Schema_negotiation{ok=true}: the declared schemas are now negotiated."""
        self._check_answerable()
        self._accepted = True
        return self._envelope(SchemaNegotiation(True, ()), timestamp_ns)

    def reject_handshake(self, errors: Sequence[str], *, timestamp_ns: int = 0) -> bytes:
        """Schema_negotiation{ok=false; errors}: send it, then close the connection."""
        self._check_answerable()
        if isinstance(errors, str) or not errors:
            raise UsageError("reject_handshake needs a non-empty list of error strings")
        self._closed = True
        return self._envelope(SchemaNegotiation(False, tuple(errors)), timestamp_ns)

    def _check_answerable(self) -> None:
        if self._handshake is None:
            raise UsageError("no Handshake to answer")
        if self._accepted:
            raise UsageError("the Handshake was already accepted")

    def send(self, message: Message, *, timestamp_ns: int = 0) -> bytes:
        """Any non-Delta message (e.g. Checkpoint_request, Checkpoint_ack), enveloped."""
        if isinstance(message, DeltaMsg | Handshake):
            raise UsageError(f"the server does not send {type(message).__name__}")
        return self._envelope(message, timestamp_ns)


class ClientConnection:
    """A worker's view of its Ripple connection.

    Call :meth:`handshake` first. ``negotiated`` is None until the server's
    Schema_negotiation arrives, then its ``ok``; ``errors`` holds its reasons.
    """

    __slots__ = (
        "_decoder",
        "_envelope",
        "_outputs",
        "_sequence_nos",
        "errors",
        "negotiated",
        "worker_id",
    )

    def __init__(self, worker_id: str, *, max_payload: int = MAX_PAYLOAD) -> None:
        self._envelope = _Sender().envelope
        self.worker_id = worker_id
        self._decoder = EnvelopeDecoder(max_payload)
        self._outputs: dict[str, Schema] | None = None
        self._sequence_nos: dict[str, int] = {}
        self.negotiated: bool | None = None
        self.errors: tuple[str, ...] = ()

    @property
    def outputs(self) -> Mapping[str, Schema]:
        return self._outputs or {}

    def handshake(
        self,
        outputs: Mapping[str, Schema] | Iterable[tuple[str, Schema]],
        *,
        timestamp_ns: int = 0,
        auth: HandshakeAuth | None = None,
    ) -> bytes:
        """The Handshake; ``auth`` (a token, a tenant) travels in headwater's extension
        (FLAG_HANDSHAKE_AUTH), which a worker without a credential leaves out."""
        if self._outputs is not None:
            raise UsageError("the Handshake was already sent")
        pairs = tuple(outputs.items() if isinstance(outputs, Mapping) else outputs)
        declared = dict(pairs)
        if len(declared) != len(pairs):
            raise UsageError("an output is declared twice")
        for schema in declared.values():
            problems = schema_problems(schema)
            if problems:
                raise UsageError("; ".join(problems))
        handshake = Handshake(self.worker_id, pairs, PROTOCOL_VERSION, auth)
        data = self._envelope(handshake, timestamp_ns)
        self._outputs = declared
        return data

    def last_sequence_no(self, output: str) -> int:
        """The last ``sequence_no`` sent for ``output`` (0 before the first)."""
        return self._sequence_nos.get(output, 0)

    def send_delta(
        self,
        output: str,
        key: str | bytes,
        delta: Delta,
        *,
        timestamp_ns: int = 0,
        watermark_ns: int | None = None,
        sequence_no: int | None = None,
    ) -> bytes:
        """One Delta envelope. ``sequence_no`` defaults to the output's last + 1 (from 1);
        pass an old one to redeliver. A str ``key`` travels as its UTF-8 bytes."""
        if self._outputs is None:
            raise UsageError("send the Handshake first")
        if self.negotiated is False:
            raise UsageError("the server rejected the Handshake")
        schema = self._outputs.get(output)
        if schema is None:
            raise UsageError(f"output {output!r} was not declared in the Handshake")
        if sequence_no is None:
            sequence_no = self.last_sequence_no(output) + 1
        self._sequence_nos[output] = max(sequence_no, self.last_sequence_no(output))
        key_bytes = key.encode() if isinstance(key, str) else bytes(key)
        message = DeltaMsg(
            output, key_bytes, encode_delta(schema, delta), sequence_no, watermark_ns
        )
        return self._envelope(message, timestamp_ns, schema.fingerprint)

    def heartbeat(self, timestamp_ns: int, load: float) -> bytes:
        return self._envelope(Heartbeat(self.worker_id, timestamp_ns, load), timestamp_ns)

    def checkpoint_request(self, checkpoint_id: str, epoch: int, *, timestamp_ns: int = 0) -> bytes:
        return self._envelope(CheckpointRequest(checkpoint_id, epoch), timestamp_ns)

    def checkpoint_ack(
        self, checkpoint_id: str, epoch: int, last_sequence_no: int, *, timestamp_ns: int = 0
    ) -> bytes:
        ack = CheckpointAck(checkpoint_id, self.worker_id, epoch, last_sequence_no)
        return self._envelope(ack, timestamp_ns)

    def send(self, message: Message, *, timestamp_ns: int = 0) -> bytes:
        """Any non-Delta message, enveloped (use send_delta for deltas)."""
        if isinstance(message, DeltaMsg):
            raise UsageError("use send_delta for deltas")
        return self._envelope(message, timestamp_ns)

    def receive_data(self, data: Buffer) -> list[Received]:
        """Decoded messages in arrival order; raises ProtocolError on bad bytes."""
        self._decoder.feed(data)
        received = []
        for envelope in self._decoder:
            message = decode_message(envelope)
            if isinstance(message, SchemaNegotiation) and self.negotiated is None:
                self.negotiated = message.ok
                self.errors = message.errors
            received.append(Received(envelope, message))
        return received

    def receive_eof(self) -> None:
        """The server closed: ProtocolError when it stopped inside an envelope."""
        self._decoder.finish()


@dataclass(frozen=True, slots=True)
class SequenceVerdict:
    """What to do with a delta: ``apply`` it or not, and how many were ``missed``
    before it (a gap of sequence numbers)."""

    apply: bool
    missed: int = 0


class SequenceTracker:
    """Ripple's per-source sequence rule: a ``sequence_no`` at or below the last applied
    one is a redelivery and is discarded; a jump past last + 1 is a gap (counted, then
    applied). The first number seen from a source is never a gap (nothing is known
    before it). Keyed by whatever identifies a source, e.g. ``(worker_id, output)``."""

    __slots__ = ("_last", "duplicates", "gaps")

    def __init__(self) -> None:
        self._last: dict[object, int] = {}
        self.duplicates = 0
        self.gaps = 0

    def last(self, source: object) -> int:
        return self._last.get(source, 0)

    def items(self) -> list[tuple[object, int]]:
        """``(source, last applied sequence_no)`` of every source seen (to save them)."""
        return list(self._last.items())

    def redelivery(self, source: object, sequence_no: int) -> bool:
        """Whether :meth:`observe` would discard ``sequence_no`` (nothing is recorded)."""
        last = self._last.get(source)
        return last is not None and sequence_no <= last

    def rewind(self, source: object, last: int | None) -> None:
        """Go back to ``last`` (None: nothing known): deltas after it are applied again
        when they come back, e.g. those whose write the application could not keep."""
        if last is None:
            self._last.pop(source, None)
        else:
            self._last[source] = last

    def observe(self, source: object, sequence_no: int) -> SequenceVerdict:
        if self.redelivery(source, sequence_no):
            self.duplicates += 1
            return SequenceVerdict(False)
        last = self._last.get(source)
        self._last[source] = sequence_no
        missed = 0 if last is None else sequence_no - last - 1
        if missed:
            self.gaps += 1
        return SequenceVerdict(True, missed)
