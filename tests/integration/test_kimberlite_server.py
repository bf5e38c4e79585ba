"""The Kimberlite front end against a real ``headwater serve`` process (spec/PROTOCOLS.md §1).

Every test talks to the server over TCP with raw sockets and the sans-I/O
``ClientConnection`` (tests/integration/kimberlite_raw.py), never an SDK, so what is
pinned here is the wire behaviour: handshake and auth, every request and its errors,
frame and request limits, out-of-order answers, credit-based subscriptions and consumer
groups, idempotent appends across restarts, tenant isolation, and durability of
acknowledged appends through SIGKILLs of the server.

Most tests share one server (auth off, tenants 0, 42 and 43); the auth tests share a
second one; tests that stop, kill or restart the server get their own. Each server's log
must be free of errors when it stops. Random choices come from a seed printed by the test
(``HEADWATER_KIMBERLITE_SEED`` replays one; kill moments depend on timing).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import kimberlite_raw as kr
import pytest
from servers import LOCAL, Server, assert_clean_log, serving, stop_cleanly

from headwater.protocols.kimberlite import (
    MAX_APPEND_BYTES,
    MAX_EVENTS,
    MAX_FRAME,
    RESUME_GROUP_OFFSET,
    AppendEventsRequest,
    AppendEventsResponse,
    AppendIdempotentRequest,
    CloseReason,
    CreateStreamRequest,
    CreateStreamResponse,
    DataClass,
    DeleteStreamRequest,
    ErrorCode,
    ErrorResponse,
    EventBatch,
    HandshakeRequest,
    HandshakeResponse,
    ListStreamsRequest,
    Placement,
    QueryAtRequest,
    QueryAtResponse,
    QueryRequest,
    QueryResponse,
    ReadEventsRequest,
    Response,
    ResponsePayload,
    StreamDeletedResponse,
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
)
from headwater.protocols.kimberlite.messages import ripple_port
from waiting import wait_until

RawClient = kr.RawClient
batch = kr.batch
expect_error = kr.expect_error

E = ErrorCode
SHARED_TENANTS = """
[[tenants]]
id = 42
name = "acme"

[[tenants]]
id = 43
name = "history"
"""
AUTH_CONFIG = """
[auth]
required = true

[[auth.tokens]]
token = "s3cret"
tenants = [0, 42]

[[auth.tokens]]
token = "phantom"
tenants = [0, 99]

[[tenants]]
id = 42
name = "acme"
"""
REQUIRED_CAPABILITIES = {"query", "append", "subscribe", "query_at", "sync"}
ADDED_CAPABILITIES = {"idempotent_append", "admin"}
SLOW_SQL = "SELECT sum(hash(range)) FROM range(300000000)"
QUIET = 0.6  # seconds to wait before concluding that nothing more arrives

_names = itertools.count(1)


def unique(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{next(_names)}"


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("HEADWATER_KIMBERLITE_SEED", random.randrange(1 << 32)))
    print(f"HEADWATER_KIMBERLITE_SEED={value}")
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(tmp_path_factory.mktemp("kimberlite"), config=SHARED_TENANTS, clean_log=True)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("kimberlite_auth"), config=AUTH_CONFIG, clean_log=True
    )


@pytest.fixture
def own_server(make_server: Callable[..., Server]) -> Server:
    """A server for this test alone (to stop, kill and restart)."""
    return make_server()


@pytest.fixture
def client(server: Server) -> Iterator[kr.RawClient]:
    with server.client() as c:
        yield c


def list_streams(c: kr.RawClient, tenant_id: int | None = None) -> dict[str, object]:
    reply = c.call(ListStreamsRequest(), tenant_id=tenant_id)
    assert isinstance(reply, StreamsResponse), reply
    return {s.name: s for s in reply.streams}


def every_request(stream_id: int, name: str) -> list[object]:
    """One request of every kind after the handshake (for blanket refusals)."""
    return [
        CreateStreamRequest(name),
        AppendEventsRequest(stream_id, batch([b"x"])),
        QueryRequest("SELECT 1"),
        QueryAtRequest("SELECT 1", [], 0),
        ReadEventsRequest(stream_id, 0, 1000),
        SubscribeRequest(stream_id, 0, 1, None),
        SyncRequest(),
        SubscribeCreditRequest(1, 1),
        UnsubscribeRequest(1),
        AppendIdempotentRequest(stream_id, 1, 0, batch([b"x"])),
        DeleteStreamRequest(stream_id),
        ListStreamsRequest(),
    ]


# ---- subscriptions ----


class Sub:
    """The client side of one subscription: checks every push as it arrives."""

    def __init__(
        self,
        c: kr.RawClient,
        stream_id: int,
        from_offset: int,
        credits: int,
        group: str | None = None,
    ) -> None:
        self.c = c
        self.subscribe_id = c.send(SubscribeRequest(stream_id, from_offset, credits, group))
        reply = c.reply(self.subscribe_id)
        assert isinstance(reply, SubscribeResponse), reply
        self.response = reply
        self.id = reply.subscription_id
        self.next_offset: int | None = None  # offset the next push must start at
        self.events: list[bytes] = []
        self.offsets: list[int] = []
        self.push_sizes: list[int] = []
        self.granted = credits
        self.closed: SubscriptionClosedResponse | None = None

    def _mine(self, r: Response) -> bool:
        p = r.payload
        return (
            isinstance(p, SubscriptionEventsResponse | SubscriptionClosedResponse)
            and p.subscription_id == self.id
        )

    def absorb(self, timeout: float) -> bool:
        """Take one push for this subscription; False when none came in ``timeout``."""
        r = self.c.take(self._mine, timeout)
        if r is None:
            return False
        p = r.payload
        assert r.request_id == self.subscribe_id, (
            f"a push for subscription {self.id} carries request id {r.request_id}, "
            f"not the Subscribe's {self.subscribe_id}: {p!r}"
        )
        if isinstance(p, SubscriptionClosedResponse):
            self.closed = p
            return True
        assert isinstance(p, SubscriptionEventsResponse)
        values = p.events.values()
        assert values, "an empty push"
        assert len(values) <= 64, f"a push of {len(values)} events (at most 64)"
        if len(values) > 1:
            assert sum(map(len, values)) <= 1 << 20, "a push of more than 1 MiB"
        if self.next_offset is not None:
            assert p.start_offset == self.next_offset, (
                f"push starts at {p.start_offset}, expected {self.next_offset}"
            )
        self.offsets.extend(range(p.start_offset, p.start_offset + len(values)))
        self.next_offset = p.start_offset + len(values)
        self.events.extend(values)
        self.push_sizes.append(len(values))
        assert len(self.events) <= self.granted, (
            f"received {len(self.events)} events with {self.granted} credits granted"
        )
        assert len(self.events) + p.credits_remaining <= self.granted, (
            f"credits_remaining {p.credits_remaining} after {len(self.events)} of "
            f"{self.granted} credits"
        )
        return True

    def collect(self, total: int, timeout: float = 15.0) -> list[bytes]:
        """Absorb pushes until ``total`` events have arrived in all."""
        deadline = time.monotonic() + timeout
        while len(self.events) < total:
            assert self.closed is None, f"closed early: {self.closed}"
            if not self.absorb(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"only {len(self.events)} of {total} events arrived")
        assert len(self.events) == total, f"{len(self.events)} events, expected {total}"
        return self.events

    def assert_silent(self, duration: float = QUIET) -> None:
        before = len(self.events)
        got = self.absorb(duration)
        assert not got, (
            f"pushed after it should have stopped: {len(self.events) - before} more events, "
            f"closed={self.closed}"
        )

    def grant(self, credits: int) -> int:
        rid = self.c.send(SubscribeCreditRequest(self.id, credits))
        self.granted += credits
        reply = self.c.reply(rid)
        assert isinstance(reply, SubscriptionCreditResponse), reply
        assert reply.subscription_id == self.id
        return reply.credits

    def wait_closed(self, timeout: float = 10.0) -> SubscriptionClosedResponse:
        deadline = time.monotonic() + timeout
        while self.closed is None:
            if not self.absorb(max(0.0, deadline - time.monotonic())):
                raise AssertionError("no SubscriptionClosed arrived")
        return self.closed


def fill(c: kr.RawClient, stream_id: int, events: list[bytes], chunk: int = 50) -> None:
    for i in range(0, len(events), chunk):
        kr.append(c, stream_id, events[i : i + chunk])


# ==== handshake ====


def test_requests_before_the_handshake_are_refused_with_their_ids(
    server: Server,
) -> None:
    name = unique("early")
    with RawClient(server.port, handshake=False) as c:
        for payload in [
            CreateStreamRequest(name),
            ListStreamsRequest(),
            SyncRequest(),
            QueryRequest("SELECT 1"),
            AppendEventsRequest(1, batch([b"x"])),
            SubscribeRequest(1, 0, 10, None),
        ]:
            rid = c.send(payload)
            response = c.response(rid)
            assert response.request_id == rid
            expect_error(response.payload, E.INVALID_REQUEST, type(payload).__name__)
        # A malformed payload before the handshake: refused the same way, still open.
        c.send_raw(kr.frame(kr.request_envelope(777, 0, 99, b"")))
        expect_error(c.response(777).payload, E.INVALID_REQUEST, "bad payload")
        hello = c.call_payload(c.conn.handshake())
        assert isinstance(hello, HandshakeResponse), hello
        assert hello.server_version == 1
        assert hello.authenticated is True  # auth is off by default
        caps = list(hello.capabilities)
        assert len(caps) == len(set(caps)), caps
        assert set(caps) >= REQUIRED_CAPABILITIES | ADDED_CAPABILITIES, caps
        assert not [cap for cap in caps if cap.startswith("ripple:")], "the Ripple listener is off"
        assert name not in list_streams(c), "a request before the handshake was carried out"
        assert isinstance(c.call(SyncRequest()), SyncResponse)


def test_handshake_advertises_the_ripple_port(tmp_path: Path) -> None:
    """A client finds the Ripple listener through the Handshake: ``ripple:<bound port>``
    (here a port the server picked, so not the default 7403)."""
    srv = Server(tmp_path / "ripple_on", listen={"ripple": LOCAL}).start()
    try:
        ripple = srv.ports["ripple"]
        with RawClient(srv.port, handshake=False) as c:
            hello = c.call_payload(c.conn.handshake())
        assert isinstance(hello, HandshakeResponse), hello
        assert [cap for cap in hello.capabilities if cap.startswith("ripple:")] == [
            f"ripple:{ripple}"
        ]
        assert set(hello.capabilities) >= REQUIRED_CAPABILITIES | ADDED_CAPABILITIES
        assert ripple_port(hello.capabilities) == ripple
    finally:
        stop_cleanly(srv, clean_log=True)


def test_ripple_port_ignores_what_it_does_not_know() -> None:
    assert ripple_port(["query", "ripple:17403", "ripple:1"]) == 17403  # the first one
    assert ripple_port(["ripple:", "ripple:x", "ripple:99999", "ripple:0", "rippled:5"]) is None
    assert ripple_port([]) is None


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_unsupported_client_version_is_invalid_request(server: Server, version: int) -> None:
    with RawClient(server.port, handshake=False) as c:
        rid = c.send(HandshakeRequest(client_version=version))
        expect_error(c.reply(rid), E.INVALID_REQUEST, f"client_version {version}")
        # A proper handshake afterwards is welcome.
        hello = c.call(HandshakeRequest(client_version=1))
        assert isinstance(hello, HandshakeResponse), hello


def test_auth_is_off_by_default(server: Server) -> None:
    with server.client() as c:
        assert c.handshake_response is not None and c.handshake_response.authenticated
        # Any configured tenant can be used without a token; others do not exist.
        assert isinstance(c.call(ListStreamsRequest(), tenant_id=42), StreamsResponse)
        assert isinstance(c.call(SyncRequest(), tenant_id=0), SyncResponse)
        expect_error(c.call(ListStreamsRequest(), tenant_id=7), E.TENANT_NOT_FOUND)
        expect_error(c.call(CreateStreamRequest(unique("t7")), tenant_id=7), E.TENANT_NOT_FOUND)


# ==== auth ====


@pytest.mark.parametrize("token", ["wrong", None, ""])
def test_auth_unknown_token_fails_every_later_request(
    auth_server: Server, token: str | None
) -> None:
    name = unique("unauth")
    with auth_server.client(token=token) as c:
        assert c.handshake_response is not None
        assert c.handshake_response.authenticated is False
        for tenant in (0, 42, 7):
            for payload in every_request(1, name):
                reply = c.call(payload, tenant_id=tenant)  # type: ignore[arg-type]
                expect_error(reply, E.AUTHENTICATION_FAILED, f"{payload!r} tenant {tenant}")
    with auth_server.client(token="s3cret") as good:
        assert name not in list_streams(good, 0)


def test_auth_token_grants_only_its_tenants(auth_server: Server) -> None:
    with auth_server.client(token="s3cret") as c:
        assert c.handshake_response is not None and c.handshake_response.authenticated
        for payload in every_request(1, unique("t7")):
            reply = c.call(payload, tenant_id=7)  # type: ignore[arg-type]
            expect_error(reply, E.AUTHENTICATION_FAILED, f"{payload!r} tenant 7")
        # Tenant 42 (configured, granted) and tenant 0 (always there, granted) work.
        for tenant in (42, 0):
            sid = kr.create_stream(c, unique("granted"), tenant_id=tenant)
            kr.append(c, sid, [b"ok"], tenant_id=tenant)
            assert kr.read(c, sid, tenant_id=tenant) == ([b"ok"], None)


def test_auth_granted_but_missing_tenant_is_tenant_not_found(
    auth_server: Server,
) -> None:
    with auth_server.client(token="phantom") as c:
        assert c.handshake_response is not None and c.handshake_response.authenticated
        for payload in (ListStreamsRequest(), SyncRequest(), CreateStreamRequest(unique("p"))):
            expect_error(c.call(payload, tenant_id=99), E.TENANT_NOT_FOUND, repr(payload))
        # 42 exists but this token does not grant it.
        expect_error(c.call(ListStreamsRequest(), tenant_id=42), E.AUTHENTICATION_FAILED)
        assert isinstance(c.call(ListStreamsRequest(), tenant_id=0), StreamsResponse)


def test_auth_a_refused_handshake_grants_nothing(auth_server: Server) -> None:
    """A Handshake refused for its client_version must not leave the session open: with
    auth required, the requests after it are refused, never served."""
    name = unique("bypass")
    with RawClient(auth_server.port, handshake=False) as c:
        rid = c.send(HandshakeRequest(client_version=2, auth_token=None))
        expect_error(c.reply(rid), E.INVALID_REQUEST, "client_version 2")
        for payload in (ListStreamsRequest(), CreateStreamRequest(name)):
            reply = c.call(payload, tenant_id=0)
            assert isinstance(reply, ErrorResponse) and reply.code in (
                E.INVALID_REQUEST,
                E.AUTHENTICATION_FAILED,
            ), f"{payload!r} after a refused handshake, with auth required: {reply!r}"
    with auth_server.client(token="s3cret") as good:
        assert name not in list_streams(good, 0), "created without authenticating"


def test_tenants_are_isolated(auth_server: Server) -> None:
    with auth_server.client(token="s3cret") as c:
        name = unique("iso")
        ids42 = [
            kr.create_stream(c, name, tenant_id=42),
            kr.create_stream(c, unique("iso"), tenant_id=42),
        ]
        kr.append(c, ids42[0], [b"tenant 42"], tenant_id=42)
        zero_ids = {s.stream_id for s in list_streams(c, 0).values()}  # type: ignore[attr-defined]
        foreign = [sid for sid in ids42 if sid not in zero_ids]
        assert foreign, "tenant 0 already holds every stream id tenant 42 has"
        for sid in foreign:
            for payload in (
                ReadEventsRequest(sid, 0, 100),
                AppendEventsRequest(sid, batch([b"intruder"])),
                AppendIdempotentRequest(sid, 5, 0, batch([b"intruder"])),
                SubscribeRequest(sid, 0, 10, None),
                DeleteStreamRequest(sid),
            ):
                reply = c.call(payload, tenant_id=0)
                expect_error(reply, E.STREAM_NOT_FOUND, f"{payload!r} from tenant 0")
        assert name not in list_streams(c, 0)
        # The same name in tenant 0 is another stream.
        id0 = kr.create_stream(c, name, tenant_id=0)
        kr.append(c, id0, [b"tenant 0", b"again"], tenant_id=0)
        assert kr.read_all(c, ids42[0], tenant_id=42) == [b"tenant 42"]
        assert kr.read_all(c, id0, tenant_id=0) == [b"tenant 0", b"again"]
        assert kr.query(c, f"SELECT count(*) FROM {name}", tenant_id=42).rows == [[1]]
        assert kr.query(c, f"SELECT count(*) FROM {name}", tenant_id=0).rows == [[2]]
        only0 = unique("only0")
        kr.create_stream(c, only0, tenant_id=0)
        expect_error(
            c.call(QueryRequest(f"SELECT * FROM {only0}", []), tenant_id=42), E.TABLE_NOT_FOUND
        )
        assert only0 not in list_streams(c, 42)
        # A subscription belongs to its tenant, even on the same connection.
        rid = c.send(SubscribeRequest(ids42[0], 0, 0, None), tenant_id=42)
        reply = c.reply(rid)
        assert isinstance(reply, SubscribeResponse), reply
        expect_error(
            c.call(SubscribeCreditRequest(reply.subscription_id, 1), tenant_id=0),
            E.INVALID_REQUEST,
        )


# ==== streams ====


def test_create_stream_names(client: kr.RawClient) -> None:
    invalid = [
        "",
        "with space",
        ".",
        "..",
        "slash/name",
        "naïve",
        "x" * 257,
        "hw_reserved",
        "convergedb_reserved",
        "semi;colon",
        "new\nline",
    ]
    for name in invalid:
        expect_error(client.call(CreateStreamRequest(name)), E.INVALID_REQUEST, repr(name))
    listed = list_streams(client)
    assert not set(invalid) & set(listed)
    long_name = "L" + "x_9" * 85  # 256 characters
    assert len(long_name) == 256
    suffix = unique("n")
    valid = [long_name, f"Case_{suffix}", f"case_{suffix}", f"9_{suffix}", f"HW_{suffix}"]
    ids = {}
    for i, name in enumerate(valid):
        payload = CreateStreamRequest(name, DataClass(i % 3), Placement(i % 2))
        reply = client.call(payload)
        assert isinstance(reply, CreateStreamResponse), f"{name!r}: {reply!r}"
        ids[name] = reply.stream_id
    assert len(set(ids.values())) == len(valid), ids
    for name in valid:
        expect_error(client.call(CreateStreamRequest(name)), E.STREAM_ALREADY_EXISTS, name)
    listed = list_streams(client)
    for name, sid in ids.items():
        assert listed[name].stream_id == sid  # type: ignore[attr-defined]


def test_list_and_delete_streams(server: Server, client: kr.RawClient) -> None:
    name = unique("del")
    before = time.time_ns()
    sid = kr.create_stream(client, name)
    after = time.time_ns()
    events = [b"a" * 10, b"b" * 20, b"c" * 30]
    kr.append(client, sid, events)
    info = list_streams(client)[name]
    assert info.stream_id == sid  # type: ignore[attr-defined]
    assert info.next_offset == 3  # type: ignore[attr-defined]
    assert info.size_bytes >= 60  # type: ignore[attr-defined]
    assert before - 1_000_000_000 <= info.created_ns <= after + 1_000_000_000  # type: ignore[attr-defined]

    with server.client() as watcher:
        sub = Sub(watcher, sid, 0, 100)
        sub.collect(3)
        reply = client.call(DeleteStreamRequest(sid))
        assert reply == StreamDeletedResponse(sid), reply
        closed = sub.wait_closed()
        assert closed.reason == CloseReason.STREAM_DELETED
    assert name not in list_streams(client)
    for payload in (
        DeleteStreamRequest(sid),
        ReadEventsRequest(sid, 0, 100),
        AppendEventsRequest(sid, batch([b"late"])),
        AppendIdempotentRequest(sid, 1, 0, batch([b"late"])),
        SubscribeRequest(sid, 0, 1, None),
    ):
        expect_error(client.call(payload), E.STREAM_NOT_FOUND, repr(payload))
    expect_error(client.call(QueryRequest(f"SELECT count(*) FROM {name}")), E.TABLE_NOT_FOUND)
    # The name is free again: a new, empty stream.
    new_id = kr.create_stream(client, name)
    assert new_id != sid
    assert kr.read(client, new_id) == ([], None)
    kr.append(client, new_id, [b"fresh"])
    assert kr.query(client, f"SELECT count(*) FROM {name}").rows == [[1]]


# ==== appends ====


def test_append_limits(client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("limits"))
    refused = {
        "no events": EventBatch.of([]),
        "10,001 events": EventBatch.of([b"e"] * (MAX_EVENTS + 1)),
        "4 MiB + 1 in one event": EventBatch.of([b"\x01" * (MAX_APPEND_BYTES + 1)]),
        "4 MiB + 1 in ten events": EventBatch.of(
            [b"\x02" * (MAX_APPEND_BYTES // 10)] * 9
            + [b"\x02" * (MAX_APPEND_BYTES - 9 * (MAX_APPEND_BYTES // 10) + 1)]
        ),
    }
    for what, events in refused.items():
        expect_error(client.call(AppendEventsRequest(sid, events)), E.INVALID_REQUEST, what)
        expect_error(
            client.call(AppendIdempotentRequest(sid, 9, 0, events)), E.INVALID_REQUEST, what
        )
    assert kr.read(client, sid) == ([], None), "a refused append stored something"
    assert list_streams(client)  # still answering
    # The limits themselves are accepted.
    many = [bytes([i % 251]) for i in range(MAX_EVENTS)]
    reply = client.call(AppendEventsRequest(sid, batch(many)))
    assert reply == AppendEventsResponse(0, MAX_EVENTS), reply
    half = MAX_APPEND_BYTES // 2
    big = [b"\xaa" * half, b"\xbb" * half]
    reply = client.call(AppendEventsRequest(sid, batch(big)))
    assert reply == AppendEventsResponse(MAX_EVENTS, 2), reply
    whole = [b"\xcc" * MAX_APPEND_BYTES]
    reply = client.call(AppendIdempotentRequest(sid, 9, 0, batch(whole)))  # seq 0 unused so far
    assert reply == AppendEventsResponse(MAX_EVENTS + 2, 1), reply
    # Read back: every byte, and at least one event however small max_bytes is.
    assert kr.read_all(client, sid)[:MAX_EVENTS] == many
    assert kr.read(client, sid, MAX_EVENTS, 1) == ([big[0]], MAX_EVENTS + 1)
    assert kr.read(client, sid, MAX_EVENTS + 1, 0) == ([big[1]], MAX_EVENTS + 2)
    assert kr.read(client, sid, MAX_EVENTS + 2, 1 << 30) == (whole, None)


# ==== frames ====


@pytest.mark.parametrize("handshaken", [False, True], ids=["fresh", "handshaken"])
@pytest.mark.parametrize(
    "data",
    [
        kr.header(0xFFFFFFFF),
        kr.header(0xFFFFFFFF)[:10],
        kr.header(MAX_FRAME + 1),
    ],
    ids=["4GiB-header", "4GiB-10-bytes", "16MiB+1-header"],
)
def test_oversized_frame_is_refused_from_its_header(
    server: Server, handshaken: bool, data: bytes
) -> None:
    """Only the header is sent: the server must answer and close without waiting for (or
    allocating) the payload it announces."""
    with RawClient(server.port, handshake=handshaken) as c:
        c.send_raw(data)
        responses = c.wait_closed(timeout=5)
        assert [r.request_id for r in responses] == [0], responses
        expect_error(responses[0].payload, E.INVALID_REQUEST)
    with server.client() as other:
        assert isinstance(other.call(SyncRequest()), SyncResponse)


@pytest.mark.parametrize("version", [0, 2, 0x0100])
def test_frame_version_other_than_1_is_refused(server: Server, version: int) -> None:
    with RawClient(server.port) as c:
        payload = kr.request_envelope(c.next_id(), 0, 7, b"")  # a Sync
        c.send_raw(kr.frame(payload, version=version))
        responses = c.wait_closed(timeout=5)
        assert [r.request_id for r in responses] == [0], responses
        expect_error(responses[0].payload, E.INVALID_REQUEST)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"VDB!" + bytes(10),
        b"\x00" * 14,
        b"XDB " + struct.pack(">HII", 2, 0xFFFFFFFF, 0),  # magic is checked first
    ],
    ids=["http", "magic-last-byte", "zeros", "bad-magic-then-oversize"],
)
def test_bad_magic_closes_silently(server: Server, garbage: bytes) -> None:
    with RawClient(server.port, handshake=False) as c:
        c.send_raw(garbage)
        assert c.wait_closed(timeout=5) == []
        assert bytes(c.raw_received) == b""


def test_bad_crc_closes_silently(server: Server) -> None:
    with RawClient(server.port) as c:
        received = len(c.raw_received)
        payload = kr.request_envelope(c.next_id(), 0, 12, b"")  # ListStreams
        good = kr.frame(payload)
        c.send_raw(kr.frame(payload, crc=struct.unpack(">I", good[10:14])[0] ^ 1))
        assert c.wait_closed(timeout=5) == []
        assert len(c.raw_received) == received, "answered a frame whose CRC was wrong"


def test_max_size_frame_passes_framing_and_append_limit_answers(
    server: Server, client: kr.RawClient
) -> None:
    """A payload of exactly 16 MiB is a valid frame; an append that big breaks the 4 MiB
    limit, which is a request error (with its id) on a connection that stays open."""
    sid = kr.create_stream(client, unique("bigframe"))
    rid = client.next_id()
    envelope = struct.pack("<QQIQ", rid, 0, 2, sid)  # id, tenant, AppendEvents, stream_id
    event_len = MAX_FRAME - len(envelope) - 8 - 8  # count, then the event's length
    body = envelope + struct.pack("<QQ", 1, event_len) + b"\x5a" * event_len
    assert len(body) == MAX_FRAME
    client.send_raw(kr.frame(body))
    expect_error(client.reply(rid, timeout=30), E.INVALID_REQUEST, "16 MiB append")
    assert isinstance(client.call(SyncRequest()), SyncResponse)
    assert kr.read(client, sid) == ([], None)


def test_malformed_payloads_in_intact_frames(client: kr.RawClient) -> None:
    u64 = struct.Struct("<Q").pack
    cases = [
        ("unknown discriminant", 501, kr.request_envelope(501, 0, 99, b"")),
        ("trailing byte", 502, kr.request_envelope(502, 0, 7, b"\x00")),
        ("too short for an id", 0, b"\x01\x02\x03"),
        ("no discriminant", 503, u64(503) + u64(0)),
        (
            "invalid UTF-8 name",
            504,
            kr.request_envelope(504, 0, 1, u64(2) + b"\xff\xfe" + bytes(8)),
        ),
        (
            "unknown data_class",
            505,
            kr.request_envelope(505, 0, 1, u64(1) + b"a" + b"\x09" + bytes(7)),
        ),
        ("string past the end", 506, kr.request_envelope(506, 0, 3, u64(1 << 40) + b"SELECT")),
        (
            "fewer events than counted",
            507,
            kr.request_envelope(507, 0, 2, u64(1) + u64(3) + u64(1) + b"a" + u64(1) + b"b"),
        ),
        ("2^40 events claimed", 508, kr.request_envelope(508, 0, 2, u64(1) + u64(1 << 40))),
        (
            "20,000 empty events",
            509,
            kr.request_envelope(509, 0, 2, u64(1) + u64(20000) + bytes(8 * 20000)),
        ),
        (
            "bad option tag",
            510,
            kr.request_envelope(510, 0, 6, u64(1) + u64(0) + bytes(4) + b"\x02\x00\x00\x00"),
        ),
        (
            "bad param kind",
            511,
            kr.request_envelope(511, 0, 3, u64(1) + b"1" + u64(1) + b"\x09\x00\x00\x00"),
        ),
        (
            "bad bool param",
            512,
            kr.request_envelope(512, 0, 3, u64(1) + b"1" + u64(1) + b"\x03\x00\x00\x00\x02"),
        ),
    ]
    for what, rid, payload in cases:
        client.send_raw(kr.frame(payload))
        response = client.response(rid)
        expect_error(response.payload, E.INVALID_REQUEST, what)
    assert client.pending == [], client.pending
    assert isinstance(client.call(SyncRequest()), SyncResponse)


def test_request_ids_are_the_clients(client: kr.RawClient) -> None:
    for rid in (2**64 - 1, 0, 123456789, 1):
        client.send_raw(kr.frame(kr.request_envelope(rid, 0, 7, b"")))  # Sync
        response = client.response(rid)
        assert response == Response(rid, SyncResponse(True)), response


# ==== reads ====


def test_read_events_semantics(client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("read"))
    assert kr.read(client, sid, 0) == ([], None), "empty stream"
    events = [b"a" * 10, b"b" * 20, b"c" * 30, b"d" * 40, b""]
    kr.append(client, sid, events[:2])
    kr.append(client, sid, events[2:])
    cases = {
        (0, 1 << 20): (events, None),
        (0, 100): (events, None),  # 100 exactly: the empty event fits too
        (0, 99): (events[:3], 3),
        (0, 35): (events[:2], 2),
        (0, 30): (events[:2], 2),  # exactly at the limit
        (0, 29): (events[:1], 1),
        (0, 0): (events[:1], 1),  # always at least one
        (1, 5): (events[1:2], 2),
        (2, 30): (events[2:3], 3),
        (3, 1): (events[3:4], 4),
        (3, 40): (events[3:], None),
        (4, 0): (events[4:], None),
        (5, 100): ([], None),  # at the end
        (6, 100): ([], None),  # beyond it
        (1 << 40, 100): ([], None),
        (2**64 - 1, 100): ([], None),
    }
    for (start, max_bytes), expected in cases.items():
        got = kr.read(client, sid, start, max_bytes)
        assert got == expected, f"ReadEvents(from {start}, max_bytes {max_bytes}): {got}"
    expect_error(client.call(ReadEventsRequest(10**9, 0, 100)), E.STREAM_NOT_FOUND)


# ==== SQL ====


def test_query_values_and_params(client: kr.RawClient) -> None:
    name = unique("sql")
    sid = kr.create_stream(client, name)
    t0 = time.time_ns()
    events = [b'{"n": 1}', b'{"n": 2, "s": "x"}', b"\x00\xffraw"]
    kr.append(client, sid, events)
    t1 = time.time_ns()
    reply = kr.query(client, f'SELECT "offset", position, ts, data, json FROM {name} ORDER BY 1')
    assert list(reply.columns) == ["offset", "position", "ts", "data", "json"]
    rows = kr.rows_of(reply)
    assert [r[0] for r in rows] == [0, 1, 2]
    positions = [r[1] for r in rows]
    assert all(isinstance(p, int) for p in positions) and positions == sorted(set(positions))
    for row, event in zip(rows, events, strict=True):
        assert isinstance(row[2], Timestamp) and t0 - 10**9 <= row[2].ns <= t1 + 10**9, row
        assert row[3] == event.hex(), row
    assert json.loads(rows[0][4]) == {"n": 1}
    assert json.loads(rows[1][4]) == {"n": 2, "s": "x"}
    assert rows[2][4] is None  # not JSON

    cases: list[tuple[str, list[object], list[list[object]]]] = [
        (f'SELECT count(*) FROM {name} WHERE "offset" >= $1', [1], [[2]]),
        (f'SELECT "offset" FROM {name} WHERE "offset" = ?', [2], [[2]]),
        ("SELECT $1::BIGINT + 1", [41], [[42]]),
        ("SELECT ? || '!'", ["hi"], [["hi!"]]),
        ("SELECT $2, $1", ["one", "two"], [["two", "one"]]),
        ("SELECT ?, ? IS NULL", [True, None], [[True, True]]),
        (
            "SELECT ?::TIMESTAMP_NS",
            [Timestamp(1_700_000_000_123_456_789)],
            [[Timestamp(1_700_000_000_123_456_789)]],
        ),
        ("SELECT $1, $2", [-(2**63), 2**63 - 1], [[-(2**63), 2**63 - 1]]),
        ("SELECT 0.1::DOUBLE, 'ab'::BLOB", [], [["0.1", "6162"]]),
        (
            "SELECT DATE '2024-01-02', [1, 2], 1.50::DECIMAL(4, 2)",
            [],
            [["2024-01-02", "[1, 2]", "1.50"]],
        ),
        (f"SELECT count(*) FROM {name} WHERE json->>'s' = ?", ["x"], [[1]]),
    ]
    for sql, params, expected in cases:
        got = kr.rows_of(kr.query(client, sql, params))
        assert got == expected, f"{sql} {params}: {got}"


def test_query_errors(client: kr.RawClient) -> None:
    name = unique("sqlerr")
    sid = kr.create_stream(client, name)
    kr.append(client, sid, [b"x"])
    for sql, code in [
        ("SELEC 1", E.QUERY_PARSE_ERROR),
        ("SELECT (1", E.QUERY_PARSE_ERROR),
        ("", E.QUERY_PARSE_ERROR),
        ("SELECT * FROM no_such_table_anywhere", E.TABLE_NOT_FOUND),
        (f"UPDATE {name} SET data = NULL", E.QUERY_EXECUTION_ERROR),
        (f"DELETE FROM {name}", E.QUERY_EXECUTION_ERROR),
        (f"DROP TABLE {name}", E.QUERY_EXECUTION_ERROR),
    ]:
        expect_error(client.call(QueryRequest(sql, [])), code, sql)
        expect_error(client.call(QueryAtRequest(sql, [], 0)), code, f"QueryAt {sql}")
    for position in (2**63, 2**64 - 1):
        expect_error(
            client.call(QueryAtRequest("SELECT 1", [], position)), E.POSITION_AHEAD, str(position)
        )
    assert kr.query(client, f"SELECT count(*) FROM {name}").rows == [[1]]


def test_a_result_over_the_frame_limit_is_an_error_not_silence(client: kr.RawClient) -> None:
    """A query answer must fit one 16 MiB frame: one just past it gets an error naming the
    limit, one just under it arrives whole, and the connection keeps serving."""
    name = unique("big")
    sid = kr.create_stream(client, name)
    kr.append(client, sid, [b"x" * 1000] * 17)
    # Text values travel as u64 length + bytes; 17 rows of 1 MiB are over the limit.
    [[head]] = kr.query(client, f"SELECT max(position) + 1 FROM {name}").rows
    over = f"SELECT repeat(decode(data), 1024) FROM {name}"
    for request in (QueryRequest(over, []), QueryAtRequest(over, [], head)):
        reply = client.call(request, timeout=60)
        expect_error(reply, E.QUERY_EXECUTION_ERROR, over)
        assert isinstance(reply, ErrorResponse) and "frame limit" in reply.message
    under = f"SELECT repeat(decode(data), 1024) FROM {name} LIMIT 15"
    assert [len(r[0]) for r in kr.query(client, under, timeout=60).rows] == [1024_000] * 15
    assert kr.query(client, f"SELECT count(*) FROM {name}").rows == [[17]]


def test_insert_into_appends(client: kr.RawClient) -> None:
    name = unique("ins")
    sid = kr.create_stream(client, name)
    kr.append(client, sid, [b"first"])
    reply = kr.query(client, f"INSERT INTO {name} (data) VALUES ('hello'), (?)", ["world"])
    assert list(reply.columns) == ["rows_affected", "log_offset"]
    assert kr.rows_of(reply) == [[2, 1]]
    assert kr.read_all(client, sid) == [b"first", b"hello", b"world"]


def test_query_reads_your_writes(server: Server, client: kr.RawClient) -> None:
    """A Query sees every event acknowledged before it arrived, whichever connection
    appended it and whichever stream it went to."""
    names = [unique("ryw"), unique("ryw")]
    ids = [kr.create_stream(client, n) for n in names]
    sql = f"SELECT (SELECT count(*) FROM {names[0]}), (SELECT count(*) FROM {names[1]})"
    total = [0, 0]
    with server.client() as reader:
        for i in range(16):
            which = i % 2
            n = 1 + i % 4
            if i % 4 == 3:
                values = ", ".join(f"('{i}')" for _ in range(n))
                kr.query(client, f"INSERT INTO {names[which]} (data) VALUES {values}")
            else:
                kr.append(client, ids[which], [b"%d" % i] * n)
            total[which] += n
            assert kr.query(reader, sql).rows == [total], f"after append {i}"


def test_query_at_sees_exactly_the_first_p_positions(server: Server) -> None:
    """Tenant 43 is this test's alone: its log starts at position 0."""
    with server.client(43) as c:
        assert list_streams(c) == {}, "tenant 43 must be fresh"
        ids = {"qa": kr.create_stream(c, "qa"), "qb": kr.create_stream(c, "qb")}
        history = [("qa", 2), ("qb", 3), ("qa", 1), ("qb", 1), ("qb", 2), ("qa", 4)]
        expected_rows = []  # (stream, offset, position) in position order
        offsets = {"qa": 0, "qb": 0}
        position = 0
        for stream, n in history:
            reply = kr.append(
                c, ids[stream], [f"{stream}{offsets[stream] + i}".encode() for i in range(n)]
            )
            assert reply.first_offset == offsets[stream]
            for _ in range(n):
                expected_rows.append([stream, offsets[stream], position])
                offsets[stream] += 1
                position += 1
        head = position
        sql = (
            "SELECT 'qa' AS s, \"offset\", position FROM qa "
            "UNION ALL SELECT 'qb', \"offset\", position FROM qb ORDER BY position"
        )
        assert kr.rows_of(kr.query(c, sql)) == expected_rows
        for p in range(head + 1):
            reply = c.call(QueryAtRequest(sql, [], p))
            assert isinstance(reply, QueryAtResponse), f"QueryAt({p}): {reply!r}"
            assert kr.rows_of(reply) == expected_rows[:p], f"QueryAt({p})"
            counted = c.call(QueryAtRequest("SELECT count(*) FROM qb WHERE position < $1", [p], p))
            assert kr.rows_of(counted) == [[sum(1 for r in expected_rows[:p] if r[0] == "qb")]]
        for p in (head + 1, head + 1000, 2**64 - 1):
            expect_error(c.call(QueryAtRequest(sql, [], p)), E.POSITION_AHEAD, f"QueryAt({p})")
        # Appending moves the head: the old "ahead" position becomes valid.
        kr.append(c, ids["qb"], [b"late"])

        def answered() -> ResponsePayload | None:
            # The projections may not have reached the new head yet: retryable.
            reply = c.call(QueryAtRequest("SELECT count(*) FROM qb", [], head + 1))
            lagging = isinstance(reply, ErrorResponse) and reply.code == E.PROJECTION_LAG
            return None if lagging else reply

        reply = wait_until(answered, 10, "QueryAt never caught up with the head")
        assert kr.rows_of(reply) == [[offsets["qb"] + 1]]
        assert kr.rows_of(c.call(QueryAtRequest("SELECT count(*) FROM qb", [], head))) == [
            [offsets["qb"]]
        ]


def test_sync(client: kr.RawClient, server: Server) -> None:
    sid = kr.create_stream(client, unique("sync"))
    kr.append(client, sid, [b"x"])
    assert client.call(SyncRequest()) == SyncResponse(True)
    assert client.call(SyncRequest(), tenant_id=43) == SyncResponse(True)


# ==== out-of-order answers ====


def test_a_slow_query_does_not_hold_up_an_append(client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("ooo"))
    started = time.monotonic()
    slow = client.send(QueryRequest(SLOW_SQL, []))
    fast = client.send(AppendEventsRequest(sid, batch([b"quick"])))
    first = client.next_response(timeout=60)
    first_at = time.monotonic() - started
    second = client.next_response(timeout=60)
    both_at = time.monotonic() - started
    assert first is not None and second is not None
    assert first.request_id == fast, (
        f"the append (id {fast}) was answered after the query (id {slow}): "
        f"{first.request_id} came first"
    )
    assert first.payload == AppendEventsResponse(0, 1), first
    assert second.request_id == slow and isinstance(second.payload, QueryResponse), second
    assert both_at - first_at > 0.2, (
        f"the query took {both_at:.2f}s: too fast to show the order ({first_at:.2f}s)"
    )


def test_requests_sent_before_a_half_close_are_answered(
    server: Server, client: kr.RawClient
) -> None:
    """A client that sends its requests and then shuts down its sending side (as
    ``nc -q``, or any client done writing) still gets every answer before the server
    closes: above all the append's, which is carried out either way."""
    sid = kr.create_stream(client, unique("halfclose"))
    with server.client() as c:
        sync = c.send(SyncRequest())
        slow = c.send(QueryRequest("SELECT sum(hash(range)) FROM range(50000000)", []))
        add = c.send(AppendEventsRequest(sid, batch([b"written"])))
        c.sock.shutdown(socket.SHUT_WR)
        responses = {r.request_id: r.payload for r in c.wait_closed(timeout=30)}
    # The append is carried out, answered or not ...
    wait_until(lambda: kr.read_all(client, sid), 10, "the append was not carried out")
    assert kr.read_all(client, sid) == [b"written"]
    assert responses.get(add) == AppendEventsResponse(0, 1), (
        f"... but its answer was dropped: got {responses}"
    )
    assert responses.get(sync) == SyncResponse(True)
    assert isinstance(responses.get(slow), QueryResponse)


# ==== subscriptions ====


def test_subscription_credits_bound_delivery(server: Server, client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("credit"))
    events = [b"e%04d" % i for i in range(300)]
    fill(client, sid, events[:100])
    with server.client() as c:
        sub = Sub(c, sid, 0, 10)
        assert sub.response.start_offset == 0 and sub.response.credits == 10
        assert sub.collect(10) == events[:10]
        sub.assert_silent()  # 90 more are there, but no credit
        assert sub.grant(25) == 25  # the balance after the grant
        assert sub.collect(35) == events[:35]
        sub.assert_silent()
        # Grants add up; pushes stay within 64 events.
        assert sub.grant(100) == 100
        assert sub.grant(100) in range(100, 201)
        sub.collect(100)
        fill(client, sid, events[100:300])
        sub.collect(235)
        sub.assert_silent()
        assert sub.events == events[:235]
        assert sub.offsets == list(range(235))
        assert max(sub.push_sizes) <= 64 and 64 in sub.push_sizes, sub.push_sizes
        assert sub.grant(0) == 0
        sub.assert_silent(0.2)


def test_subscription_pushes_stay_under_one_mib(server: Server, client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("mib"))
    events = [bytes([i]) * 100_000 for i in range(30)]
    fill(client, sid, events, chunk=10)
    with server.client() as c:
        sub = Sub(c, sid, 0, 1000)
        assert sub.collect(30) == events
        assert max(sub.push_sizes) <= 10, sub.push_sizes  # 10 x 100 kB <= 1 MiB < 11 x


def test_subscription_exactly_once_while_appends_continue(
    server: Server, client: kr.RawClient, seed: int
) -> None:
    rng = random.Random(seed)
    sid = kr.create_stream(client, unique("live"))
    total = 600
    appended: list[bytes] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with server.client() as w:
                wrng = random.Random(seed + 1)
                i = 0
                while i < total:
                    n = min(total - i, wrng.randint(1, 9))
                    chunk = [
                        b"live-%05d-" % (i + k) + wrng.randbytes(wrng.randint(0, 40))
                        for k in range(n)
                    ]
                    reply = kr.append(w, sid, chunk)
                    assert reply.first_offset == i
                    appended.extend(chunk)
                    i += n  # each append waits for its answer: it paces the writer
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=writer, daemon=True)
    with server.client() as c:
        sub = Sub(c, sid, 0, 13)
        thread.start()
        deadline = time.monotonic() + 60
        while len(sub.events) < total:
            assert time.monotonic() < deadline, f"stuck at {len(sub.events)} events"
            assert not errors, errors
            if len(sub.events) == sub.granted:  # out of credit: nothing may come now
                if rng.random() < 0.2:
                    sub.assert_silent(0.05)
                sub.grant(rng.randint(1, 40))
            else:
                sub.absorb(1.0)
        thread.join(30)
        assert not errors, errors
        assert sub.offsets == list(range(total))
        assert sub.events == appended, "events lost, repeated or out of order"
        extra = sub.granted - total
        if extra:
            kr.append(client, sid, [b"after"] * (extra + 5))
            sub.collect(total + extra)
        sub.assert_silent()


def test_unsubscribe_stops_delivery(server: Server, client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("unsub"))
    fill(client, sid, [b"u%d" % i for i in range(5)])
    with server.client() as c:
        sub = Sub(c, sid, 0, 1000)
        sub.collect(5)
        rid = c.send(UnsubscribeRequest(sub.id))
        response = c.take(lambda r: r.request_id == rid)
        assert response is not None, "no answer to Unsubscribe"
        assert response.payload == SubscriptionClosedResponse(sub.id, CloseReason.CLIENT_CANCELLED)
        fill(client, sid, [b"v%d" % i for i in range(20)])
        later = c.drain(QUIET)
        assert not [r for r in later if kr.is_push(r, sub.id)], later
        expect_error(c.call(SubscribeCreditRequest(sub.id, 5)), E.INVALID_REQUEST, "credit")
        expect_error(c.call(UnsubscribeRequest(sub.id)), E.INVALID_REQUEST, "unsubscribe")
        expect_error(c.call(UnsubscribeRequest(987654)), E.INVALID_REQUEST, "unknown id")
        # Another connection cannot touch a subscription it does not own.
        other = Sub(c, sid, 20, 1)
        with server.client() as stranger:
            expect_error(stranger.call(UnsubscribeRequest(other.id)), E.INVALID_REQUEST)
            expect_error(stranger.call(SubscribeCreditRequest(other.id, 1)), E.INVALID_REQUEST)
        assert other.collect(1) == [b"v15"]


def test_subscribe_from_the_end_and_live(server: Server, client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("tail"))
    fill(client, sid, [b"old"] * 7)
    with server.client() as c:
        sub = Sub(c, sid, 7, 10)
        assert sub.response.start_offset == 7
        sub.assert_silent(0.2)
        kr.append(client, sid, [b"new1", b"new2"])
        assert sub.collect(2) == [b"new1", b"new2"]
        assert sub.offsets == [7, 8]


def test_consumer_group_waits_and_takes_over(server: Server, client: kr.RawClient) -> None:
    sid = kr.create_stream(client, unique("takeover"))
    events = [b"g%02d" % i for i in range(20)]
    fill(client, sid, events)
    group = unique("grp")
    with server.client() as ca, server.client() as cb:
        a = Sub(ca, sid, RESUME_GROUP_OFFSET, 5, group)
        assert a.response.start_offset == 0  # a new group starts at 0
        assert a.collect(5) == events[:5]
        b = Sub(cb, sid, RESUME_GROUP_OFFSET, 100, group)
        b.assert_silent()  # one active delivery per (group, stream)
        assert a.grant(3) == 3  # acknowledges 0..4
        assert a.collect(8) == events[:8]  # 5..7 delivered, not acknowledged
        b.assert_silent(0.2)
        rid = ca.send(UnsubscribeRequest(a.id))
        assert ca.reply(rid) == SubscriptionClosedResponse(a.id, CloseReason.CLIENT_CANCELLED)
        # b takes over from the group's acknowledged position: 5..7 come again.
        assert b.collect(15) == events[5:]
        assert b.offsets[0] == 5
        kr.append(client, sid, [b"more"])
        assert b.collect(16)[-1] == b"more"
        a.assert_silent(0.2)


def test_consumer_group_resumes_after_a_client_dies_and_a_restart(
    own_server: Server,
) -> None:
    srv = own_server
    events = [b"cg%02d" % i for i in range(50)]
    with srv.client() as c:
        sid = kr.create_stream(c, "groups")
        fill(c, sid, events)
    a_conn = srv.client()
    a = Sub(a_conn, sid, RESUME_GROUP_OFFSET, 10, "g")
    assert a.collect(10) == events[:10]
    a.assert_silent(0.2)
    assert a.grant(10) == 10  # acknowledges 0..9
    assert a.collect(20) == events[:20]  # 10..19 delivered, never acknowledged
    a_conn.abort()  # the consumer dies

    with srv.client() as cb:
        b = Sub(cb, sid, RESUME_GROUP_OFFSET, 100, "g")
        assert b.response.start_offset == 10, b.response
        assert b.collect(40) == events[10:]
        assert b.offsets[0] == 10
        assert b.grant(0) == 60  # acknowledges everything through 49
        srv.proc.send_signal(15)  # SIGTERM
        closed = b.wait_closed()
        assert closed.reason == CloseReason.SERVER_SHUTDOWN
        assert cb.closed_by_server()
    assert srv.proc.wait(30) == 0
    assert_clean_log(srv)

    srv.start()
    with srv.client() as cc, srv.client() as writer:
        c_sub = Sub(cc, sid, RESUME_GROUP_OFFSET, 10, "g")
        assert c_sub.response.start_offset == 50, "the group position did not survive"
        kr.append(writer, sid, [b"x", b"y", b"z"])
        assert c_sub.collect(3) == [b"x", b"y", b"z"]
        fresh = Sub(cc, sid, RESUME_GROUP_OFFSET, 2, "never_seen")
        assert fresh.response.start_offset == 0
        assert fresh.collect(2) == events[:2]
    stop_cleanly(srv, clean_log=True)


def test_sigterm_closes_subscriptions_with_server_shutdown(
    own_server: Server,
) -> None:
    srv = own_server
    with srv.client() as c:
        sid = kr.create_stream(c, "shutdown")
        kr.append(c, sid, [b"a", b"b"])
        subs = [Sub(c, sid, 0, 10), Sub(c, sid, 2, 10)]
        subs[0].collect(2)
        rc_holder: list[int] = []
        srv.proc.send_signal(15)
        for sub in subs:
            closed = sub.wait_closed()
            assert closed == SubscriptionClosedResponse(sub.id, CloseReason.SERVER_SHUTDOWN)
        assert c.closed_by_server()
        rc_holder.append(srv.proc.wait(30))
    assert rc_holder == [0]
    assert_clean_log(srv)


# ==== idempotent appends ====


def test_append_idempotent_across_restarts(own_server: Server) -> None:
    srv = own_server

    def idem(c: kr.RawClient, sid: int, producer: int, seq: int, events: list[bytes]) -> object:
        return c.call(AppendIdempotentRequest(sid, producer, seq, batch(events)))

    with srv.client() as c:
        sid = kr.create_stream(c, "idem")
        assert idem(c, sid, 77, 0, [b"a", b"b"]) == AppendEventsResponse(0, 2)
        assert idem(c, sid, 77, 0, [b"a", b"b"]) == AppendEventsResponse(0, 2)  # retry
        expect_error(idem(c, sid, 77, 2, [b"skip"]), E.INVALID_REQUEST, "gap")  # type: ignore[arg-type]
        expect_error(idem(c, sid, 77, 99, [b"skip"]), E.INVALID_REQUEST, "far gap")  # type: ignore[arg-type]
        assert idem(c, sid, 77, 1, [b"c"]) == AppendEventsResponse(2, 1)
        kr.append(c, sid, [b"plain"])  # offset 3
        assert idem(c, sid, 88, 0, [b"other"]) == AppendEventsResponse(4, 1)  # another producer
        assert idem(c, sid, 77, 1, [b"c"]) == AppendEventsResponse(2, 1)
        assert idem(c, sid, 77, 0, [b"a", b"b"]) == AppendEventsResponse(0, 2)
        # Pipelined: the next sequence and its retry, sent back to back.
        r1 = c.send(AppendIdempotentRequest(sid, 77, 2, batch([b"d"])))
        r2 = c.send(AppendIdempotentRequest(sid, 77, 2, batch([b"d"])))
        r3 = c.send(AppendIdempotentRequest(sid, 77, 3, batch([b"e", b"f"])))
        assert c.reply(r1) == AppendEventsResponse(5, 1)
        assert c.reply(r2) == AppendEventsResponse(5, 1)
        assert c.reply(r3) == AppendEventsResponse(6, 2)
        expected = [b"a", b"b", b"c", b"plain", b"other", b"d", b"e", b"f"]
        assert kr.read_all(c, sid) == expected

    stop_cleanly(srv)
    srv.start()
    with srv.client() as c:
        assert idem(c, sid, 77, 3, [b"e", b"f"]) == AppendEventsResponse(6, 2)
        assert idem(c, sid, 77, 1, [b"c"]) == AppendEventsResponse(2, 1)
        assert idem(c, sid, 88, 0, [b"other"]) == AppendEventsResponse(4, 1)
        expect_error(idem(c, sid, 77, 5, [b"g"]), E.INVALID_REQUEST, "gap after restart")  # type: ignore[arg-type]
        assert idem(c, sid, 77, 4, [b"g"]) == AppendEventsResponse(8, 1)
        assert idem(c, sid, 88, 1, [b"h"]) == AppendEventsResponse(9, 1)
        expected += [b"g", b"h"]
        assert kr.read_all(c, sid) == expected

    srv.kill()  # a crash: no shutdown snapshot of the producer table
    srv.start()
    with srv.client() as c:
        assert idem(c, sid, 77, 4, [b"g"]) == AppendEventsResponse(8, 1)
        assert idem(c, sid, 88, 1, [b"h"]) == AppendEventsResponse(9, 1)
        assert idem(c, sid, 77, 0, [b"a", b"b"]) == AppendEventsResponse(0, 2)
        expect_error(idem(c, sid, 77, 6, [b"i"]), E.INVALID_REQUEST, "gap after crash")  # type: ignore[arg-type]
        assert idem(c, sid, 77, 5, [b"i"]) == AppendEventsResponse(10, 1)
        expected += [b"i"]
        assert kr.read_all(c, sid) == expected
    stop_cleanly(srv, clean_log=True)


# ==== durability ====


WINDOW = 8  # appends in flight per writer


class PipelinedWriter(threading.Thread):
    """Appends with up to WINDOW requests in flight until the server dies."""

    def __init__(
        self,
        port: int,
        stream_id: int,
        run: int,
        rng: random.Random,
        sent: dict[tuple[int, int], list[bytes]],
        acked: list[tuple[int, int, tuple[int, int]]],
    ) -> None:
        super().__init__(daemon=True)
        self.port, self.stream_id, self.run_no, self.rng = port, stream_id, run, rng
        self.sent, self.acked = sent, acked
        self.problems: list[str] = []
        self.stop = threading.Event()

    def make(self, seq: int) -> list[bytes]:
        n = self.rng.randint(1, 12)
        return [
            b"%d:%d:%d:" % (self.run_no, seq, i) + self.rng.randbytes(self.rng.randint(0, 300))
            for i in range(n)
        ]

    def run(self) -> None:
        inflight: dict[int, tuple[int, int]] = {}
        seq = 0
        try:
            c = kr.RawClient(self.port, timeout=20)
        except OSError as exc:
            self.problems.append(f"connect: {exc}")
            return
        try:
            while True:
                while len(inflight) < WINDOW and not self.stop.is_set():
                    events = self.make(seq)
                    self.sent[(self.run_no, seq)] = events
                    rid = c.send(AppendEventsRequest(self.stream_id, batch(events)))
                    inflight[rid] = (self.run_no, seq)
                    seq += 1
                if not inflight:
                    return
                response = c.next_response(timeout=20)
                if response is None:
                    return  # the server died (or went silent: checked by the caller)
                key = inflight.pop(response.request_id, None)
                payload = response.payload
                if key is None:
                    self.problems.append(f"unexpected response {response!r}")
                elif isinstance(payload, AppendEventsResponse):
                    if payload.count != len(self.sent[key]):
                        self.problems.append(f"{key}: count {payload.count}")
                    self.acked.append((payload.first_offset, payload.count, key))
                else:
                    self.problems.append(f"{key}: {payload!r}")
        except OSError:
            return  # killed mid-send
        finally:
            c.close()


@pytest.mark.slow
def test_acknowledged_appends_survive_sigkill(own_server: Server, seed: int) -> None:
    srv = own_server
    rng = random.Random(seed)
    kills = 6
    sent: dict[tuple[int, int], list[bytes]] = {}
    acked: list[tuple[int, int, tuple[int, int]]] = []
    with srv.client() as c:
        sid = kr.create_stream(c, "durable")
    for run in range(kills + 1):
        if run:
            srv.start()
        writer = PipelinedWriter(srv.port, sid, run, random.Random(rng.random()), sent, acked)
        before = len(acked)
        writer.start()
        # The kill lands after a random number of acknowledgements, with more in flight.
        want = before + rng.randint(1, 300)

        def killable(want: int = want, writer: PipelinedWriter = writer) -> bool:
            return len(acked) >= want or bool(writer.problems) or not writer.is_alive()

        wait_until(killable, 60, f"run {run}: {want - before} appends not acknowledged")
        if run < kills:
            srv.kill()
            writer.join(30)
        else:
            writer.stop.set()
            writer.join(30)
        assert not writer.is_alive(), "writer stuck"
        assert not writer.problems, writer.problems
        assert len(acked) > before or run < kills, f"run {run}: nothing acknowledged"

    with srv.client() as c:
        served = kr.read_all(c, sid)
        where: dict[tuple[int, int], int] = {}
        count: Counter[tuple[int, int]] = Counter()
        for offset, event in enumerate(served):
            run_s, seq_s, index_s, _ = event.split(b":", 3)
            key, index = (int(run_s), int(seq_s)), int(index_s)
            assert key in sent and sent[key][index] == event, f"offset {offset}: never sent"
            base = where.setdefault(key, offset - index)
            assert base == offset - index, f"offset {offset}: {key} not contiguous"
            count[key] += 1
        torn = {k: (n, len(sent[k])) for k, n in count.items() if n != len(sent[k])}
        assert not torn, f"appends served in part: {torn}"
        for first, n, key in acked:
            assert where.get(key) == first, (
                f"acknowledged {key} at {first}, served at {where.get(key)}"
            )
            assert served[first : first + n] == sent[key]
        assert len(acked) >= kills, f"only {len(acked)} appends acknowledged"
        rows = []
        page = 20_000  # one answer must fit a 16 MiB frame
        for start in range(0, len(served), page):
            rows += kr.rows_of(
                kr.query(
                    c,
                    'SELECT "offset", position, data FROM durable'
                    ' WHERE "offset" >= $1 ORDER BY "offset" LIMIT $2',
                    [start, page],
                )
            )
        assert [r[0] for r in rows] == list(range(len(served)))
        positions = [r[1] for r in rows]
        assert all(a < b for a, b in itertools.pairwise(positions)), "positions not increasing"
        assert [r[2] for r in rows] == [e.hex() for e in served]
        print(f"{len(served)} events served, {len(acked)} appends acknowledged, {kills} kills")
    stop_cleanly(srv, clean_log=True)


# ==== robustness ====


def test_garbage_never_crashes_or_blocks_the_server(server: Server, seed: int) -> None:
    rng = random.Random(seed)
    with server.client(42) as c:
        sentinel = kr.create_stream(c, unique("sentinel"))
        kept = [b"keep-%d" % i for i in range(10)]
        kr.append(c, sentinel, kept)

    # A stalled half-sent frame must not block anybody else.
    staller = RawClient(server.port)
    staller.send_raw(kr.header(MAX_FRAME) + b"\x00" * (1 << 20))

    valid = [
        kr.request_envelope(1, 0, 0, b"\x01\x00" + bytes(4)),  # Handshake
        kr.request_envelope(2, 0, 12, b""),  # ListStreams
        kr.request_envelope(3, 0, 3, struct.pack("<Q", 8) + b"SELECT 1" + bytes(8)),
        kr.request_envelope(4, 0, 5, struct.pack("<QQQ", 1, 0, 100)),
        kr.request_envelope(5, 0, 7, b""),
    ]

    def mutate(payload: bytes) -> bytes:
        data = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            if len(data) > 20 and rng.random() < 0.7:
                i = rng.randrange(20, len(data))
                data[i] ^= rng.randint(1, 255)
            elif data and rng.random() < 0.5:
                del data[rng.randrange(len(data)) :]
            else:
                data += rng.randbytes(rng.randint(1, 16))
        return bytes(data)

    for i in range(64):
        kind = i % 8
        try:
            g = RawClient(server.port, handshake=kind >= 4, timeout=5)
        except OSError as exc:
            raise AssertionError(f"cannot connect after {i} garbage connections: {exc}") from None
        try:
            if kind in (0, 4):
                g.send_raw(rng.randbytes(rng.randint(1, 3000)))
            elif kind in (1, 5):
                g.send_raw(kr.frame(rng.randbytes(rng.randint(0, 200))))
            elif kind in (2, 6):
                frames = b"".join(kr.frame(mutate(rng.choice(valid))) for _ in range(5))
                g.send_raw(frames)
            elif kind == 3:
                g.send_raw(kr.header(rng.choice([0xFFFFFFFF, MAX_FRAME + 1])) + rng.randbytes(4096))
            else:
                good = kr.frame(rng.choice(valid))
                g.send_raw(good[: rng.randint(1, len(good) - 1)])  # truncated, then gone
            g.drain(0.02)
        except OSError:
            pass
        finally:
            if rng.random() < 0.5:
                g.abort()
            else:
                g.close()
        assert server.running, f"the server died on garbage connection {i}:\n{server.log_tail()}"

    with server.client(42) as c:
        started = time.monotonic()
        assert isinstance(c.call(SyncRequest()), SyncResponse)
        assert kr.read_all(c, sentinel) == kept
        sid = kr.create_stream(c, unique("after_garbage"))
        kr.append(c, sid, [b"fine"])
        assert kr.query(c, "SELECT count(*) FROM (SELECT 1)").rows == [[1]]
        assert time.monotonic() - started < 10
    # The staller is still connected and still waiting for its payload.
    assert not staller.closed_by_server(timeout=0.2)
    staller.close()
