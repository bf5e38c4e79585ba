"""The PostgreSQL v3 frontend/backend protocol, server side (docs/protocols/postgres.md).

A pure codec and state machine: :mod:`.messages` (the message table, encoders and
decoders), :mod:`.types` (type OIDs, text and binary values), :mod:`.statements` (what
the session answers itself), :mod:`.auth` (SCRAM-SHA-256 over tokens) and
:mod:`.connection` (the sans-I/O server connection).
"""

from .auth import ScramError, TokenKeys
from .connection import (
    Authenticate,
    CancelRequested,
    Close,
    DescribeStatement,
    Event,
    QueryOutcome,
    Reject,
    Reply,
    RunQuery,
    ServerConnection,
    TlsRequested,
)
from .messages import ErrorFields, MessageError

__all__ = [
    "Authenticate",
    "CancelRequested",
    "Close",
    "DescribeStatement",
    "ErrorFields",
    "Event",
    "MessageError",
    "QueryOutcome",
    "Reject",
    "Reply",
    "RunQuery",
    "ScramError",
    "ServerConnection",
    "TlsRequested",
    "TokenKeys",
]
