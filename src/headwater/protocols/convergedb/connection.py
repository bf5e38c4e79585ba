"""Sans-I/O ConvergeDB connections: bytes in, events out; messages in, bytes out.

:class:`ServerConnection` turns received bytes into decoded :class:`Frame` objects and
answers, on its own, everything the protocol answers without the engine: broken framing
(ERROR then close), malformed payloads and unknown opcodes (ERROR, stay open), requests
before CONNECT (NOT_CONNECTED), a second CONNECT, writes on a read-only connection.
:class:`ClientConnection` allocates stream ids, frames requests and decodes replies,
checking that each reply belongs to a request it sent. Neither does any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError, UsageError
from headwater.protocols import _connection
from headwater.protocols._connection import Close as Close

from .codes import (
    CLIENT_OPCODES,
    MAX_PAYLOAD,
    REPLY_OPCODES,
    SERVER_OPCODES,
    WRITE_OPCODES,
    DecodeError,
    ErrorCode,
    Opcode,
    UnexpectedFrameError,
)
from .frames import FrameDecoder, FrameError, RawFrame
from .messages import (
    Ack,
    Change,
    ClientMessage,
    Connect,
    ConnectAck,
    EpochEndAck,
    ErrorMessage,
    Frame,
    KindAck,
    Message,
    State,
    Subscribe,
    Unsubscribe,
    decode_message,
)

_MAX_STREAM_ID = 0xFFFF


class _Framed:
    """Reply's and Reject's ``answer`` under ConvergeDB's name for it, ``frame``."""

    __slots__ = ()
    answer: Frame

    @property
    def frame(self) -> Frame:
        return self.answer


class Reply(_Framed, _connection.Reply[Frame]):
    """An ERROR the connection produced itself: send ``data`` and carry on."""

    __slots__ = ()


class Reject(_Framed, _connection.Reject[Frame]):
    """The framing broke: send ``data`` (an ERROR), then close the connection."""

    __slots__ = ()


ServerEvent = Frame | Reply | Reject | Close


class _Phase(Enum):
    NEW = "new"
    CONNECTING = "connecting"  # CONNECT received, the engine has not answered yet
    CONNECTED = "connected"  # the engine sent the CONNECT ACK


class ServerConnection(_connection.ServerConnection[RawFrame, ServerEvent]):
    """The server's view of one ConvergeDB connection.

    Feed bytes with :meth:`receive_data` (or :meth:`feed` and then :meth:`next_event` one
    event at a time); each complete frame becomes exactly one event, in arrival order:

    - :class:`Frame`: a decoded request for the engine;
    - :class:`Reply`: an ERROR the connection answered itself, the connection stays open
      (malformed payload or unknown opcode: BAD_FRAME or the decoder's more precise code;
      anything but CONNECT first: NOT_CONNECTED; a second CONNECT: SOURCE_CONFLICT; a
      write on a read-only connection: READ_ONLY). Each carries the frame's stream_id and
      opcode, so a failed fire-and-forget write is reported on stream 0;
    - :class:`Reject`: broken framing (bad header CRC or version: BAD_FRAME on stream 0,
      ref_opcode 0; oversized payload_len: LIMIT_EXCEEDED), always the last event;
    - :class:`Close`: input ended inside a frame (from :meth:`receive_eof`).

    The connection counts as connected from the moment a well-formed CONNECT arrives, so
    frames pipelined behind it reach the engine. The engine answers the CONNECT through
    :meth:`send`: a :class:`ConnectAck` confirms it, an ERROR whose ref_opcode is CONNECT
    undoes it (later requests get NOT_CONNECTED again). An engine that answers CONNECT
    asynchronously should pull events with :meth:`next_event` and not pull past a CONNECT
    before answering it.
    """

    __slots__ = ("_phase", "_read_only", "_source_id")

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        super().__init__(FrameDecoder(max_payload))
        self._phase = _Phase.NEW
        self._read_only = False
        self._source_id: int | None = None

    # --- state ---------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """A CONNECT arrived and the engine has not refused it."""
        return self._phase is not _Phase.NEW

    @property
    def connect_acknowledged(self) -> bool:
        """The engine sent the CONNECT ACK."""
        return self._phase is _Phase.CONNECTED

    @property
    def read_only(self) -> bool:
        return self._read_only

    @property
    def source_id(self) -> int | None:
        """The source slot the CONNECT ACK granted (None before it, 0xFF if read-only)."""
        return self._source_id

    # --- input ---------------------------------------------------------------------

    def _on_broken(self, exc: ProtocolError) -> ServerEvent:
        assert isinstance(exc, FrameError)
        frame = Frame(exc.stream_id, ErrorMessage(exc.code, exc.ref_opcode, exc.message))
        return Reject(frame, frame.encode(), exc.message)

    def _on_item(self, raw: RawFrame) -> ServerEvent:
        opcode = raw.opcode
        if opcode not in CLIENT_OPCODES:
            known = "a server-to-client" if opcode in SERVER_OPCODES else "an unknown"
            return self._reply(raw, ErrorCode.BAD_FRAME, f"{opcode:#06x} is {known} opcode")
        if raw.flags:
            return self._reply(raw, ErrorCode.BAD_FRAME, f"header flags {raw.flags:#04x} must be 0")
        if self._phase is _Phase.NEW and opcode != Opcode.CONNECT:
            return self._reply(raw, ErrorCode.NOT_CONNECTED, "CONNECT must come first")
        try:
            message = decode_message(opcode, raw.payload)
        except DecodeError as exc:
            return self._reply(raw, exc.code, exc.message)
        if isinstance(message, Connect):
            if self._phase is not _Phase.NEW:
                return self._reply(raw, ErrorCode.SOURCE_CONFLICT, "this connection is connected")
            self._phase = _Phase.CONNECTING
            self._read_only = message.read_only
        elif self._read_only and opcode in WRITE_OPCODES:
            return self._reply(raw, ErrorCode.READ_ONLY, "the connection is read-only")
        return Frame(raw.stream_id, message)

    def _reply(self, raw: RawFrame, code: int, message: str) -> Reply:
        frame = Frame(raw.stream_id, ErrorMessage(code, raw.opcode, message))
        return Reply(frame, frame.encode())

    # --- output --------------------------------------------------------------------

    def send(self, stream_id: int, message: Message) -> bytes:
        """One framed message. A ConnectAck or a refused CONNECT updates the state."""
        data = Frame(stream_id, message).encode()
        if isinstance(message, ConnectAck):
            self._phase = _Phase.CONNECTED
            self._source_id = message.source_id
            self._read_only = message.read_only
        elif (
            isinstance(message, ErrorMessage)
            and message.ref_opcode == Opcode.CONNECT
            and self._phase is _Phase.CONNECTING
        ):
            self._phase = _Phase.NEW
            self._read_only = False
        return data

    def send_error(self, stream_id: int, code: int, ref_opcode: int, message: str = "") -> bytes:
        return self.send(stream_id, ErrorMessage(code, ref_opcode, message))


class ClientConnection:
    """The client's view of one ConvergeDB connection.

    :meth:`send` gives every request that will be answered a fresh non-zero stream_id
    (1..65535, wrapping, skipping ids still in use) and sends the rest on stream 0.
    :meth:`receive_data` decodes the server's frames and checks that each belongs to
    something this client sent; it raises :class:`~headwater.errors.ProtocolError`
    (FrameError, DecodeError, UnexpectedFrameError) on bad bytes, after which the client
    should close.

    A subscription keeps its SUBSCRIBE's stream_id until the ACK of an UNSUBSCRIBE of the
    same kind (or an ERROR on that stream): the notifications carry it.
    """

    __slots__ = (
        "_decoder",
        "_next_id",
        "_pending",
        "_subscription_streams",
        "_subscriptions",
        "connected",
        "source_id",
    )

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        self._decoder = FrameDecoder(max_payload)
        self._next_id = 1
        self._pending: dict[int, tuple[Opcode, int | None]] = {}  # stream -> (opcode, kind)
        self._subscriptions: dict[int, int] = {}  # kind_id -> stream_id
        self._subscription_streams: dict[int, int] = {}  # stream_id -> kind_id
        self.connected = False
        self.source_id: int | None = None

    @property
    def pending(self) -> Mapping[int, Opcode]:
        """Requests awaiting their reply: ``{stream_id: opcode}``."""
        return {stream: entry[0] for stream, entry in self._pending.items()}

    @property
    def subscriptions(self) -> Mapping[int, int]:
        """Acknowledged subscriptions: ``{kind_id: stream_id}``."""
        return dict(self._subscriptions)

    @property
    def at_frame_boundary(self) -> bool:
        return self._decoder.at_frame_boundary

    def _in_use(self, stream_id: int) -> bool:
        return stream_id in self._pending or stream_id in self._subscription_streams

    def next_stream_id(self) -> int:
        """A free stream id (not yet reserved: :meth:`send` reserves it)."""
        if len(self._pending) + len(self._subscription_streams) >= _MAX_STREAM_ID:
            raise UsageError("all 65535 stream ids are in use")
        stream_id = self._next_id
        while self._in_use(stream_id):
            stream_id = stream_id % _MAX_STREAM_ID + 1
        self._next_id = stream_id % _MAX_STREAM_ID + 1
        return stream_id

    def send(self, message: ClientMessage, *, ack: bool = False) -> tuple[int, bytes]:
        """Frame a request: ``(stream_id, bytes to send)``.

        CONNECT, QUERY, SUBSCRIBE, UNSUBSCRIBE, CREATE_KIND and GET_KIND always get a
        stream id. Writes, HEARTBEAT and the epoch markers go on stream 0 (no reply) unless
        ``ack`` asks for an ACK.
        """
        opcode = message.opcode
        if opcode not in CLIENT_OPCODES:
            raise UsageError(f"{type(message).__name__} is not a client request")
        kind: int | None = None
        if isinstance(message, Subscribe):
            kind = message.kind_id
            if kind in self._subscriptions or any(
                entry == (Opcode.SUBSCRIBE, kind) for entry in self._pending.values()
            ):
                raise UsageError(f"kind {kind} is already subscribed on this connection")
        elif isinstance(message, Unsubscribe):
            kind = message.kind_id
        if opcode not in REPLY_OPCODES and not ack:
            return 0, Frame(0, message).encode()
        stream_id = self.next_stream_id()
        data = Frame(stream_id, message).encode()
        self._pending[stream_id] = (opcode, kind)
        return stream_id, data

    def connect(
        self,
        name: str = "",
        auth_token: str = "",
        *,
        source_id: int | None = None,
        read_only: bool = False,
        liveness_deadline_ms: int = 0,
    ) -> tuple[int, bytes]:
        return self.send(Connect(name, auth_token, source_id, read_only, liveness_deadline_ms))

    def receive_data(self, data: Buffer) -> list[Frame]:
        """Decoded frames, in arrival order; raises ProtocolError on bad or stray frames."""
        self._decoder.feed(data)
        frames = []
        for raw in self._decoder:
            frame = Frame.decode(raw)
            self._track(frame)
            frames.append(frame)
        return frames

    def _track(self, frame: Frame) -> None:
        message, stream_id = frame.message, frame.stream_id
        if message.opcode in CLIENT_OPCODES:
            raise UnexpectedFrameError(f"the server sent a client opcode {message.opcode!r}")
        if isinstance(message, ErrorMessage):
            if stream_id == 0:
                return  # a failed fire-and-forget write, or a connection-level error
            if self._pending.pop(stream_id, None) is None:
                kind = self._subscription_streams.pop(stream_id, None)
                if kind is None:
                    raise UnexpectedFrameError(f"ERROR on stream {stream_id}, which is not open")
                del self._subscriptions[kind]  # the subscription ended (e.g. overflow)
            return
        if isinstance(message, Ack | ConnectAck | KindAck | EpochEndAck):
            opcode, kind = self._expect(stream_id, message.acked_opcode, "ACK")
            if opcode == Opcode.CONNECT and isinstance(message, ConnectAck):
                self.connected = True
                self.source_id = message.source_id
            elif opcode == Opcode.SUBSCRIBE and kind is not None:
                self._subscriptions[kind] = stream_id
                self._subscription_streams[stream_id] = kind
            elif opcode == Opcode.UNSUBSCRIBE and kind is not None:
                old = self._subscriptions.pop(kind, None)
                if old is not None:
                    del self._subscription_streams[old]
            return
        if isinstance(message, State) and message.change == Change.QUERY:
            self._expect(stream_id, Opcode.QUERY, "STATE (query)")
            return
        # A notification: STATE, DELETED, EVENT, BOOTSTRAP_BEGIN/END of a subscription.
        entry = self._pending.get(stream_id)
        subscribing = entry is not None and entry[0] == Opcode.SUBSCRIBE
        if stream_id not in self._subscription_streams and not subscribing:
            raise UnexpectedFrameError(
                f"{message.opcode.name} on stream {stream_id}, which is no subscription"
            )

    def _expect(self, stream_id: int, opcode: Opcode, what: str) -> tuple[Opcode, int | None]:
        entry = self._pending.get(stream_id)
        if entry is None or entry[0] != opcode:
            sent = "nothing" if entry is None else entry[0].name
            raise UnexpectedFrameError(
                f"{what} of {opcode.name} on stream {stream_id}, where this client sent {sent}"
            )
        del self._pending[stream_id]
        return entry
