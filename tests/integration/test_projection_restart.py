"""Sealed projection files with a real server: enough events to seal several files
(``SEAL_ROWS`` rows each), a SIGKILL in the middle of writing, a restart that reuses the
files as they are (same inodes, never rewritten) and answers Query and QueryAt exactly,
and a damaged file found at start and rebuilt from the log while the server serves."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from kimberlite_raw import RawClient, append, create_stream, query, query_at, rows_of
from servers import Server

from headwater.protocols.kimberlite.messages import DeleteStreamRequest
from headwater.sql.check import verify_projections
from headwater.sql.projection import SEAL_ROWS
from headwater.sql.sealed import list_sealed, projection_directory
from waiting import wait_until

BATCH = 8_000
EVENTS = 7 * SEAL_ROWS + 5_000  # several sealed files (rounds merge up to two seals) and a tail
TOTALS = "SELECT count(*), count(json), sum(\"offset\"), sum((json->>'i')::BIGINT) FROM s"


def value(i: int) -> bytes:
    return b"not json %d" % i if i % 5 == 0 else b'{"i":%d}' % i


def totals(upto: int) -> list[list[object]]:
    json_ones = [i for i in range(upto) if i % 5]
    return [[upto, len(json_ones), sum(range(upto)), sum(json_ones)]]


def files_of(server: Server, stream_id: int) -> dict[str, tuple[int, int]]:
    stream_dir = server.data_dir / "tenants" / "0" / "streams" / str(stream_id)
    found = list_sealed(projection_directory(stream_dir))
    return {p.name: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for _, _, p in found}


def test_restart_reuses_sealed_files_and_rebuilds_a_damaged_one(
    make_server: Callable[..., Server],
) -> None:
    server = make_server()
    with server.client() as c:
        stream_id = create_stream(c, "s")
        other = create_stream(c, "other")
        for first in range(0, EVENTS, BATCH):
            append(c, stream_id, [value(i) for i in range(first, min(first + BATCH, EVENTS))])
            append(c, other, [b"o"])
        assert rows_of(query(c, TOTALS)) == totals(EVENTS)
    sealed = files_of(server, stream_id)
    assert len(sealed) >= 3

    # SIGKILL while a writer appends: every acknowledged append must be there after.
    acked = [EVENTS]
    stop = threading.Event()

    def writer() -> None:
        try:
            with server.client() as w:
                while not stop.is_set():
                    n = acked[0]
                    append(w, stream_id, [value(i) for i in range(n, n + 500)])
                    acked[0] = n + 500
        except (OSError, AssertionError):
            return  # the server was killed under the append

    thread = threading.Thread(target=writer)
    thread.start()
    wait_until(lambda: acked[0] >= EVENTS + 5_000, message="the writer made no progress")
    server.kill()
    stop.set()
    thread.join()
    server.start()
    with server.client() as c:
        rows = rows_of(query(c, 'SELECT max("offset") + 1 FROM s'))
        end = rows[0][0]
        assert isinstance(end, int)
        assert end >= acked[0]  # an unacknowledged append may have made it too
        assert rows_of(query(c, TOTALS)) == totals(end)
        middle = rows_of(query(c, 'SELECT position FROM s WHERE "offset" = 100000'))[0][0]
        assert isinstance(middle, int)
        assert rows_of(query_at(c, TOTALS, middle)) == totals(100_000)
    after = files_of(server, stream_id)
    assert {name: after[name] for name in sealed} == sealed  # opened, never rewritten

    # A damaged file is found at start and rebuilt from the log; the others are kept.
    server.stop()
    assert not [r for r in verify_projections(server.data_dir) if r.damaged]
    victim = sorted(sealed)[1]
    path = next(server.data_dir.glob(f"tenants/0/streams/{stream_id}/projection-0/{victim}"))
    os.truncate(path, path.stat().st_size - 100)
    server.start()
    with server.client() as c:
        assert rows_of(query(c, TOTALS)) == totals(end)
        assert rows_of(query_at(c, TOTALS, middle)) == totals(100_000)
    with RawClient(server.port) as another:
        assert rows_of(query(another, "SELECT count(*) FROM other")) == [[EVENTS // BATCH + 1]]
    rebuilt = files_of(server, stream_id)
    assert victim in rebuilt and rebuilt[victim] != sealed[victim]
    assert {n: rebuilt[n] for n in sealed if n != victim} == {
        n: sealed[n] for n in sealed if n != victim
    }
    assert "dropped, rebuilt from the log" in server.log_text()
    server.stop()
    assert not [r for r in verify_projections(server.data_dir) if r.damaged]


def test_files_live_beside_the_log(make_server: Callable[..., Server]) -> None:
    """The projection directory is the stream's: deleting the stream removes it."""
    server = make_server()
    with server.client() as c:
        stream_id = create_stream(c, "gone")
        for first in range(0, 3 * SEAL_ROWS, BATCH):
            append(c, stream_id, [value(i) for i in range(first, first + BATCH)])
        rows_of(query(c, "SELECT count(*) FROM gone"))
        assert files_of(server, stream_id)
        stream_dir = server.data_dir / "tenants" / "0" / "streams" / str(stream_id)
        c.call(DeleteStreamRequest(stream_id))
        wait_until(lambda: not stream_dir.exists(), message="the stream's files stayed")
        assert rows_of(query(c, "SELECT 1")) == [[1]]
    server.stop()
