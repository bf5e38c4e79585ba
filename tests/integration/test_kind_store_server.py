"""A real server holding a kind with many more entities than its hot set (``[convergedb]
hot_entities``): memory stays flat as the kind grows, and restarts (SIGTERM and SIGKILL
in the middle of writes) keep every acknowledged entity, which QUERY, a bootstrap and
SQL all read back (most of them from the kind's store on disk).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from convergedb_raw import CdbClient, eid, query_many
from kimberlite_raw import query as sql_query
from kimberlite_raw import rows_of
from servers import LOCAL, Server

from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType
from waiting import wait_until

LISTEN = {"convergedb": LOCAL}
HOT = 1_000
CONFIG = f"""
[convergedb]
hot_entities = {HOT}
default_liveness_ms = 600000
"""
FIELDS = [("n", FieldType.U64), ("x", FieldType.F64)]
BATCH = 1_000


def rss_anon_kib(pid: int) -> int:
    """The process's anonymous resident memory (heap, not file pages)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc status")


def write(client: CdbClient, kind_id: int, numbers: range, round_: int = 0) -> None:
    """ASSERT ``(n, n + round_)`` for each number, a BATCH at a time, each acknowledged."""
    for start in range(numbers.start, numbers.stop, BATCH):
        ops = tuple(
            m.Assert.of(FIELDS, kind_id, eid(n), [n, float(n + round_)])
            for n in range(start, min(start + BATCH, numbers.stop))
        )
        reply = client.call(m.Batch(ops))
        assert isinstance(reply, m.Ack), reply


def bootstrap(port: int, kind_id: int) -> dict[bytes, list[object]]:
    """A read-only client's bootstrap of the kind: entity -> field values."""
    with CdbClient(port, read_only=True, timeout=60) as reader:
        stream = reader.send(m.Subscribe(kind_id, bootstrap=True))
        frames = reader.collect(
            lambda f: f.stream_id == stream and isinstance(f.message, m.BootstrapEnd), timeout=120
        )
    return {
        f.message.entity_id: list(f.message.fields(FIELDS))
        for f in frames
        if f.stream_id == stream and isinstance(f.message, m.State)
    }


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Server]:
    server = Server(tmp_path / "kinds", config=CONFIG, listen=LISTEN).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.slow
def test_a_kind_far_past_its_hot_set_keeps_memory_flat_and_survives_restarts(
    server: Server,
) -> None:
    port = server.ports["convergedb"]
    with CdbClient(port, name="loader", source_id=3, deadline_ms=600_000) as writer:
        kind_id = writer.create_kind("big", FIELDS).kind_id
        write(writer, kind_id, range(10_000))
        before = rss_anon_kib(server.pid)
        write(writer, kind_id, range(10_000, 60_000))
        grown = rss_anon_kib(server.pid) - before
    # All in memory, 50,000 more entities of this kind add ~16 MiB of RssAnon (measured
    # with hot_entities = 1,000,000); with a hot set of 1,000 under 1 MiB: the rest are
    # in the store's file pages, which are not anonymous memory.
    assert grown < 6 * 1024, f"RssAnon grew {grown} KiB for 50,000 entities"

    server.restart()  # SIGTERM: checkpointed at close, nothing to rebuild
    assert "building the entity store" not in server.log_text()
    port = server.ports["convergedb"]
    everything = bootstrap(port, kind_id)
    assert len(everything) == 60_000
    assert everything[eid(12_345)] == [12_345, 12_345.0]
    with CdbClient(port, read_only=True) as reader:
        sample = [eid(n) for n in range(0, 60_000, 97)]
        replies = query_many(reader, kind_id, sample)
    for n, entity in zip(range(0, 60_000, 97), sample, strict=True):
        reply = replies[entity]
        assert isinstance(reply, m.State), reply
        assert list(reply.fields(FIELDS)) == [n, float(n)]
    with server.client() as sql:
        rows = rows_of(sql_query(sql, "SELECT count(*), sum(n), max(x) FROM big"))
    [[count, total, highest]] = rows
    assert (count, total, float(str(highest))) == (60_000, sum(range(60_000)), 59_999.0)

    # SIGKILL while a writer rewrites every entity: whatever was acknowledged is there.
    acked = [0]
    stop = threading.Event()

    def rewrite() -> None:
        with CdbClient(port, name="loader", source_id=3, deadline_ms=600_000) as again:
            for start in range(0, 60_000, BATCH):
                if stop.is_set():
                    return
                try:
                    write(again, kind_id, range(start, start + BATCH), round_=1)
                except (OSError, AssertionError):
                    return  # the server died under it
                acked[0] = start + BATCH

    thread = threading.Thread(target=rewrite)
    thread.start()
    try:
        wait_until(lambda: acked[0] >= 20_000, 60, "the rewrite does not progress")
        server.kill()
    finally:
        stop.set()
        thread.join()
    done = acked[0]
    server.start()
    port = server.ports["convergedb"]
    everything = bootstrap(port, kind_id)
    assert len(everything) == 60_000
    rewritten = [n for n in range(60_000) if everything[eid(n)][1] == float(n + 1)]
    assert rewritten == list(range(len(rewritten)))  # a prefix, in write order
    assert len(rewritten) >= done  # every acknowledged batch is there
    with CdbClient(port, name="after") as other:  # and the server serves writers again
        write(other, kind_id, range(60_000, 60_010))
        got = query_many(other, kind_id, [eid(60_005), eid(5)])
    assert list(got[eid(60_005)].fields(FIELDS)) == [60_005, 60_005.0]  # type: ignore[union-attr]
    assert list(got[eid(5)].fields(FIELDS)) == [5, 6.0]  # type: ignore[union-attr]
    status = server.stop()
    assert status == 0, server.log_tail()
