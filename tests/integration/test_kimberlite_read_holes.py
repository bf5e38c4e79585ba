"""Kimberlite ReadEvents over a stream whose offsets have holes, against a real server.
The answer carries no offsets: the SDK labels its events ``from_offset + i``. Compaction
(superseded keyed events removed inside sealed segments, the others keeping their
offsets) and transactions (markers, aborted batches: never shown to a read_committed
reader) leave holes; the server cuts an answer before a hole and answers a read from
inside one with no events and the offset after it, so ``scan``'s (offset, value) pairs
are the HTTP API's, which carries each event's offset (docs/protocols/kimberlite.md), and
the Spark reader's ReadEvents path gives the rows of its HTTP path."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from servers import LOCAL, Server, serving

import headwater
from headwater.client.producer import AsyncProducer
from headwater.spark.options import ConnectionOptions
from headwater.spark.streams import ROW_SCHEMA, RangeReader
from waiting import wait_until

CONFIG = """
[storage]
sync = "none"
maintenance_interval_ms = 50
"""

Events = list[tuple[int, bytes]]  # (offset, value) in offset order


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("kimberlite_holes"),
        config=CONFIG,
        listen={"http": LOCAL, "rivven": LOCAL},
    )


def http(server: Server, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{server.address_of('http')}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def http_events(server: Server, stream: str) -> list[tuple[int, bytes]]:
    """Every event the HTTP API shows (read_committed), with its stored offset."""
    events: list[tuple[int, bytes]] = []
    offset = 0
    while True:
        page = http(server, "GET", f"/api/streams/{stream}/events?from={offset}&limit=1000")
        events += [(e["offset"], base64.b64decode(e["value_b64"])) for e in page["events"]]
        if page["next_offset"] >= page["end_offset"]:
            return events
        assert page["next_offset"] > offset, f"a page from {offset} does not move on: {page}"
        offset = page["next_offset"]


def scanned(client: headwater.Client, stream: str, max_bytes: int) -> list[tuple[int, bytes]]:
    return [(e.offset, e.value) for e in client.scan(stream, max_bytes=max_bytes)]


@pytest.fixture(scope="module")
def compacted(server: Server) -> tuple[str, Events]:
    """A compacted stream, compaction done: holes inside batches and between them."""
    stream = "compacted-holes"
    settings = {"cleanup_policy": "compact", "segment_bytes": 4096}
    http(server, "POST", "/api/streams", {"name": stream, "settings": settings})
    stored: dict[bytes, tuple[int, bytes]] = {}  # the latest (offset, value) per key
    with headwater.connect(server.address) as client:
        for round_ in range(12):  # one stored batch per append, segments of 4 KiB
            values = [b"round %d event %d" % (round_, i) for i in range(40)]
            # Every other key is written once: compaction leaves holes inside batches.
            keys = [b"k%d" % (i % 7) if i % 2 else b"once %d.%d" % (round_, i) for i in range(40)]
            first, _ = client.append(stream, values, keys=keys)
            stored.update((key, (first + i, values[i])) for i, key in enumerate(keys))
        # Keyless events of over half a segment each: the keyed ones are all in sealed
        # segments, which compaction rewrites.
        for n in range(2):
            first, _ = client.append(stream, [b"%d" % n * 3000])
            stored[b"filler %d" % n] = (first, b"%d" % n * 3000)
    expected = sorted(stored.values())  # what compaction keeps
    # The server's maintenance compacts sealed segments on its own.
    wait_until(lambda: http_events(server, stream) == expected, timeout=30)
    return stream, expected


@pytest.fixture(scope="module")
def transactions(server: Server) -> tuple[str, Events]:
    """Committed and aborted transactions (over Rivven), then one plain append."""
    stream = "transaction-holes"

    async def write() -> None:
        async with AsyncProducer(server.address_of("rivven"), transactional_id="holes") as producer:
            await producer.create_stream(stream, partitions=1)
            await producer.init_transactions()
            for n, commit in enumerate([True, False, True, False, False, True]):
                await producer.begin_transaction()
                for i in range(3):
                    producer.send(stream, b"txn %d event %d" % (n, i), partition=0)
                if commit:
                    await producer.commit_transaction()
                else:
                    await producer.abort_transaction()

    asyncio.run(write())
    with headwater.connect(server.address) as client:
        client.append(stream, [b"after the transactions"])
        end = client.stream_info(stream).next_offset
    expected = http_events(server, stream)
    # 3 committed transactions of 3 events and the last append: the aborted
    # transactions' batches and every marker are holes.
    assert len(expected) == 10 and expected[-1][0] == end - 1
    assert not any(b"txn 1 " in value for _, value in expected)
    return stream, expected


def test_scan_of_a_compacted_stream_labels_each_event_with_its_offset(
    server: Server, compacted: tuple[str, Events]
) -> None:
    stream, expected = compacted
    offsets = [offset for offset, _ in expected]
    present = set(offsets)
    with headwater.connect(server.address) as client:
        end = client.stream_info(stream).next_offset
        holes = [o for o in range(end) if o not in present]
        assert holes and offsets[-1] == end - 1
        # Whole pages, pages cut inside batches, a page per event.
        for max_bytes in (1 << 20, 100, 1):
            assert scanned(client, stream, max_bytes) == expected
        # A read from inside a hole: no events, on to the next offset present.
        hole = next(o for o in holes if o - 1 in present)
        after = min(o for o in offsets if o > hole)
        page = client.read(stream, hole)
        assert page.events == [] and not page.at_end and page.next_offset == after
        raw = client.read_batch(stream, hole)
        assert raw.events.count == 0 and not raw.at_end and raw.next_offset == after
        # A page ends before a hole: its next offset is the one after its last event.
        before = hole - 1
        page = client.read(stream, before)
        assert [(e.offset, e.value) for e in page.events] == [expected[offsets.index(before)]]
        assert page.next_offset == hole


def test_scan_passes_transaction_markers_and_aborted_batches(
    server: Server, transactions: tuple[str, Events]
) -> None:
    stream, expected = transactions
    with headwater.connect(server.address) as client:
        for max_bytes in (1 << 20, 20):
            assert scanned(client, stream, max_bytes) == expected


@pytest.fixture(scope="module")
def ends_in_markers(server: Server) -> tuple[str, Events]:
    """A committed transaction, then an aborted one: the log ends in what a
    read_committed reader never sees (an aborted batch and two markers)."""
    stream = "ends-in-markers"

    async def write() -> None:
        async with AsyncProducer(server.address_of("rivven"), transactional_id="end") as producer:
            await producer.create_stream(stream, partitions=1)
            await producer.init_transactions()
            for n, commit in enumerate([True, False]):
                await producer.begin_transaction()
                producer.send(stream, b"txn %d" % n, partition=0)
                if commit:
                    await producer.commit_transaction()
                else:
                    await producer.abort_transaction()

    asyncio.run(write())
    expected = http_events(server, stream)
    assert expected == [(0, b"txn 0")]
    return stream, expected


def test_a_page_of_only_markers_moves_a_reader_to_the_end(
    server: Server, ends_in_markers: tuple[str, Events]
) -> None:
    stream, expected = ends_in_markers
    with headwater.connect(server.address) as client:
        end = client.stream_info(stream).next_offset
        assert end == 4  # event, commit marker, aborted event, abort marker
        assert scanned(client, stream, 1 << 20) == expected
        for start in range(1, end):
            page = client.read(stream, start)
            assert page.events == [] and page.at_end
    for start in range(1, end):
        page = http(server, "GET", f"/api/streams/{stream}/events?from={start}")
        assert page["events"] == []
        assert page["next_offset"] == page["end_offset"] == end


@pytest.mark.parametrize("which", ["compacted", "transactions", "ends_in_markers"])
def test_the_spark_readers_readevents_path_gives_the_http_paths_rows(
    server: Server, which: str, request: pytest.FixtureRequest
) -> None:
    stream, expected = request.getfixturevalue(which)
    with headwater.connect(server.address) as client:
        end = client.stream_info(stream).next_offset
    reader = RangeReader(
        ConnectionOptions(server=server.address), stream, 0, end, True, "raw", ROW_SCHEMA
    )
    rows = {
        # ReadEvents carries no keys: every other column is the same on both paths.
        via_http: pa.Table.from_batches(list(reader.batches(via_http=via_http)), ROW_SCHEMA)
        .drop_columns(["key"])
        .to_pydict()
        for via_http in (True, False)
    }
    assert rows[False] == rows[True]
    got = rows[False]
    assert list(zip(got["offset"], got["value"], strict=True)) == expected
