"""The PostgreSQL server connection against hostile input: random bytes before and after
start-up, and mutated valid sessions.

The only outcomes allowed are events; a peer's broken bytes end in one FATAL
ErrorResponse (:class:`Reject`) or a Close, nothing after it; the connection never
raises, never holds more than one message's bytes, and a huge length field allocates
nothing.
"""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headwater.protocols.postgres import messages as m
from headwater.protocols.postgres.auth import TokenKeys
from headwater.protocols.postgres.connection import (
    MAX_AUTH_MESSAGE,
    MAX_STARTUP,
    Authenticate,
    Close,
    DescribeStatement,
    QueryOutcome,
    Reject,
    RunQuery,
    ServerConnection,
)

pytestmark = pytest.mark.timeout(120)  # a hang fails instead of stalling the suite

KEYS = TokenKeys(["s3cret"], iterations=16)  # few iterations: the fuzzer is not brute force
STARTUP = m.encode_startup({"user": "u"})
VALID = b"".join(
    [
        m.encode_frontend(m.Query("SELECT 1; SET a = 'b'; SHOW a")),
        m.encode_frontend(m.Parse("", "SELECT $1::TEXT", (25,))),
        m.encode_frontend(m.Bind("", "", (), (b"x",), ())),
        m.encode_frontend(m.Describe("S", "")),
        m.encode_frontend(m.Execute("", 0)),
        m.encode_frontend(m.Sync()),
    ]
)


def drive(conn: ServerConnection, chunks: list[bytes]) -> list[object]:
    """Feed ``chunks`` as the shell does, answering what must be answered; every event."""
    out: list[object] = []
    for chunk in chunks:
        conn.feed(chunk)
        while (event := conn.next_event()) is not None:
            out.append(event)
            if isinstance(event, Authenticate):
                conn.accept(1, 2)
            elif isinstance(event, RunQuery):
                conn.complete(event, QueryOutcome(["c"], ["VARCHAR"], [["v"]]))
            elif isinstance(event, DescribeStatement):
                conn.describe_statement(event.prepared, None)
        # All complete messages were taken: at most one partial message is held; once
        # the connection has ended, what arrives later is dropped.
        assert conn.buffered_bytes < 5 + max(MAX_STARTUP, MAX_AUTH_MESSAGE)
        if conn.closed:
            held = conn.buffered_bytes
            conn.feed(b"Q" * 100)
            assert conn.buffered_bytes == held and conn.next_event() is None
    return out


def check_ending(events: list[object]) -> None:
    final = [i for i, e in enumerate(events) if isinstance(e, Reject | Close)]
    assert final in ([], [len(events) - 1])  # the last word is last
    for event in events:
        if isinstance(event, Reject):
            [error] = m.split_backend(event.data)
            assert error.type == "E" and error.fields["S"] == "FATAL"
            assert len(error.fields["C"]) == 5


@settings(max_examples=300)
@given(st.binary(max_size=200), st.sampled_from(["trust", "password", "scram-sha-256"]))
def test_random_bytes_before_startup(data: bytes, auth: str) -> None:
    conn = ServerConnection(auth=auth, keys=KEYS)
    check_ending(drive(conn, [data]))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_after_startup(data: bytes) -> None:
    conn = ServerConnection(auth="trust")
    check_ending(drive(conn, [STARTUP, data]))


@settings(max_examples=300)
@given(st.binary(max_size=120))
def test_random_bytes_during_scram(data: bytes) -> None:
    conn = ServerConnection(auth="scram-sha-256", keys=KEYS)
    events = drive(conn, [STARTUP, data])
    check_ending(events)
    assert not any(isinstance(e, Authenticate) for e in events)  # no proof, no entry


@settings(max_examples=300)
@given(st.data())
def test_mutated_sessions(data: st.DataObject) -> None:
    session = bytearray(STARTUP + VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(session) - 1))
        session[at] = data.draw(st.integers(0, 255))
    conn = ServerConnection(auth="trust")
    check_ending(drive(conn, [bytes(session)]))


@pytest.mark.parametrize(
    ("prefix", "head"),
    [
        (b"", struct.pack(">i", 0x7FFFFFFF)),  # a start-up packet of 2 GiB
        (STARTUP, b"Q" + struct.pack(">i", 0x7FFFFFFF)),  # a query of 2 GiB after auth
        (STARTUP, b"p" + struct.pack(">i", MAX_AUTH_MESSAGE + 5)),  # an oversized password
    ],
)
def test_huge_lengths_allocate_nothing(prefix: bytes, head: bytes) -> None:
    conn = ServerConnection(auth="password" if head[:1] == b"p" else "trust")
    drive(conn, [prefix])
    tracemalloc.start()
    try:
        events = drive(conn, [head])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(events[-1], Reject)
    assert peak < 64 * 1024
    assert MAX_STARTUP < 64 * 1024


@settings(max_examples=500)
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(m.FRONTEND)), st.binary(max_size=40)),
        min_size=1,
        max_size=6,
    )
)
def test_random_bodies_of_every_message_type(parts: list[tuple[bytes, bytes]]) -> None:
    """Well-framed messages of every type with random bodies: each is answered (an
    ERROR, a FATAL error, or what it asks), never an exception."""
    conn = ServerConnection(auth="trust")
    data = b"".join(m.message(kind, body) for kind, body in parts)
    check_ending(drive(conn, [STARTUP, data]))
