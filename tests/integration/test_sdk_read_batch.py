"""``Client.read_batch``: a page of events left in wire form, for bulk consumers."""

from __future__ import annotations

from typing import Any

import headwater


def test_read_batch_matches_read(shared_server: Any, sdk_stream_name: str):
    values = [b"x" * (i % 50) + str(i).encode() for i in range(3000)]
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, values)
        page = hw.read_batch(sdk_stream_name, 100, max_bytes=10_000)
        plain = hw.read(sdk_stream_name, 100, max_bytes=10_000)
        assert page.first_offset == 100
        assert page.events.values() == [e.value for e in plain.events]
        assert page.next_offset == plain.next_offset == 100 + page.events.count
        assert not page.at_end
        last = hw.read_batch(sdk_stream_name, 2990)
        assert last.events.values() == values[2990:] and last.at_end
        assert last.next_offset == 3000
        beyond = hw.read_batch(sdk_stream_name, 3000)
        assert beyond.events.count == 0 and beyond.at_end and beyond.next_offset == 3000
