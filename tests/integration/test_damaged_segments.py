"""Damage to a stopped server's segments, by hand, as a disk or an operator does it.

* A sealed segment deleted from the middle of a log of ``cleanup_policy = delete`` (a
  hole: fsck, a mistaken ``rm``) once passed ``headwater check`` ("all CRCs and indexes
  ok") and the server's start without a word, reads skipping the lost offsets. Retention
  only ever removes the oldest segments, so in such a log a segment starting past the
  previous one's end is damage: check names it, the server logs it.
* One flipped byte in the middle of a sealed segment: the batch holding it is never
  served, and a read whose page reaches it answers the intact events before it (it
  once failed whole: a reader paging from 100 never got the intact 100..129), as a
  Kafka fetch returns the valid batches before a damaged one.
* The same damage stalled SQL for the whole tenant: every query waited for the damaged
  stream's projection and answered ProjectionLag after 30 s. Now only a query reading
  that table is refused (StorageError, at once); the rows before the damage are served
  by range reads.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
from servers import LOCAL, Server, headwater_cli, http_call

CONFIG = "[storage]\nsegment_bytes = 4096\n"
LISTEN = {"http": LOCAL}


def stopped_server_with_segments(make_server: Callable[..., Server]) -> tuple[Server, Path]:
    """A stopped server whose stream "s" holds offsets 0..299 in batches of 10, in
    several sealed segments and a tail."""
    server = make_server(config=CONFIG, listen=dict(LISTEN))
    assert http_call(server, "POST", "/api/streams", {"name": "s"})[0] == 201
    for b in range(30):
        values = [f"event-{b * 10 + j:05d}-" + "x" * (20 + (b * 10 + j) % 50) for j in range(10)]
        assert http_call(server, "POST", "/api/streams/s/events", values)[0] == 200
    assert server.stop() == 0
    (partition,) = server.data_dir.glob("tenants/0/streams/*/partition-0")
    return server, partition


def segments(partition: Path) -> list[Path]:
    return sorted(partition.glob("*.log"))


def test_a_sealed_segment_missing_from_the_middle_is_reported(
    make_server: Callable[..., Server],
) -> None:
    server, partition = stopped_server_with_segments(make_server)
    logs = segments(partition)
    assert len(logs) >= 4
    lost = logs[2]  # sealed, neither the first nor the tail
    lost_first = int(lost.name[:-4])
    for suffix in (".log", ".index", ".timeindex"):
        lost.with_suffix(suffix).unlink()

    result = headwater_cli("check", str(server.data_dir))
    assert result.returncode == 1, (
        f"headwater check passes a log with offsets from {lost_first} missing:\n"
        + result.stdout[-600:]
    )
    hole = f"offsets {lost_first}..{int(logs[3].name[:-4]) - 1}"
    assert f"{hole} before it are in no segment" in result.stdout, result.stdout[-600:]

    server.start()
    assert f"{hole} are in no segment" in server.log_text(), server.log_tail()
    status, answer = http_call(server, "GET", "/api/streams/s/events?from=0&limit=1000")
    assert status == 200
    offsets = [e["offset"] for e in answer["events"]]
    assert lost_first - 1 in offsets and lost_first not in offsets


def test_a_read_reaching_a_damaged_batch_serves_the_intact_events_before_it(
    make_server: Callable[..., Server],
) -> None:
    server, partition = stopped_server_with_segments(make_server)
    victim = segments(partition)[2]  # sealed: offsets 110..159, in batches of 10
    assert victim.name == f"{110:020d}.log"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A  # inside the batch of offsets 130..139
    victim.write_bytes(bytes(data))

    server.start()
    status, answer = http_call(server, "GET", "/api/streams/s/events?from=130&limit=1")
    assert status == 503 and answer["error"]["name"] == "StorageError"  # never served
    status, answer = http_call(server, "GET", "/api/streams/s/events?from=100&limit=100")
    assert status == 200, f"the intact offsets 100..129 are not served: {status} {answer}"
    assert [e["offset"] for e in answer["events"]] == list(range(100, 130))
    assert answer["next_offset"] == 130


def test_a_damaged_stream_fails_only_the_queries_that_read_it(
    make_server: Callable[..., Server],
) -> None:
    server, partition = stopped_server_with_segments(make_server)
    server.start()
    assert http_call(server, "POST", "/api/streams", {"name": "t"})[0] == 201
    assert http_call(server, "POST", "/api/streams/t/events", ["a", "b", "c"])[0] == 200
    assert server.stop() == 0
    victim = segments(partition)[2]  # sealed: offsets 110..159
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x5A  # inside the batch of offsets 130..139
    victim.write_bytes(bytes(data))

    server.start()
    # Another stream's table answers at once, holding every write acknowledged since.
    assert http_call(server, "POST", "/api/streams/t/events", ["d"])[0] == 200
    status, answer = http_call(server, "POST", "/api/sql", {"sql": "SELECT count(*) FROM t"})
    assert status == 200, f"a query over t waits on s's damage: {status} {answer}"
    assert answer["rows"] == [[4]]
    # A query that reads the damaged stream is refused, naming it and what is wrong.
    status, answer = http_call(server, "POST", "/api/sql", {"sql": "SELECT count(*) FROM s"})
    assert status == 503, (status, answer)
    assert answer["error"]["name"] == "StorageError", answer
    message = answer["error"]["message"]
    assert "stream s" in message and "CRC mismatch in batch at offset 130" in message, message
    # The range read under the Spark source: the rows before the damage are served,
    # a range reaching it is refused at once (it waited for the read timeout).
    with urllib.request.urlopen(
        f"http://{server.address_of('http')}/api/streams/s/arrow?to=130"
    ) as ok:
        rows = pa.ipc.open_stream(ok.read()).read_all()
    assert rows.column("offset").to_pylist() == list(range(130))
    status, answer = http_call(server, "GET", "/api/streams/s/arrow?from=0&to=140")
    assert status == 503 and "offset 130" in answer["error"]["message"], (status, answer)
