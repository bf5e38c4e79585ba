"""ReadEvents with read-ahead against a real server: every page is what a fresh read
answers, also when a page read ahead reached the end and events were appended before
the reader asked for it, and with more sequential readers than read-ahead pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kimberlite_raw as kr
import pytest
from servers import Server, serving

EVENT = 1000
PAGE = 10 * EVENT  # ten events a page


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from serving(tmp_path, clean_log=True)


def values(start: int, stop: int) -> list[bytes]:
    return [f"{i:08d}".encode().ljust(EVENT, b".") for i in range(start, stop)]


def test_pages_equal_fresh_reads_and_a_page_ahead_past_the_end_is_not_served(
    server: Server,
) -> None:
    with server.client() as client:
        stream = kr.create_stream(client, "paged")
        for start in range(0, 295, 59):
            kr.append(client, stream, values(start, start + 59))
        offset = 0
        while offset < 290:
            events, next_offset = kr.read(client, stream, offset, PAGE)
            assert events == values(offset, offset + 10)
            assert next_offset == offset + 10
            offset = next_offset
        # The page from 290 was read ahead and reached the end (five events); five
        # more are stored before the reader asks for it, so it must get ten.
        kr.append(client, stream, values(295, 300))
        events, next_offset = kr.read(client, stream, 290, PAGE)
        assert events == values(290, 300)
        kr.append(client, stream, values(300, 301))
        events, next_offset = kr.read(client, stream, 300, PAGE)
        assert (events, next_offset) == (values(300, 301), None)


def test_more_readers_than_read_ahead_pages_each_get_their_own_pages(server: Server) -> None:
    with server.client() as writer:
        stream = kr.create_stream(writer, "shared")
        kr.append(writer, stream, values(0, 200))
    clients = [server.client() for _ in range(4)]
    try:
        # Readers at different offsets, taking turns page by page: pages read ahead for
        # one are dropped for another's (two held at most), never handed to the wrong one.
        offsets = [0, 7, 50, 123]
        while any(o < 200 for o in offsets):
            for i, client in enumerate(clients):
                if offsets[i] >= 200:
                    continue
                events, next_offset = kr.read(client, stream, offsets[i], PAGE)
                stop = min(offsets[i] + 10, 200)
                assert events == values(offsets[i], stop)
                assert next_offset == (stop if stop < 200 else None)
                offsets[i] = stop
    finally:
        for client in clients:
            client.close()
