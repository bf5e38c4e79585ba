"""The headwater Spark format over partitioned streams against a real server: a read
is one Spark partition per stream partition and gives what each partition holds (the
HTTP API's JSON reads are the oracle), streaming offsets are per partition in the
checkpoint and resume after a restart, the sink places rows by explicit partition,
murmur2 of the key (Kafka's partitioner) or a sticky partition and appends nothing
twice when a task is retried, and the isolation option shows or hides transactions a
Kafka producer left open or aborted."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from servers import LOCAL, Server, serving

import headwater
from headwater.client.arrow import HttpApi
from headwater.engine.partitioner import keyed_partition
from headwater.spark.options import ConnectionOptions
from headwater.spark.streams import PartitionedAppender
from waiting import wait_until

pytestmark = pytest.mark.spark

FMT = "headwater"
PARTITIONS = 6
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serving(
        tmp_path_factory.mktemp("spark_partitions"), listen={"http": LOCAL, "kafka": LOCAL}
    )


def _new_stream(api: HttpApi, partitions: int = PARTITIONS) -> str:
    name = "p_" + uuid.uuid4().hex[:10]
    body = json.dumps({"name": name, "settings": {"partitions": partitions}}).encode()
    api.request("POST", "/api/streams", body, "application/json")
    return name


def _partition_rows(api: HttpApi, stream: str, partition: int) -> list[tuple[Any, ...]]:
    """One partition's events read alone, through the HTTP API's JSON pages (not the
    Arrow paths the Spark format takes): (offset, key, value, headers)."""
    rows: list[tuple[Any, ...]] = []
    offset = 0
    while True:
        page = api.request(
            "GET",
            f"/api/streams/{stream}/events?partition={partition}&from={offset}&limit=10000",
        )
        for e in page["events"]:
            key = base64.b64decode(e["key_b64"]) if e.get("key_b64") else None
            headers = tuple(
                (h["name"], base64.b64decode(h["value_b64"])) for h in e.get("headers", ())
            )
            rows.append((e["offset"], key, base64.b64decode(e["value_b64"]), headers or None))
        if page["next_offset"] >= page["end_offset"]:
            return rows
        offset = page["next_offset"]


def _spark_rows(df: Any) -> dict[int, list[tuple[Any, ...]]]:
    out: dict[int, list[tuple[Any, ...]]] = {}
    for r in df.collect():
        key = None if r.key is None else bytes(r.key)
        headers = tuple((h.key, bytes(h.value)) for h in r.headers) if r.headers else None
        out.setdefault(r.partition, []).append((r.offset, key, bytes(r.value), headers))
    return {p: sorted(rows) for p, rows in out.items()}


def _write(df: Any, server: Server, stream: str, **options: str) -> None:
    writer = df.write.format(FMT).option("server", server.address).option("stream", stream)
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


def _read(spark: Any, server: Server, stream: str, **options: str) -> Any:
    reader = spark.read.format(FMT).option("server", server.address).option("stream", stream)
    reader = reader.option("includeHeaders", "true")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def test_keyed_write_lands_on_murmur2_partitions_and_reads_back_in_parallel(
    spark: Any, server: Server
) -> None:
    with headwater.connect(server.address) as hw, hw.http_api() as api:
        stream = _new_stream(api)
        keyed = spark.range(0, 3000, numPartitions=3).selectExpr(
            "concat('cust-', CAST(id % 97 AS STRING)) AS key",
            "CAST(id AS STRING) AS value",
            "CASE WHEN id % 5 = 0 THEN array(named_struct('key', 'trace', 'value', "
            "CAST(CAST(id AS STRING) AS BINARY))) END AS headers",
        )
        _write(keyed, server, stream)
        # Explicit partitions win over keys; keyless rows go to a sticky partition.
        _write(
            spark.range(0, 60, numPartitions=2).selectExpr(
                "'pinned' AS key", "concat('x', CAST(id AS STRING)) AS value", "4 AS partition"
            ),
            server,
            stream,
        )
        _write(
            spark.range(0, 500, numPartitions=2).selectExpr(
                "concat('n', CAST(id AS STRING)) AS value"
            ),
            server,
            stream,
        )
        alone = {p: _partition_rows(api, stream, p) for p in range(PARTITIONS)}

    for p, rows in alone.items():  # every keyed row on its key's murmur2 partition
        assert all(
            keyed_partition(key, PARTITIONS) == p
            for _, key, value, _ in rows
            if key is not None and not value.startswith(b"x")
        )
    assert sorted(v for _, _, v, _ in alone[4] if v.startswith(b"x")) == sorted(
        b"x%d" % i for i in range(60)
    )
    keyless = [(p, v) for p, rows in alone.items() for _, k, v, _ in rows if k is None]
    assert sorted(v for _, v in keyless) == sorted(b"n%d" % i for i in range(500))
    assert len({p for p, _ in keyless}) >= 2  # sticky, rotated batch by batch
    headers = {v: h for rows in alone.values() for _, _, v, h in rows if h}
    assert headers == {b"%d" % i: (("trace", b"%d" % i),) for i in range(0, 3000, 5)}

    df = _read(spark, server, stream)
    assert df.rdd.getNumPartitions() == PARTITIONS  # one Spark partition per stream partition
    assert _spark_rows(df) == {p: rows for p, rows in alone.items() if rows}
    # A partition read alone through the format gives the same rows too.
    only = _read(
        spark,
        server,
        stream,
        startingOffsets=json.dumps({stream: {"2": 5}}),
        endingOffsets=json.dumps({stream: {str(p): 0 for p in range(PARTITIONS) if p != 2}}),
    )
    assert _spark_rows(only) == {2: alone[2][5:]}


def _failing_once(marker: Path, server: str, stream: str, fail_at: int) -> Any:
    """A UDF that, in its task's first attempt, waits until the writer has appended to
    some partition and then fails, so the retry must not append those rows again."""
    from pyspark.sql.functions import udf

    def value(n: int) -> str:
        from pyspark import TaskContext

        context = TaskContext.get()
        if n == fail_at and context is not None and context.attemptNumber() == 0:
            with headwater.connect(server) as hw, hw.http_api() as api:

                def stored() -> int:
                    parts = api.stream(stream)["partition_offsets"]
                    return sum(p["next_offset"] for p in parts)

                marker.write_text(str(wait_until(stored, 10, "the writer appended nothing")))
            raise RuntimeError("injected failure")
        return str(n)

    return udf(value, "string", useArrow=False)


def test_retried_keyed_write_task_leaves_no_duplicate(
    spark: Any, server: Server, tmp_path: Path
) -> None:
    # Arrow batches of 10,000 rows in one task; the sink gathers each partition's rows
    # up to 10,000 before sending, so the first attempt sends some before it fails (70,000
    # rows, about 11,700 a partition) and ends with partial appends the retry completes.
    total = 80_000
    with headwater.connect(server.address) as hw, hw.http_api() as api:
        stream = _new_stream(api)
        marker = tmp_path / "appended_before_failure"
        fail = _failing_once(marker, server.address, stream, total - 100)
        df = spark.range(0, total, numPartitions=1).select(fail("id").alias("value"), "id")
        df = df.selectExpr("value", "concat('k', CAST(id % 1000 AS STRING)) AS key")
        _write(df, server, stream)
        assert int(marker.read_text()) > 0  # the first attempt had appended before it failed
        rows = {p: _partition_rows(api, stream, p) for p in range(PARTITIONS)}
    values = sorted(int(v) for part in rows.values() for _, _, v, _ in part)
    assert values == list(range(total))
    assert all(
        keyed_partition(k, PARTITIONS) == p for p, part in rows.items() for _, k, _, _ in part
    )


def test_sink_attempts_ending_early_leave_each_row_once_in_order(server: Server) -> None:
    """The sink's exactly-once rule without Spark: attempts of one task whose input ends
    early at different batch boundaries (later, earlier, later again), then a complete
    one, leave every row stored once, on its key's partition, in input order. Partial
    appends of an attempt are completed by the next (a shorter stored append's rest goes
    as the next sequence), and an attempt that ends before an earlier one sends nothing
    new."""
    keys = [b"k%d" % (i % 997) for i in range(120_000)]
    batches = [
        pa.record_batch(
            {
                "value": pa.array([b"%d" % i for i in range(lo, lo + 10_000)], pa.binary()),
                "key": pa.array(keys[lo : lo + 10_000], pa.binary()),
            }
        )
        for lo in range(0, 120_000, 10_000)
    ]
    with headwater.connect(server.address) as hw, hw.http_api() as api:
        stream = _new_stream(api)
        connection = ConnectionOptions(server=server.address)
        for ended_at in (7, 4, 10, 12):  # batches each attempt's input held
            appender = PartitionedAppender(connection, stream, "job", 0)
            appender.append(iter(batches[:ended_at]))
        rows = {p: _partition_rows(api, stream, p) for p in range(PARTITIONS)}
    expected: dict[int, list[tuple[bytes, bytes]]] = {p: [] for p in range(PARTITIONS)}
    for i, key in enumerate(keys):
        expected[keyed_partition(key, PARTITIONS)].append((key, b"%d" % i))
    assert {p: [(k, v) for _, k, v, _ in part] for p, part in rows.items()} == expected


def _copy_query(spark: Any, server: Server, source: str, out: Path) -> Any:
    return (
        spark.readStream.format(FMT)
        .option("server", server.address)
        .option("stream", source)
        .option("maxOffsetsPerTrigger", "100")
        .load()
        .selectExpr("partition", "offset", "CAST(value AS STRING) AS value")
        .writeStream.format("parquet")
        .option("path", str(out / "data"))
        .option("checkpointLocation", str(out / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )


def test_streaming_offsets_per_partition_resume_after_restart(
    spark: Any, server: Server, tmp_path: Path
) -> None:
    with headwater.connect(server.address) as hw, hw.http_api() as api:
        source = _new_stream(api, 3)
        for p, count in enumerate((70, 0, 150)):
            if count:
                api.append_arrow(
                    source,
                    _batch([f"a{p}-{i}" for i in range(count)]),
                    partition=p,
                )
        query = _copy_query(spark, server, source, tmp_path)
        query.awaitTermination(120)
        assert query.exception() is None
        batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
        assert batches == [100, 100, 20]  # admission control over all partitions

        checkpoint = tmp_path / "checkpoint" / "offsets"

        def last_offsets() -> dict[str, Any]:
            files = sorted(checkpoint.glob("[0-9]*"), key=lambda f: int(f.name))
            return dict(json.loads(files[-1].read_text().splitlines()[-1]))

        assert last_offsets() == {source: {"0": 70, "1": 0, "2": 150}}
        # More events, and a partition the stream gains while the query is down: the
        # restarted query goes on from each partition's checkpointed offset and reads
        # the new partition from its start.
        api.append_arrow(source, _batch([f"b1-{i}" for i in range(40)]), partition=1)
        api.append_arrow(source, _batch([f"b2-{i}" for i in range(5)]), partition=2)
        patch = json.dumps({"partitions": 4}).encode()
        api.request("PATCH", f"/api/streams/{source}", patch, "application/json")
        api.append_arrow(source, _batch([f"b3-{i}" for i in range(8)]), partition=3)
        query = _copy_query(spark, server, source, tmp_path)
        query.awaitTermination(120)
        assert query.exception() is None
        assert last_offsets() == {source: {"0": 70, "1": 40, "2": 155, "3": 8}}
    got = sorted(
        (r.partition, r.offset, r.value)
        for r in spark.read.parquet(str(tmp_path / "data")).collect()
    )
    expected = (
        [(0, i, f"a0-{i}") for i in range(70)]
        + [(1, i, f"b1-{i}") for i in range(40)]
        + [(2, i, f"a2-{i}") for i in range(150)]
        + [(2, 150 + i, f"b2-{i}") for i in range(5)]
        + [(3, i, f"b3-{i}") for i in range(8)]
    )
    assert got == sorted(expected)  # every event once: none lost, none twice


def _batch(values: list[str]) -> Any:
    import pyarrow as pa

    return pa.record_batch({"value": pa.array(values)})


def test_isolation_hides_open_and_aborted_transactions_by_default(
    spark: Any, server: Server
) -> None:
    with headwater.connect(server.address) as hw, hw.http_api() as api:
        stream = _new_stream(api, 2)
    config = {"bootstrap.servers": server.address_of("kafka"), "linger.ms": 5}
    tx = Producer({**config, "transactional.id": "tx_" + uuid.uuid4().hex[:8]})
    tx.init_transactions(DEADLINE_S)
    tx.begin_transaction()
    tx.produce(stream, b"committed", key=b"k", partition=1)
    tx.commit_transaction(DEADLINE_S)
    tx.begin_transaction()
    tx.produce(stream, b"aborted", partition=1)
    tx.flush(DEADLINE_S)
    tx.abort_transaction(DEADLINE_S)
    tx.begin_transaction()
    tx.produce(stream, b"open", partition=0)
    tx.flush(DEADLINE_S)

    def values(**options: str) -> list[tuple[int, int, bytes]]:
        df = _read(spark, server, stream, **options)
        return sorted((r.partition, r.offset, bytes(r.value)) for r in df.collect())

    assert values() == [(1, 0, b"committed")]
    assert values(isolation="read_uncommitted") == [
        (0, 0, b"open"),
        (1, 0, b"committed"),
        (1, 2, b"aborted"),  # offset 1 is the commit marker
    ]
    tx.commit_transaction(DEADLINE_S)
    assert values() == [(0, 0, b"open"), (1, 0, b"committed")]


def test_bad_partition_options_are_clear(spark: Any, server: Server) -> None:
    with headwater.connect(server.address) as hw, hw.http_api() as api:
        stream = _new_stream(api, 2)
    with pytest.raises(Exception, match="option isolation must be read_committed or"):
        _read(spark, server, stream, isolation="dirty").collect()
    with pytest.raises(Exception, match=f"names partition 5 of stream {stream}, which has 2"):
        _read(spark, server, stream, startingOffsets=json.dumps({stream: {"5": 0}})).collect()
    with pytest.raises(Exception, match=r"partitions of \w+ are numbers"):
        _read(spark, server, stream, startingOffsets=json.dumps({stream: {"one": 0}})).collect()
    with pytest.raises(
        Exception, match=rf"endingOffsets offset 9 of stream {stream} partition 1 is past"
    ):
        _read(spark, server, stream, endingOffsets=json.dumps({stream: {"1": 9}})).collect()
