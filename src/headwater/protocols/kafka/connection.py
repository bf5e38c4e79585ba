"""The sans-I/O server side of one Kafka connection: bytes in, events out; responses
in, bytes out, in request order.

Kafka answers the requests of one connection in the order they came (Kafka's Java client
checks each answer's correlation id against its oldest request), so the engine may
finish them in any order and :meth:`ServerConnection.send` hands back only the bytes
that are next in line: an answer that overtook an older one waits for it.

What the connection decides itself, as a Kafka broker does:

- ApiVersions is answered here (a :class:`Reply`), in line with the other answers;
  a version above the supported ones gets the v0 answer with UNSUPPORTED_VERSION;
- a Produce with ``acks=0`` expects no answer and takes no place in line;
- a bad size, an unknown API key, an unsupported version of another API, or a request
  that does not decode as its API and version: :class:`Close` (Kafka closes the
  connection: it has no way to answer a request it could not read).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kio.static.protocol import RequestPayload, ResponsePayload

from headwater.engine.kinds.reader import Buffer
from headwater.errors import ProtocolError, UsageError
from headwater.protocols import _connection
from headwater.protocols._connection import Close as Close

from .apis import SUPPORTED, ApiKey, api_versions_response, is_supported
from .frames import (
    MAX_REQUEST,
    FrameDecoder,
    decode_request_body,
    encode_response_chunks,
    read_fixed_header,
)
from .schema import SchemaDecodeError


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request for the engine to answer with :meth:`ServerConnection.send`."""

    api_key: ApiKey
    api_version: int
    correlation_id: int
    client_id: str | None
    request: RequestPayload
    expects_response: bool
    """False for a Produce with acks=0: nothing may be sent for it."""
    sequence: int = field(repr=False)


class Reply(_connection.Reply[ResponsePayload]):
    """An answer the connection produced itself (ApiVersions). ``data`` is what may be
    sent now: the answer itself when nothing older is pending, else ``b""`` and the
    answer follows with the bytes :meth:`ServerConnection.send` returns."""

    __slots__ = ()


ServerEvent = Request | Reply | Close


class _Slot:
    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: list[Buffer] | None = None


class ServerConnection(_connection.ServerConnection[bytes, ServerEvent]):
    """The server's view of one Kafka connection (see the module docstring)."""

    __slots__ = ("_line", "_next_sequence", "_slots")

    eof_reason = "connection ended inside a request ({} bytes)"

    def __init__(self, max_request: int = MAX_REQUEST) -> None:
        super().__init__(FrameDecoder(max_request))
        self._line: deque[int] = deque()  # sequences awaiting their answer, oldest first
        self._slots: dict[int, _Slot] = {}
        self._next_sequence = 0

    @property
    def pending_responses(self) -> int:
        """Requests taken and not yet answered on the wire (the front end stops reading
        past its limit, as Kafka mutes a connection with a request in flight)."""
        return len(self._line)

    def send(self, request: Request, response: ResponsePayload) -> bytes:
        """Answer ``request``; the bytes to write now (maybe none, maybe several
        answers that were waiting for this one)."""
        return b"".join(self.send_chunks(request, response))

    def answers_ahead(self, request: Request) -> bool:
        """Whether requests taken before ``request`` are still to be answered on the
        wire: its answer would wait behind theirs."""
        return bool(self._line) and self._line[0] != request.sequence

    def send_chunks(
        self,
        request: Request,
        response: ResponsePayload,
        spliced: Mapping[bytes, Sequence[Buffer]] | None = None,
    ) -> list[Buffer]:
        """:meth:`send`, as buffers to write in order (``transport.writelines``), with
        the placeholders of ``spliced`` put in as :func:`.frames.encode_response_chunks`
        puts them: a Fetch answer's stored batches go out as they were read."""
        if not request.expects_response:
            raise UsageError(f"{request.api_key.name} with acks=0 takes no answer")
        if int(response.__api_key__) != request.api_key or (
            int(response.__version__) != request.api_version
        ):
            raise UsageError(
                f"answer {type(response).__name__} v{response.__version__} to "
                f"{request.api_key.name} v{request.api_version}"
            )
        slot = self._slots.get(request.sequence)
        if slot is None or slot.data is not None:
            raise UsageError(f"{request.api_key.name} {request.correlation_id} already answered")
        slot.data = encode_response_chunks(request.correlation_id, response, spliced)
        return self._ready()

    def _ready(self) -> list[Buffer]:
        out: list[Buffer] = []
        line, slots = self._line, self._slots
        while line:
            data = slots[line[0]].data
            if data is None:
                break
            out += data
            del slots[line.popleft()]
        return out

    def _take_place(self) -> tuple[int, _Slot]:
        sequence = self._next_sequence
        self._next_sequence += 1
        slot = _Slot()
        self._line.append(sequence)
        self._slots[sequence] = slot
        return sequence, slot

    def _on_item(self, body: bytes) -> ServerEvent:
        fixed = read_fixed_header(body)
        key = fixed.api_key
        if key not in _KEYS:
            return self._close(f"unknown API key {key}")
        api_key = ApiKey(key)
        if api_key is ApiKey.API_VERSIONS and fixed.api_version not in SUPPORTED[api_key]:
            # Kafka reads nothing past the fixed header of a newer ApiVersions and
            # answers with v0 and the table, so the client can step down.
            response = api_versions_response(fixed.api_version)
            return self._reply(fixed.correlation_id, response)
        if not is_supported(key, fixed.api_version):
            return self._close(f"{api_key.name} v{fixed.api_version} is not supported")
        try:
            header, request = decode_request_body(fixed, body)
        except SchemaDecodeError as exc:
            return self._close(f"{api_key.name} v{fixed.api_version} does not decode: {exc}")
        if api_key is ApiKey.API_VERSIONS:
            return self._reply(fixed.correlation_id, api_versions_response(fixed.api_version))
        expects_response = not (api_key is ApiKey.PRODUCE and getattr(request, "acks", None) == 0)
        sequence = -1
        if expects_response:
            sequence, _ = self._take_place()
        return Request(
            api_key=api_key,
            api_version=fixed.api_version,
            correlation_id=fixed.correlation_id,
            client_id=header.client_id,
            request=request,
            expects_response=expects_response,
            sequence=sequence,
        )

    def _reply(self, correlation_id: int, response: ResponsePayload) -> Reply:
        _, slot = self._take_place()
        slot.data = encode_response_chunks(correlation_id, response)
        return Reply(response, b"".join(self._ready()))

    def _close(self, reason: str) -> Close:
        self._closed = True
        return Close(reason)

    def _on_broken(self, exc: ProtocolError) -> ServerEvent:
        return Close(str(exc))


_KEYS = frozenset(int(key) for key in ApiKey)
