"""The blocking SDK (``headwater.connect``) against a real server process."""

from __future__ import annotations

import datetime as dt
import importlib.util
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import headwater
from headwater.client import (
    Client,
    ConnectionLost,
    Event,
    EventTooLarge,
    ServerUnavailable,
    StreamInfo,
    Timestamp,
)
from headwater.errors import (
    AuthenticationFailed,
    InvalidRequest,
    PositionAhead,
    QueryParseError,
    StreamAlreadyExists,
    StreamNotFound,
    TenantNotFound,
)
from headwater.protocols.kimberlite import MAX_APPEND_BYTES

MiB = 1 << 20


@pytest.fixture
def client(shared_server: object) -> Iterator[Client]:
    with headwater.connect(shared_server.address, timeout=20) as hw:  # type: ignore[attr-defined]
        yield hw


def test_import_headwater_is_lazy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, headwater; "
        "assert 'headwater.client' not in sys.modules; "
        "assert 'asyncio' not in sys.modules, 'asyncio imported eagerly'; "
        "headwater.connect; assert 'headwater.client' in sys.modules; "
        "assert headwater.connect is headwater.client.connect"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_stream_lifecycle(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    stream_id = client.create_stream(name)
    with pytest.raises(StreamAlreadyExists) as exc_info:
        client.create_stream(name)
    assert exc_info.value.retryable is False

    info = client.stream_info(name)
    assert isinstance(info, StreamInfo)
    assert (info.stream_id, info.name, info.next_offset, info.size_bytes) == (stream_id, name, 0, 0)
    assert abs(info.created_ns / 1e9 - time.time()) < 120
    assert client.stream_id(name) == stream_id
    assert client.stream_info(stream_id).name == name
    assert name in {s.name for s in client.list_streams()}

    assert client.append(name, [b"a", "b"]) == (0, 2)
    assert client.stream_info(name).next_offset == 2

    client.delete_stream(name)
    assert name not in {s.name for s in client.list_streams()}
    with pytest.raises(StreamNotFound):
        client.read(name)
    with pytest.raises(StreamNotFound):
        client.read(stream_id)
    with pytest.raises(StreamNotFound):
        client.delete_stream(name)
    with pytest.raises(InvalidRequest):
        client.create_stream("not a valid name!")


def test_stale_cached_stream_id_is_looked_up_again(
    client: Client, shared_server: object, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    old_id = client.create_stream(name)
    client.append(name, [b"old"])
    with headwater.connect(shared_server.address) as other:  # type: ignore[attr-defined]
        other.delete_stream(name)
        new_id = other.create_stream(name)
    assert new_id != old_id
    # The first client still caches old_id: the append notices and retries by name.
    assert client.append(name, [b"new"]) == (0, 1)
    assert client.stream_id(name) == new_id
    assert [e.value for e in client.read(name).events] == [b"new"]


def test_a_subscription_by_a_stale_cached_name_finds_the_stream_made_again(
    client: Client, shared_server: object, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b"old"])
    with headwater.connect(shared_server.address) as other:  # type: ignore[attr-defined]
        other.delete_stream(name)
        other.create_stream(name)
        other.append(name, [b"new"])
    with client.subscribe(name, 0) as sub:  # it once failed: StreamNotFound of the old id
        assert sub.next(timeout=30) == Event(0, b"new")


def test_a_scan_ends_when_its_stream_is_deleted_and_made_again(
    client: Client, shared_server: object, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b"old-%d" % i for i in range(50)])
    scan = client.scan(name, max_bytes=30)  # pages of a few events
    seen = [next(scan) for _ in range(5)]
    with headwater.connect(shared_server.address) as other:  # type: ignore[attr-defined]
        other.delete_stream(name)
        other.create_stream(name)
        other.append(name, [b"new-%d" % i for i in range(50)])
    # It once went on in the new stream: old-0..old-8, then new-9...
    with pytest.raises(StreamNotFound):
        seen += list(scan)
    assert all(e.value.startswith(b"old-") for e in seen)


def test_append_and_read(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    values = [f"event-{i}".encode() for i in range(100)]
    result = client.append(name, values)
    assert (result.first_offset, result.count, result.last_offset) == (0, 100, 99)
    assert client.append(name, [bytearray(b"x"), memoryview(b"y"), "zé"]) == (100, 3)

    events, next_offset = client.read(name)
    assert next_offset == 103
    assert events[0] == Event(0, b"event-0") and events[0].text == "event-0"
    assert [e.offset for e in events] == list(range(103))
    assert [e.value for e in events] == [*values, b"x", b"y", "zé".encode()]

    page = client.read(name, 10, max_bytes=20)  # "event-10" is 8 bytes: two fit
    assert [e.offset for e in page.events] == [10, 11]
    assert (page.next_offset, page.at_end) == (12, False)
    one = client.read(name, 50, max_bytes=1)  # at least one event even when it is bigger
    assert [e.value for e in one.events] == [b"event-50"]
    tail = client.read(name, 101)
    assert ([e.offset for e in tail.events], tail.next_offset, tail.at_end) == (
        [101, 102],
        103,
        True,
    )
    beyond = client.read(name, 500)
    assert (beyond.events, beyond.next_offset, beyond.at_end) == ([], 500, True)

    assert [e.offset for e in client.scan(name, 95)] == list(range(95, 103))
    assert [e.offset for e in client.scan(name, 0, limit=7, max_bytes=10)] == list(range(7))

    with pytest.raises(ValueError, match="at least one event"):
        client.append(name, [])
    with pytest.raises(TypeError):
        client.append(name, [123])  # type: ignore[list-item]


def test_append_splits_over_the_event_limit(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    values = [str(i).encode() for i in range(25_000)]
    result = client.append(name, values)
    assert result == (0, 25_000)
    assert result.batches == [(0, 10_000), (10_000, 10_000), (20_000, 5_000)]  # 3 appends
    got = [e.value for e in client.scan(name, max_bytes=4 * MiB)]
    assert got == values


def test_append_splits_over_the_byte_limit(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    values = [bytes([i]) * MiB for i in range(5)] + [b"tail"]  # 5 MiB + 4 bytes
    result = client.append(name, values)
    # Four 1 MiB events fill one append exactly (4 MiB is allowed); the rest go next.
    assert result.batches == [(0, 4), (4, 2)]
    got = list(client.scan(name, max_bytes=MiB))
    assert [e.value for e in got] == values


def test_an_event_over_4_mib_is_refused_before_anything_is_sent(
    client: Client, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    with pytest.raises(EventTooLarge, match="event 1 is 4,194,305 bytes") as exc_info:
        client.append(name, [b"small", b"x" * (MAX_APPEND_BYTES + 1)])
    assert isinstance(exc_info.value, ValueError)
    assert client.stream_info(name).next_offset == 0  # nothing was appended
    assert client.append(name, [b"x" * MAX_APPEND_BYTES]) == (0, 1)  # exactly 4 MiB is fine


def test_append_idempotent(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b"before"])
    assert client.append_idempotent(name, 7, 0, [b"a", b"b"]) == (1, 2)
    # A repeat returns the original offsets and appends nothing.
    assert client.append_idempotent(name, 7, 0, [b"a", b"b"]) == (1, 2)
    assert client.append_idempotent(name, 7, 1, [b"c"]) == (3, 1)
    assert client.append_idempotent(name, 7, 1, [b"c"]) == (3, 1)
    assert client.append_idempotent(name, 8, 0, [b"other producer"]) == (4, 1)
    with pytest.raises(InvalidRequest):
        client.append_idempotent(name, 7, 5, [b"gap"])
    assert [e.value for e in client.read(name).events] == [
        b"before",
        b"a",
        b"b",
        b"c",
        b"other producer",
    ]
    with pytest.raises(ValueError, match="one request"):
        client.append_idempotent(name, 9, 0, [b"x"] * 10_001)


def test_query_and_query_at(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b'{"n": 1}', b'{"n": 2}', b"not json"])
    result = client.query(
        f'SELECT "offset", json->>\'n\' AS n, data, position FROM {name} ORDER BY "offset"'
    )
    assert result.columns == ["offset", "n", "data", "position"]
    assert len(result) == 3
    rows = list(result)
    assert [r[0] for r in rows] == [0, 1, 2]
    assert [r[1] for r in rows] == ["1", "2", None]
    assert rows[2][2] == b"not json".hex()  # blobs travel as lowercase hex text
    assert result.as_dicts()[0]["n"] == "1"

    params = client.query(
        "SELECT $1::BIGINT + 1 AS i, $2 AS s, $3 AS b, $4 AS nothing, $5::TIMESTAMP AS t",
        41,
        "text",
        True,
        None,
        dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC),
    )
    ns = int(dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.UTC).timestamp()) * 10**9 + 123456000
    assert params.rows == [(42, "text", True, None, Timestamp(ns))]
    assert client.query("SELECT $1::TIMESTAMP AS t", Timestamp(ns)).scalar() == Timestamp(ns)
    with pytest.raises(TypeError, match="float"):
        client.query("SELECT $1", 1.5)

    positions = [r[3] for r in rows]
    assert positions == sorted(positions)
    # QueryAt(p) sees exactly the first p positions of the tenant log.
    count = f"SELECT count(*) FROM {name}"
    assert client.query_at(count, positions[2] + 1).scalar() == 3
    assert client.query_at(count, positions[1] + 1).scalar() == 2
    with pytest.raises(PositionAhead):
        client.query_at(count, 1 << 60)
    with pytest.raises(QueryParseError) as exc_info:
        client.query("SELEKT nonsense")
    assert exc_info.value.retryable is False


def test_query_result_to_arrow_and_pandas(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b'{"a": 1}', b'{"a": 2}'])
    result = client.query(
        f'SELECT "offset", json->>\'a\' AS a, "offset" > 0 AS later, ts, NULL AS nothing '
        f'FROM {name} ORDER BY "offset"'
    )
    table = result.to_arrow()
    assert table.column_names == ["offset", "a", "later", "ts", "nothing"]
    assert [str(f.type) for f in table.schema] == [
        "int64",
        "string",
        "bool",
        "timestamp[ns]",
        "null",
    ]
    assert table.column("offset").to_pylist() == [0, 1]
    assert table.column("later").to_pylist() == [False, True]
    if importlib.util.find_spec("pandas") is None:
        with pytest.raises(ImportError, match="pip install pandas"):
            result.to_pandas()
    else:
        frame = result.to_pandas()
        assert list(frame["offset"]) == [0, 1]


def test_subscribe_refills_credit_and_delivers_in_order(
    client: Client, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [f"{i}".encode() for i in range(300)])
    received: list[Event] = []
    with client.subscribe(name, 0, credits=40) as sub:
        assert sub.start_offset == 0
        # Appends arrive while the subscription is live, too.
        writer = threading.Thread(
            target=lambda: client.append(name, [f"{i}".encode() for i in range(300, 700)])
        )
        writer.start()
        for event in sub:
            received.append(event)
            if len(received) == 700:
                break
        writer.join()
    assert sub.closed
    # Far more than the 40 initial credits: the window was refilled automatically.
    assert [e.offset for e in received] == list(range(700))
    assert [e.value for e in received] == [f"{i}".encode() for i in range(700)]


def test_subscribe_latest_and_offsets(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b"old1", b"old2"])
    with (
        client.subscribe(name, "latest", credits=10) as latest,
        client.subscribe(name, 1, credits=10) as from_one,
    ):
        assert latest.start_offset == 2
        client.append(name, [b"new"])
        assert [tuple(e) for e in latest.next_batch(timeout=10)] == [(2, b"new")]
        got: list[Event] = []
        while len(got) < 2:
            got += from_one.next_batch(timeout=10)
        assert [e.value for e in got] == [b"old2", b"new"]
        assert latest.next_batch(timeout=0.05) == []  # nothing more: times out empty
    with pytest.raises(StreamNotFound):
        client.subscribe("no_such_stream_here").start()
    with pytest.raises(ValueError, match="group"):
        client.subscribe(name, "resume")


def test_subscription_ends_with_stream_not_found_when_deleted(
    client: Client, shared_server: object, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [b"one"])
    sub = client.subscribe(name, 0, credits=5)
    iterator = iter(sub)
    assert next(iterator).value == b"one"
    with headwater.connect(shared_server.address) as other:  # type: ignore[attr-defined]
        other.delete_stream(name)
    with pytest.raises(StreamNotFound, match="deleted"):
        next(iterator)
    assert sub.closed


def test_consumer_group_resumes_from_acknowledged_position(
    client: Client, sdk_stream_name: str
) -> None:
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [f"{i}".encode() for i in range(30)])
    with client.subscribe(name, 0, credits=4, group="g1") as sub:
        seen = []
        for event in sub:
            seen.append(event.offset)
            if len(seen) == 20:
                break
    # The group's position only passed events the loop had finished with (at-least-once:
    # nothing unprocessed is skipped; at most one window comes again).
    with client.subscribe(name, "resume", credits=100, group="g1") as again:
        assert again.start_offset is not None
        assert 16 <= again.start_offset <= 20
        batch = again.next_batch(timeout=10)
        assert batch[0].offset == again.start_offset


def test_consumer_group_on_a_quiet_stream_moves_on(client: Client, sdk_stream_name: str) -> None:
    # Fewer events than credits: the balance never runs out, yet finishing every event
    # received must still move the group on (it once stayed at 0 for ever).
    name = sdk_stream_name
    client.create_stream(name)
    client.append(name, [f"{i}".encode() for i in range(5)])
    with client.subscribe(name, 0, credits=100, group="quiet") as sub:
        got: list[Event] = []
        while len(got) < 5:
            got += sub.next_batch(timeout=10)
        assert sub.next_batch(timeout=0) == []  # back for more: the five are finished
    client.append(name, [b"5", b"6"])
    with client.subscribe(name, "resume", credits=100, group="quiet") as again:
        assert again.start_offset == 5
        got = []
        while len(got) < 2:
            got += again.next_batch(timeout=10)
        assert [e.offset for e in got] == [5, 6]
        # Closed before coming back for more: 5 and 6 are not finished, so they come again.
    with client.subscribe(name, "resume", credits=100, group="quiet") as third:
        assert third.start_offset == 5


def test_pipelined_requests_from_many_threads(client: Client, sdk_stream_name: str) -> None:
    name = sdk_stream_name
    client.create_stream(name)

    def work(worker: int) -> list[tuple[int, int]]:
        out = []
        for i in range(20):
            out.append(tuple(client.append(name, [f"{worker}-{i}".encode()])))
            client.read(name, 0, 64)
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(work, range(8)) for r in rs]
    assert sorted(first for first, _ in results) == list(range(160))
    assert client.stream_info(name).next_offset == 160
    # submit(): futures of the async client, pipelined without threads.
    futures = [client.submit(client.aio.append(name, [b"f"])) for _ in range(50)]
    firsts = sorted(f.result(10).first_offset for f in futures)
    assert firsts == list(range(160, 210))
    assert client.sync() is True


def test_server_unavailable_when_nothing_listens(unused_port: int) -> None:
    began = time.monotonic()
    with pytest.raises(ServerUnavailable) as exc_info:
        headwater.connect(f"127.0.0.1:{unused_port}")
    assert time.monotonic() - began < 5
    message = str(exc_info.value)
    assert "\n" not in message
    assert f"127.0.0.1:{unused_port}" in message and "refused" in message
    assert isinstance(exc_info.value, ConnectionError)


def test_closed_client_refuses_calls(shared_server: object) -> None:
    hw = headwater.connect(shared_server.address)  # type: ignore[attr-defined]
    hw.list_streams()
    hw.close()
    hw.close()  # idempotent
    assert hw.closed
    with pytest.raises((ConnectionLost, headwater.client.ClientClosed)):
        hw.list_streams()


AUTH_CONFIG = """
[auth]
required = true
[[auth.tokens]]
token = "s3cret"
tenants = [0, 42, 99]
[[tenants]]
id = 42
name = "acme"
"""


def test_token_and_tenant(make_server: Any) -> None:
    server = make_server(config=AUTH_CONFIG)
    with headwater.connect(server.address, token="s3cret", tenant=42) as acme:
        assert acme.authenticated and acme.tenant == 42
        acme.create_stream("acme_only")
        acme.append("acme_only", [b"x"])
    with headwater.connect(server.address, token="s3cret") as default:
        assert "acme_only" not in [s.name for s in default.list_streams()]
    with headwater.connect(server.address, token="wrong") as stranger:
        assert not stranger.authenticated
        with pytest.raises(AuthenticationFailed):
            stranger.list_streams()
    with headwater.connect(server.address) as anonymous, pytest.raises(AuthenticationFailed):
        anonymous.query("SELECT 1")
    other = headwater.connect(server.address, token="s3cret", tenant=7)
    with other, pytest.raises(AuthenticationFailed, match="does not grant tenant 7"):
        other.list_streams()
    missing = headwater.connect(server.address, token="s3cret", tenant=99)
    with missing, pytest.raises(TenantNotFound):
        missing.list_streams()
