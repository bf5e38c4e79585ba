"""Reads of old data stream from the segment files with bounded read-ahead: a stream
many times larger than the server's memory budget, read from offset 0 through every read
path (Kimberlite ReadEvents, a subscription from offset 0, the HTTP Arrow range read the
Spark source uses), plain and compressed, while the server's RssAnon is sampled from
/proc: it stays within the budget the whole time, and the data read back is all there."""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable

import pytest
from memory_probe import MIB, RssSampler
from servers import LOCAL, Server

import headwater
from headwater.server.memory import process_memory
from waiting import wait_until

# Sizes: the stored data is several times the budget. HW_BOUNDED_READ_MIB scales it.
STREAM_MIB = int(os.environ.get("HW_BOUNDED_READ_MIB", "256"))  # per stream, two streams
BUDGET_MIB = 300
EVENT_BYTES = 1000
EVENTS = STREAM_MIB * MIB // EVENT_BYTES
APPEND_EVENTS = 2000

CONFIG = f"""
[storage]
sync = "none"
segment_bytes = {16 * MIB}
compression = "zstd"
maintenance_interval_ms = 300

[limits]
memory_mib = {BUDGET_MIB}
sql_memory_mib = 32
max_connections = 100
"""


def event(i: int) -> bytes:
    """A JSON event of EVENT_BYTES bytes that says which offset it is."""
    head = b'{"i":%d,"user":"user-%d","action":"view","page":"/items/%d","pad":"' % (
        i,
        i % 1013,
        i % 97,
    )
    return head + b"x" * (EVENT_BYTES - len(head) - 2) + b'"}'


def create_plain_stream(server: Server, name: str) -> None:
    """A stream whose settings keep it uncompressed (the server default is zstd)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.ports["http"], timeout=30)
    body = json.dumps({"name": name, "settings": {"compression": "none"}})
    conn.request("POST", "/api/streams", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    answer = json.loads(reply.read())
    conn.close()
    assert reply.status in (200, 201), answer
    assert answer["settings"]["compression"] == "none", answer


def fill(hw: headwater.Client, name: str) -> None:
    for first in range(0, EVENTS, APPEND_EVENTS):
        hw.append(name, [event(i) for i in range(first, min(first + APPEND_EVENTS, EVENTS))])


def read_all_kimberlite(hw: headwater.Client, name: str) -> tuple[int, int]:
    """(events, value bytes) of ReadEvents pages from offset 0 to the end."""
    offset = count = total = 0
    while True:
        page = hw.read_batch(name, offset, 8 * MIB)
        values = page.events.values()
        assert page.first_offset == offset
        if values:
            assert values[0] == event(offset) and values[-1] == event(offset + len(values) - 1)
        count += len(values)
        total += sum(map(len, values))
        offset = page.next_offset
        if page.at_end:
            return count, total


def subscribe_all(hw: headwater.Client, name: str) -> int:
    """Events pushed to a subscription from offset 0 until the end, checked in order."""
    seen = 0
    with hw.subscribe(name, 0, credits=8192) as sub:
        while seen < EVENTS:
            batch = sub.next_batch(timeout=30)
            assert batch, f"the subscription stalled at {seen}"
            assert batch[0].offset == seen and batch[-1].offset == seen + len(batch) - 1
            assert batch[-1].value == event(batch[-1].offset)
            seen += len(batch)
    return seen


def arrow_rows(hw: headwater.Client, name: str) -> tuple[int, int]:
    rows = offsets = 0
    for batch in hw.read_arrow(name, 0):
        rows += batch.num_rows
        offsets += sum(batch.column("offset").to_pylist())
    return rows, offsets


@pytest.mark.slow  # about 30 s: half a GiB written, read three ways twice
def test_reads_from_offset_zero_stay_within_the_memory_budget(
    make_server: Callable[..., Server],
) -> None:
    server = make_server(config=CONFIG, listen={"http": LOCAL})
    create_plain_stream(server, "plain")
    with headwater.connect(server.address) as hw:
        hw.create_stream("packed")
        fill(hw, "plain")
        fill(hw, "packed")
        stored = hw.stream_info("plain").size_bytes
        assert stored >= STREAM_MIB * MIB
        # Maintenance compresses the sealed segments of "packed" only.
        wait_until(
            lambda: hw.stream_info("packed").size_bytes * 4 < stored,
            timeout=120,
            message=lambda: f"packed not compressed: {hw.stream_info('packed')}",
        )
        assert hw.stream_info("plain").size_bytes == stored
        after_writes = process_memory(server.pid)
        assert after_writes is not None
    # Restarted, the server holds what any amount of data costs (projection tails, no
    # events): the reads below then show what reading costs.
    server.restart()
    with headwater.connect(server.address) as hw:
        for name in ("plain", "packed"):  # the projections have replayed their tails
            assert hw.query(f"SELECT count(*) FROM {name}").rows == [(EVENTS,)]
        at_start = process_memory(server.pid)
        assert at_start is not None
        with RssSampler(server.pid) as sampler:
            for name in ("plain", "packed"):
                sampler.phase = f"ReadEvents {name}"
                assert read_all_kimberlite(hw, name) == (EVENTS, EVENTS * EVENT_BYTES)
                sampler.phase = f"subscription {name}"
                assert subscribe_all(hw, name) == EVENTS
                sampler.phase = f"Arrow range {name}"
                assert arrow_rows(hw, name) == (EVENTS, EVENTS * (EVENTS - 1) // 2)
        summary = (
            f"{2 * STREAM_MIB} MiB stored ({hw.stream_info('packed').size_bytes / MIB:.0f} MiB"
            f" of it compressed from {STREAM_MIB}); RssAnon after the writes"
            f" {after_writes.rss_anon / MIB:.0f} MiB, after a restart"
            f" {at_start.rss_anon / MIB:.0f} MiB; reads: {sampler.report()}"
        )
        print(summary)
        assert sampler.peak_anon < BUDGET_MIB * MIB, summary
        # Reading everything twice over left the server as it was: it still serves.
        assert hw.read("packed", EVENTS - 1).events[0].value == event(EVENTS - 1)
    with headwater.connect(server.address) as other:
        assert other.stream_info("plain").next_offset == EVENTS
