"""SQL over a stream whose projection is partly sealed files on disk and partly an
in-memory tail answers exactly what an all-in-memory table of the same events answers:
Query, and QueryAt at any position, while appends interleave with another stream's,
retention moves the log's start and the server restarts (reopening its files). The
reference is built straight from the appended events in a plain DuckDB connection."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.errors import InvalidOffset
from headwater.sql import SqlService
from headwater.sql import projection as projection_module
from headwater.storage.log import SyncPolicy

CONFIG = EngineConfig(maintenance_interval_ms=0, sync=SyncPolicy("none"))
ROWS = 'SELECT "offset", position, epoch_us(ts), data, json::VARCHAR FROM s ORDER BY "offset"'
TOTALS = (
    'SELECT count(*), count(json), sum(octet_length(data)), min(position), max("offset") '
    "FROM s WHERE data <> 'zzz'::BLOB"
)
REFERENCE_VIEW = """
CREATE OR REPLACE VIEW s AS SELECT "offset", position, make_timestamp(ts_us) AS ts, data,
  CASE WHEN coalesce(json_valid(try(decode(data))), false) THEN decode(data) END::JSON AS json
FROM raw WHERE "offset" >= $start AND position < $position
"""

values = st.one_of(
    st.builds(lambda i: json.dumps({"i": i}).encode(), st.integers(-5, 5)),
    st.sampled_from([b"", b"zzz", b"\xff\xfe", b"[1, 2]", b'"s"', b"{bad"]),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(values, min_size=1, max_size=9)),
        st.tuples(st.just("other"), st.just([])),
        st.tuples(st.just("retain"), st.just([])),
        st.tuples(st.just("restart"), st.just([])),
        st.tuples(st.just("query"), st.just([])),
    ),
    min_size=1,
    max_size=25,
)


def reference(events: list[tuple[int, int, int, bytes]], start: int, position: int) -> list[list]:
    raw = pa.table(
        {
            "offset": pa.array([e[0] for e in events], pa.int64()),
            "position": pa.array([e[1] for e in events], pa.int64()),
            "ts_us": pa.array([e[2] * 1000 for e in events], pa.int64()),
            "data": pa.array([e[3] for e in events], pa.binary()),
        }
    )
    con = duckdb.connect()
    con.register("raw", raw)
    con.execute(REFERENCE_VIEW.replace("$start", str(start)).replace("$position", str(position)))
    # Query results carry BLOBs as hex text.
    out = [
        [[v.hex() if isinstance(v, bytes) else v for v in row] for row in con.sql(ROWS).fetchall()]
    ]
    out.append([list(row) for row in con.sql(TOTALS).fetchall()])
    con.close()
    return out


async def answers(sql: SqlService, position: int | None) -> list[list]:
    out = []
    for text in (ROWS, TOTALS):
        if position is None:
            result = await sql.query(0, text)
        else:
            result = await sql.query_at(0, text, [], position)
        out.append(result.rows)
    return out


async def scenario(root: Path, steps: list[tuple[str, list[bytes]]], picks: list[int]) -> None:
    engine = await Engine.open(root, CONFIG)
    sql = SqlService(engine)
    sql.start()
    s = await engine.create_stream(0, "s", StreamSettings(segment_bytes=400, retention_bytes=900))
    other = await engine.create_stream(0, "other")
    events: list[tuple[int, int, int, bytes]] = []
    stamp = 1_000
    # QueryAt refuses positions up to the head when a query first sees retention's
    # work (after a restart, up to the head then): their answers had the rows removed.
    seen_start = history_from = 0
    try:
        for i, (op, batch) in enumerate(steps):
            if op == "append":
                stamp += 7
                info = await engine.append(0, s.stream_id, batch, timestamp_ms=stamp)
                for k, value in enumerate(batch):
                    events.append((info.base_offset + k, info.first_position + k, stamp, value))
            elif op == "other":
                await engine.append(0, other.stream_id, [b"x"])
            elif op == "retain":
                engine.stream_by_name(0, "s").log.enforce_retention()
            elif op == "restart":
                await sql.close()
                await engine.close()
                engine = await Engine.open(root, CONFIG)
                sql = SqlService(engine)
                sql.start()
                seen_start = engine.stream_by_name(0, "s").log.start_offset
                if seen_start:
                    history_from = engine.tenant(0).committed_position + 1
            start = engine.stream_by_name(0, "s").log.start_offset
            head = engine.tenant(0).committed_position
            if op == "query" or i == len(steps) - 1:
                assert await answers(sql, None) == reference(events, start, head)
                if start > seen_start:
                    seen_start, history_from = start, head + 1
                # QueryAt at a position among the events (and the head itself).
                position = head
                if events and picks:
                    position = min(head, events[picks[i % len(picks)] % len(events)][1])
                if position < history_from:
                    with pytest.raises(InvalidOffset, match="retention has removed rows"):
                        await answers(sql, position)
                else:
                    assert await answers(sql, position) == reference(events, start, position)
    finally:
        await sql.close()
        await engine.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations, st.lists(st.integers(0, 10_000), max_size=5))
def test_sealed_files_and_tail_answer_as_an_in_memory_table(
    steps: list[tuple[str, list[bytes]]], picks: list[int]
) -> None:
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as root:
        patch.setattr(projection_module, "SEAL_ROWS", 6)
        patch.setattr(projection_module, "ROUND_ROWS", 4)
        asyncio.run(scenario(Path(root), steps, picks))
