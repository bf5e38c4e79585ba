"""Kiwi messages: the client's commands (parsed from text frames) and the server's replies,
results and notices (serialized to JSON), as spec/PROTOCOLS.md §3 and the Kiwi seed show.

Parsing is strict about what it needs and lenient about the rest: a command is a JSON
object whose ``type`` names the command; its fields must have the documented types;
fields it does not know are ignored (a newer client may send more). Anything else is a
:class:`KiwiProtocolError` carrying the WebSocket close code the connection must be closed
with: 1003 for a binary frame, 1008 for invalid JSON, an unknown command or a bad field.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, TypeAlias

from headwater.errors import ProtocolError

CLOSE_UNSUPPORTED_DATA = 1003  # a binary frame: Kiwi speaks text only
CLOSE_POLICY_VIOLATION = 1008  # invalid JSON, unknown command, bad field
CLOSE_GOING_AWAY = 1001  # the server shuts down

MAX_SOURCE_ID_CHARS = 256  # the name rule of spec/PROTOCOLS.md: longer is never a source
MAX_REQUEST = (1 << 53) - 1  # the largest integer a JavaScript number holds exactly


class KiwiProtocolError(ProtocolError):
    """The client broke the protocol: close the WebSocket with ``close_code``."""

    def __init__(self, close_code: int, reason: str) -> None:
        super().__init__(reason)
        self.close_code = close_code
        self.reason = reason


class Mode(enum.Enum):
    PUSH = "push"
    PULL = "pull"


@dataclass(frozen=True, slots=True)
class Subscribe:
    source_id: str
    mode: Mode = Mode.PUSH


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    source_id: str


@dataclass(frozen=True, slots=True)
class Request:
    source_id: str
    n: int


Command: TypeAlias = Subscribe | Unsubscribe | Request


def _policy(reason: str) -> KiwiProtocolError:
    return KiwiProtocolError(CLOSE_POLICY_VIOLATION, reason)


def _source_id(data: dict[str, Any]) -> str:
    value = data.get("sourceId")
    if not isinstance(value, str) or not value:
        raise _policy("sourceId must be a non-empty string")
    if len(value) > MAX_SOURCE_ID_CHARS:
        raise _policy(f"sourceId is longer than {MAX_SOURCE_ID_CHARS} characters")
    if not value.isascii():
        # JSON's \ud800 escape makes a lone surrogate, which no reply could carry
        # back as UTF-8: refuse it here rather than fail on the way out.
        try:
            value.encode()
        except UnicodeEncodeError:
            raise _policy("sourceId is not valid Unicode (a lone surrogate)") from None
    return value


def _count(data: dict[str, Any]) -> int:
    value = data.get("n")
    # JSON has one number type: 5.0 from a JavaScript client is the integer 5.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _policy("n must be a positive integer")
    if not 1 <= value <= MAX_REQUEST:
        raise _policy(f"n must be between 1 and {MAX_REQUEST}")
    return value


def _mode(data: dict[str, Any]) -> Mode:
    value = data.get("mode")
    if value is None:
        return Mode.PUSH
    if value == "push":
        return Mode.PUSH
    if value == "pull":
        return Mode.PULL
    raise _policy('mode must be "push" or "pull"')


def parse_command(data: str | bytes) -> Command:
    """One WebSocket message (``str`` for a text frame, ``bytes`` for a binary one) as a
    command; raises :class:`KiwiProtocolError` and nothing else."""
    if not isinstance(data, str):
        raise KiwiProtocolError(CLOSE_UNSUPPORTED_DATA, "binary frames are not supported")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError, huge integers, deep nesting
        raise _policy("the message is not valid JSON") from None
    if not isinstance(obj, dict):
        raise _policy("a command is a JSON object")
    kind = obj.get("type")
    if kind == "SUBSCRIBE":
        return Subscribe(_source_id(obj), _mode(obj))
    if kind == "UNSUBSCRIBE":
        return Unsubscribe(_source_id(obj))
    if kind == "REQUEST":
        return Request(_source_id(obj), _count(obj))
    if isinstance(kind, str):
        raise _policy(f"unknown command {kind[:64]!r}")
    raise _policy("a command needs a string type")


def command_json(command: Command) -> dict[str, Any]:
    """The client side: a command as its JSON object."""
    if isinstance(command, Subscribe):
        return {"type": "SUBSCRIBE", "sourceId": command.source_id, "mode": command.mode.value}
    if isinstance(command, Unsubscribe):
        return {"type": "UNSUBSCRIBE", "sourceId": command.source_id}
    return {"type": "REQUEST", "sourceId": command.source_id, "n": command.n}


def encode_command(command: Command) -> str:
    return dumps(command_json(command))


# ---- server messages ----------------------------------------------------------------


def dumps(obj: Any) -> str:
    """Compact JSON, non-ASCII kept as is (the frame is UTF-8 anyway)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _reply(kind: str, data: dict[str, Any]) -> bytes:
    return dumps({"type": kind, "data": data}).encode()


def subscribe_ok(source_id: str) -> bytes:
    return _reply("SUBSCRIBE_OK", {"sourceId": source_id})


def subscribe_error(source_id: str, error: str) -> bytes:
    return _reply("SUBSCRIBE_ERROR", {"sourceId": source_id, "error": error})


def unsubscribe_ok(source_id: str) -> bytes:
    return _reply("UNSUBSCRIBE_OK", {"sourceId": source_id})


def unsubscribe_error(source_id: str, error: str) -> bytes:
    return _reply("UNSUBSCRIBE_ERROR", {"sourceId": source_id, "error": error})


def request_ok(source_id: str, n: int) -> bytes:
    return _reply("REQUEST_OK", {"sourceId": source_id, "n": n})


def request_error(source_id: str, error: str) -> bytes:
    return _reply("REQUEST_ERROR", {"sourceId": source_id, "error": error})


def result(data: dict[str, Any]) -> bytes:
    """A RESULT of any source (streams build theirs faster: see ``stream_results``)."""
    return _reply("RESULT", data)


def counter_result(source_id: str, count: int) -> bytes:
    return result({"sourceId": source_id, "sourceType": "counter", "count": count})


def lag_notice(source_id: str, count: int) -> bytes:
    return _reply("NOTICE", {"type": "LAG", "sourceId": source_id, "count": count})


def subscription_closed(source_id: str, message: str) -> bytes:
    return _reply(
        "NOTICE", {"type": "SUBSCRIPTION_CLOSED", "sourceId": source_id, "message": message}
    )
