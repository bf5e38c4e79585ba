"""Reading an entity kind with the headwater Spark format: current state, as of a log
position, every field type, split into partitions; its changelog as a stream, resumed
from a checkpoint and followed live; and the errors a user can meet."""

from __future__ import annotations

import decimal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from convergedb_raw import CdbClient, eid
from servers import LOCAL, Server, serving

from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.fields import FieldType
from waiting import wait_until

pytestmark = pytest.mark.spark

FIELDS = [
    ("temp", FieldType.F64),
    ("label", FieldType.STRING),
    ("count", FieldType.U32),
    ("big", FieldType.U64),
    ("raw", FieldType.BYTES),
    ("at", FieldType.TIMESTAMP),
    ("ok", FieldType.BOOL),
]
BASE_NS = 1_700_000_000_123_456_000


def values(i: int) -> list[Any]:
    return [
        i + 0.5,
        f"s{i}",
        i * 3,
        2**64 - 1 - i,
        bytes([i, 255 - i]),
        BASE_NS + i * 1000,
        i % 2 == 0,
    ]


@pytest.fixture(scope="module")
def kind_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Kinds over ConvergeDB; the HTTP API off (kinds are read over Kimberlite)."""
    yield from serving(tmp_path_factory.mktemp("spark_kinds"), listen={"convergedb": LOCAL})


def _read(spark: Any, server: Server, **options: str) -> Any:
    reader = spark.read.format("headwater").option("server", f"127.0.0.1:{server.port}")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _sql_scalar(server: Server, sql: str) -> int:
    import headwater

    with headwater.connect(f"127.0.0.1:{server.port}") as hw:
        return int(str(hw.query(sql).scalar()))


def test_kind_state_now_and_as_of_a_position(spark: Any, kind_server: Server) -> None:
    with CdbClient(kind_server.ports["convergedb"], name="writer") as writer:
        kind = writer.create_kind("sensors", [(n, int(t)) for n, t in FIELDS])
        writer.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind.kind_id, eid(i), values(i)) for i in range(30)))
        )
        writer.barrier()
        before = _sql_scalar(kind_server, "SELECT max(version) + 1 FROM sensors")
        writer.send(m.Retract(kind.kind_id, eid(0)))
        writer.send(m.Patch.of(FIELDS, kind.kind_id, eid(1), {0: -7.25}))
        writer.barrier()

        now = _read(spark, kind_server, kind="sensors", rowsPerPartition="7")
        assert [f.name for f in now.schema.fields] == ["entity_id", "version", "deleted"] + [
            n for n, _ in FIELDS
        ] + ["entity_key"]
        assert now.rdd.getNumPartitions() == 5  # 29 entities, 7 per partition
        rows = {r.entity_id: r for r in now.collect()}
        assert sorted(rows) == [eid(i).hex() for i in range(1, 30)]
        assert not any(r.deleted for r in rows.values())  # a state read: nothing deleted
        assert rows[eid(1).hex()].temp == -7.25 and rows[eid(2).hex()].temp == 2.5
        r = rows[eid(5).hex()]
        assert (r.label, r["count"], r.big, bytes(r.raw), r.ok) == (
            "s5",
            15,
            decimal.Decimal(2**64 - 6),
            bytes([5, 250]),
            False,
        )
        micros = {
            x.entity_id: x.us
            for x in now.selectExpr("entity_id", "unix_micros(at) AS us").collect()
        }
        assert micros[eid(5).hex()] == (BASE_NS + 5000) // 1000  # nanoseconds cut to Spark's micros
        assert rows[eid(1).hex()].version >= before > rows[eid(2).hex()].version

        then = _read(spark, kind_server, kind="sensors", asOf=str(before))
        old = {r.entity_id: r for r in then.collect()}
        assert sorted(old) == [eid(i).hex() for i in range(30)]
        assert old[eid(1).hex()].temp == 1.5 and old[eid(0).hex()].label == "s0"


def test_kind_read_errors(spark: Any, kind_server: Server) -> None:
    with pytest.raises(Exception, match="kind no_such_kind does not exist"):
        _read(spark, kind_server, kind="no_such_kind").collect()
    with pytest.raises(Exception, match="kind: invalid name"):
        _read(spark, kind_server, kind='x" OR 1=1 --').collect()
    with pytest.raises(Exception, match="asOf must be a log position"):
        _read(spark, kind_server, kind="sensors", asOf="yesterday").collect()
    with pytest.raises(Exception, match="does not go with kind"):
        _read(spark, kind_server, kind="sensors", stream="s").collect()
    stream = (
        spark.readStream.format("headwater")
        .option("kind", "sensors")
        .option("asOf", "3")
        .option("server", f"127.0.0.1:{kind_server.port}")
        .load()
    )
    with pytest.raises(Exception, match="asOf reads a kind's state in batch"):
        query = stream.writeStream.format("noop").start()
        try:
            query.awaitTermination(60)
        finally:
            query.stop()
    with pytest.raises(Exception, match="startingPosition must be a log position"):
        _read(spark, kind_server, kind="sensors", startingPosition="soon").collect()


READING = [("temp", FieldType.F64), ("deleted", FieldType.U8)]


def _changes(spark: Any, server: Server, **options: str) -> Any:
    reader = (
        spark.readStream.format("headwater")
        .option("server", f"127.0.0.1:{server.port}")
        .option("kind", "readings")
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _run_available_now(df: Any, out: Path, checkpoint: Path) -> None:
    query = (
        df.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None


def test_kind_changelog_stream_resumes_from_its_checkpoint(
    spark: Any, kind_server: Server, tmp_path: Path
) -> None:
    """Every change once, in log order, deletions flagged; a restarted query reads only
    what came after its checkpoint."""
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with CdbClient(kind_server.ports["convergedb"], name="changes-writer") as writer:
        kind = writer.create_kind("readings", [(n, int(t)) for n, t in READING])
        writer.send(
            m.Batch(
                tuple(m.Assert.of(READING, kind.kind_id, eid(i), [i + 0.5, i]) for i in range(10))
            )
        )
        writer.barrier()
        df = _changes(spark, kind_server, rowsPerPartition="4")
        assert [f.name for f in df.schema.fields] == [
            "entity_id",
            "version",
            "deleted",
            "temp",
            "field_deleted",
            "entity_key",
        ]
        _run_available_now(df, out, checkpoint)
        first = spark.read.parquet(str(out)).orderBy("version").collect()
        assert [(r.entity_id, r.deleted, r.temp, r.field_deleted) for r in first] == [
            (eid(i).hex(), False, i + 0.5, i) for i in range(10)
        ]

        writer.send(m.Patch.of(READING, kind.kind_id, eid(1), {0: -1.0}))
        writer.send(m.Retract(kind.kind_id, eid(2)))
        writer.send(m.Assert.of(READING, kind.kind_id, eid(10), [10.5, 10]))
        writer.barrier()
        _run_available_now(_changes(spark, kind_server, rowsPerPartition="4"), out, checkpoint)
        rows = spark.read.parquet(str(out)).orderBy("version").collect()
    assert len(rows) == 13 and len({r.version for r in rows}) == 13
    assert rows[:10] == first
    assert {(r.entity_id, r.deleted, r.temp) for r in rows[10:]} == {
        (eid(1).hex(), False, -1.0),
        (eid(2).hex(), True, None),
        (eid(10).hex(), False, 10.5),
    }
    # The versions are the kind's own: the state's version of eid 1 is its patch's.
    state = {r.entity_id: r.version for r in _read(spark, kind_server, kind="readings").collect()}
    assert state[eid(1).hex()] == next(r.version for r in rows[10:] if r.entity_id == eid(1).hex())


def test_kind_changelog_stream_from_latest_follows_live_changes(
    spark: Any, kind_server: Server
) -> None:
    with CdbClient(kind_server.ports["convergedb"], name="live-writer") as writer:
        kind = writer.create_kind("readings", [(n, int(t)) for n, t in READING])
        writer.send(m.Assert.of(READING, kind.kind_id, eid(50), [50.0, 0]))
        writer.barrier()
        query = (
            _changes(spark, kind_server, startingPosition="latest")
            .writeStream.format("memory")
            .queryName("live_changes")
            .trigger(processingTime="500 milliseconds")
            .start()
        )
        try:
            # The first trigger fixes "latest" before the writes.
            wait_until(lambda: query.recentProgress, 60, "the query never triggered")
            for i in range(51, 56):
                writer.send(m.Assert.of(READING, kind.kind_id, eid(i), [float(i), 1]))
                writer.barrier()

            def five_seen() -> list[Any] | None:
                assert query.exception() is None, query.exception()
                rows = spark.sql("SELECT * FROM live_changes ORDER BY version").collect()
                return rows if len(rows) >= 5 else None

            seen = wait_until(five_seen, 60, "the live changes did not all arrive")
            assert query.exception() is None
        finally:
            query.stop()
    assert [(r.entity_id, r.temp) for r in seen] == [
        (eid(i).hex(), float(i)) for i in range(51, 56)
    ]
