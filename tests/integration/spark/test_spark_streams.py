"""The headwater Spark format against a real server: reads, writes, offsets, restarts,
retried tasks and retention."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from servers import RETENTION_CONFIG

import headwater
from waiting import wait_until

pytestmark = pytest.mark.spark

FMT = "headwater"

# The failure-injecting UDFs are plain Python UDFs (useArrow=False): rows go through them
# in small pickled batches, so the writer has appended earlier rows when one waits for
# that at a late row. With pandas installed, pyspark (spark.sql.execution.pythonUDF.arrow.
# enabled) makes a udf() Arrow-optimised instead: it answers a whole Arrow batch (up to
# 10,000 rows, or one page of the reader) at once, the writer is given none of those rows
# before the UDF returns, and the failure would land before any append: nothing about a
# retry after a partial write would be tested.


def _read(spark: Any, server: str, stream: str, **options: str) -> Any:
    reader = spark.read.format(FMT).option("server", server).option("stream", stream)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _values(client: headwater.Client, stream: str) -> list[bytes]:
    return [e.value for e in client.scan(stream)]


def test_batch_read_schema_values_and_offsets(spark: Any, shared_server: Any, sdk_stream_name: str):
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, [json.dumps({"n": i, "s": f"x{i}"}).encode() for i in range(50)])
        hw.append(sdk_stream_name, [b'{"n": 50, "s": "x50"}'])
        end = hw.stream_info(sdk_stream_name).next_offset
    df = _read(spark, shared_server.address, sdk_stream_name)
    assert [f.name for f in df.schema.fields] == [
        "key",
        "value",
        "stream",
        "partition",
        "offset",
        "timestamp",
        "timestampType",
        "position",
    ]
    rows = df.orderBy("offset").collect()
    assert [r.offset for r in rows] == list(range(end))
    assert json.loads(rows[7].value) == {"n": 7, "s": "x7"}
    assert {r.stream for r in rows} == {sdk_stream_name} and {r.partition for r in rows} == {0}
    # CreateTime (0), the stream's default: the SDK gave no timestamp, the server's clock
    assert all(r.timestamp is not None and r.timestampType == 0 for r in rows)
    positions = [r.position for r in rows]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)

    # Kafka's offset forms: JSON start, exclusive end; -2 earliest.
    part = _read(
        spark,
        shared_server.address,
        sdk_stream_name,
        startingOffsets=json.dumps({sdk_stream_name: {"0": 10}}),
        endingOffsets=json.dumps({sdk_stream_name: {"0": 20}}),
    )
    assert sorted(r.offset for r in part.collect()) == list(range(10, 20))
    parsed = _read(
        spark,
        shared_server.address,
        sdk_stream_name,
        startingOffsets=json.dumps({sdk_stream_name: {"0": -2}}),
        valueFormat="json",
        schema="n INT, s STRING",
        maxOffsetsPerPartition="7",
    )
    assert parsed.rdd.getNumPartitions() == 8  # 51 offsets split 7 at a time
    got = sorted((r.n, r.s, r.offset) for r in parsed.collect())
    assert got == [(i, f"x{i}", i) for i in range(51)]


def test_csv_values_and_headers_column(spark: Any, shared_server: Any, sdk_stream_name: str):
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, [b"AAA,10.5,3", b"BBB,11.0,", b"CCC,9.25,7"])
    df = _read(
        spark,
        shared_server.address,
        sdk_stream_name,
        valueFormat="csv",
        schema="sym STRING, px DOUBLE, qty INT",
        includeHeaders="true",
    )
    assert "headers" in df.columns
    rows = sorted((r.sym, r.px, r.qty) for r in df.collect())
    assert rows == [("AAA", 10.5, 3), ("BBB", 11.0, None), ("CCC", 9.25, 7)]


def test_several_streams_and_explicit_register(
    spark: Any, shared_server: Any, sdk_stream_name: str
):
    from headwater.spark import register

    register(spark)  # the format is found without it too; registering again is harmless
    a, b = sdk_stream_name + "_a", sdk_stream_name + "_b"
    with headwater.connect(shared_server.address) as hw:
        for name, count in ((a, 5), (b, 3)):
            hw.create_stream(name)
            hw.append(name, [f"{name}:{i}".encode() for i in range(count)])
    df = (
        spark.read.format(FMT)
        .option("server", shared_server.address)
        .option("streams", f"{b},{a}")
        .option("startingOffsets", json.dumps({a: {"0": 2}}))
        .load()
    )
    got = sorted((r.stream, r.offset, bytes(r.value).decode()) for r in df.collect())
    assert got == [(a, i, f"{a}:{i}") for i in range(2, 5)] + [(b, i, f"{b}:{i}") for i in range(3)]


def test_bad_options_and_unknown_stream_are_clear(spark: Any, shared_server: Any):
    with pytest.raises(Exception, match="does not exist"):
        _read(spark, shared_server.address, "no_such_stream_here").collect()
    with pytest.raises(Exception, match="startingOffsets must be earliest, latest or JSON"):
        _read(spark, shared_server.address, "s", startingOffsets="soon").collect()
    with pytest.raises(Exception, match="needs a schema option"):
        _read(spark, shared_server.address, "s", valueFormat="json").collect()


def test_batch_write_then_read_back(spark: Any, shared_server: Any, sdk_stream_name: str):
    df = spark.range(0, 2500, numPartitions=3).selectExpr("CAST(id AS STRING) AS value")
    df.write.format(FMT).option("server", shared_server.address).option(
        "stream", sdk_stream_name
    ).mode("append").save()
    with headwater.connect(shared_server.address) as hw:
        values = _values(hw, sdk_stream_name)
    assert sorted(int(v) for v in values) == list(range(2500))
    for columns, message in (
        (["CAST(id AS STRING) AS key"], "needs a column named value"),
        (["id AS value"], "column value must be STRING or BINARY"),
        (["'v' AS value", "id AS key"], "column key must be STRING or BINARY"),
        (["'v' AS value", "'p' AS partition"], "column partition must be an integer"),
        (["'v' AS value", "array('h') AS headers"], "column headers must be ARRAY<STRUCT"),
        (["'v' AS value", "7 AS partition"], "partition 7 does not exist"),
        (["CAST(NULL AS STRING) AS value"], "column value has nulls"),
    ):
        with pytest.raises(Exception, match=message):
            spark.range(3).selectExpr(*columns).write.format(FMT).option(
                "server", shared_server.address
            ).option("stream", sdk_stream_name).mode("append").save()
    with headwater.connect(shared_server.address) as hw:
        assert len(_values(hw, sdk_stream_name)) == 2500  # none of those stored anything


def _failing_once(marker: Path, server: str, stream: str, fail_at: int) -> Callable[..., Any]:
    """A UDF that, in the first attempt of its task, waits until the writer has appended
    something and then fails, so the retry must not append those rows again."""
    from pyspark.sql.functions import udf

    def value(n: int) -> str:
        from pyspark import TaskContext

        context = TaskContext.get()
        if n == fail_at and context is not None and context.attemptNumber() == 0:
            with headwater.connect(server) as hw:
                stored = wait_until(
                    lambda: hw.stream_info(stream).next_offset, 10, "the writer appended nothing"
                )
            marker.write_text(str(stored))
            raise RuntimeError("injected failure")
        return str(n)

    return udf(value, "string", useArrow=False)


def test_retried_write_task_leaves_no_duplicate(
    spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path: Path
):
    total = 40_000  # several Arrow batches of 10,000 rows in one task
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
    marker = tmp_path / "appended_before_failure"
    fail = _failing_once(marker, shared_server.address, sdk_stream_name, total - 100)
    df = spark.range(0, total, numPartitions=1).select(fail("id").alias("value"))
    df.write.format(FMT).option("server", shared_server.address).option(
        "stream", sdk_stream_name
    ).mode("append").save()
    assert int(marker.read_text()) > 0  # the first attempt had appended before it failed
    with headwater.connect(shared_server.address) as hw:
        values = [int(v) for v in _values(hw, sdk_stream_name)]
    assert len(values) == total and sorted(values) == list(range(total))


def _pipe(
    spark: Any,
    server: str,
    source: str,
    sink: str,
    checkpoint: Path,
    *,
    now: bool = True,
    through: Callable[[Any], Any] | None = None,
    connection: dict[str, str] | None = None,
    **options: str,
) -> Any:
    """source -> sink copy of values; ``now``: Trigger.AvailableNow, else micro-batches
    back to back until stopped. ``through``: a UDF the values pass through as integers;
    ``connection``: options (token, tenant) of both ends."""
    from pyspark.sql.functions import col

    ends = {"server": server, **(connection or {})}
    reader = spark.readStream.format(FMT).options(**ends).option("stream", source)
    for key, value in options.items():
        reader = reader.option(key, value)
    frame = reader.load()
    if through is None:
        frame = frame.select("value")
    else:
        frame = frame.select(through(col("value").cast("string").cast("long")).alias("value"))
    writer = (
        frame.writeStream.format(FMT)
        .options(**ends)
        .option("stream", sink)
        .option("checkpointLocation", str(checkpoint))
    )
    return writer.trigger(availableNow=True).start() if now else writer.start()


def test_streaming_copy_resumes_from_checkpoint_without_loss_or_duplicates(
    spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path: Path
):
    source, sink = sdk_stream_name + "_in", sdk_stream_name + "_out"
    checkpoint = tmp_path / "checkpoint"
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(source)
        hw.append(source, [f"a{i}".encode() for i in range(250)])
        query = _pipe(
            spark,
            shared_server.address,
            source,
            sink,
            checkpoint,
            now=False,
            maxOffsetsPerTrigger="100",
        )
        query.processAllAvailable()
        query.stop()
        assert query.exception() is None
        batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
        assert [p["numInputRows"] for p in batches] == [100, 100, 50]  # admission control
        assert _values(hw, sink) == [f"a{i}".encode() for i in range(250)]

        hw.append(source, [f"b{i}".encode() for i in range(30)])
        query = _pipe(spark, shared_server.address, source, sink, checkpoint)  # restart
        query.awaitTermination(120)
        assert query.exception() is None
        expected = [f"a{i}".encode() for i in range(250)] + [f"b{i}".encode() for i in range(30)]
        assert _values(hw, sink) == expected
        offsets = sorted((checkpoint / "offsets").glob("[0-9]*"), key=lambda p: int(p.name))
        last = json.loads(offsets[-1].read_text().splitlines()[-1])
        assert last == {source: {"0": 280}}


def test_streaming_write_retried_task_leaves_no_duplicate(
    spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path: Path
):
    source, sink = sdk_stream_name + "_in", sdk_stream_name + "_out"
    # The sink sends full appends of 10,000 rows and keeps the rest gathered, and Spark
    # computes a batch ahead of the writer: rows enough that some went before the failure.
    total = 45_000
    marker = tmp_path / "appended_before_failure"
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(source)
        hw.create_stream(sink)
        hw.append(source, [str(i).encode() for i in range(total)])
        fail = _failing_once(marker, shared_server.address, sink, total - 10)
        query = _pipe(spark, shared_server.address, source, sink, tmp_path / "cp", through=fail)
        query.awaitTermination(120)
        assert query.exception() is None
        assert int(marker.read_text()) > 0
        values = [int(v) for v in _values(hw, sink)]
    assert len(values) == total and sorted(values) == list(range(total))


def _to_parquet(spark: Any, server: str, source: str, out: Path, **options: str) -> Any:
    reader = spark.readStream.format(FMT).option("server", server).option("stream", source)
    return (
        reader.options(**options)
        .load()
        .select("offset", "value")
        .writeStream.format("parquet")
        .option("path", str(out / "data"))
        .option("checkpointLocation", str(out / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_retention_under_a_query(
    spark: Any, make_server: Any, tmp_path: Path, fail_on_data_loss: bool
):
    # Small segments and a byte limit: retention drops whole old segments within 100 ms.
    server = make_server(config=RETENTION_CONFIG)
    option = {"failOnDataLoss": str(fail_on_data_loss).lower()}
    with headwater.connect(server.address) as hw:
        hw.create_stream("src")
        hw.append("src", [b"early%03d" % i for i in range(10)])
        query = _to_parquet(spark, server.address, "src", tmp_path, **option)
        query.awaitTermination(120)
        assert query.exception() is None
        for i in range(40):  # many small appends: segments roll, retention drops old ones
            hw.append("src", [b"late%03d-%03d" % (i, k) + b"." * 100 for k in range(10)])
        # Until retention is done: the oldest read offset is gone and the log is back
        # under its byte limit (so nothing more goes while Spark reads).
        wait_until(
            lambda: (
                int(str(hw.query('SELECT min("offset") FROM src').scalar())) > 10
                and hw.stream_info("src").size_bytes <= 8192
            ),
            30,
            "retention did not remove the first segments",
        )
        start = int(str(hw.query('SELECT min("offset") FROM src').scalar()))
        retained = [(e.offset, e.value) for e in hw.scan("src", start)]
    query = _to_parquet(spark, server.address, "src", tmp_path, **option)  # restart
    if fail_on_data_loss:
        with pytest.raises(Exception, match=r"offsets 10\.\.\d+ were removed by retention"):
            query.awaitTermination(120)
    else:
        query.awaitTermination(120)
        assert query.exception() is None
    rows = sorted(
        (r.offset, bytes(r.value)) for r in spark.read.parquet(str(tmp_path / "data")).collect()
    )
    early = [(i, b"early%03d" % i) for i in range(10)]
    assert rows == (early if fail_on_data_loss else early + retained)


def _held_back(gate: Path) -> Callable[..., Any]:
    """A UDF passing values through that, until ``gate/go`` exists, holds every task it
    runs in (after leaving ``gate/blocked-<partition>``): the tasks that started have
    read their ranges, the others wait for a free core."""
    from pyspark.sql.functions import udf

    def value(v: bytes) -> bytes:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and not (gate / "go").exists():
            (gate / f"blocked-{context.partitionId()}").touch()
            wait_until((gate / "go").exists, 120, "the gate never opened")
        return v

    return udf(value, "binary")


def _stage_with_one_task_waiting(spark: Any) -> bool:
    """Whether an active stage of 3 tasks has 2 running and none done: the third waits."""
    tracker = spark.sparkContext.statusTracker()
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        if info is not None and info.numTasks == 3:
            return bool(info.numActiveTasks == 2 and info.numCompletedTasks == 0)
    return False


READ_RETENTION_CONFIG = """
[storage]
sync = "none"
segment_bytes = 4096
retention_bytes = 49152
maintenance_interval_ms = 100
"""
SPLIT = 100  # offsets per Spark partition: batch 0 is 3 tasks on 2 cores


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_retention_while_a_query_reads(
    spark: Any, make_server: Any, tmp_path: Path, fail_on_data_loss: bool
):
    """Retention removes offsets that a running micro-batch planned but a task has not
    read yet, up to the middle of that task's range: the executor's read meets
    InvalidOffset. failOnDataLoss=true fails the query naming the lost offsets; false
    reads on from the first stored offset, and the next batches go on from there."""
    server = make_server(config=READ_RETENTION_CONFIG)
    gate = tmp_path / "gate"
    gate.mkdir()

    def event(i: int) -> bytes:
        return b"%05d" % i + b"." * 100

    with headwater.connect(server.address) as hw:
        hw.create_stream("src")
        for i in range(0, 3 * SPLIT, 10):  # 300 events, ~40 KiB: under the retention limit
            hw.append("src", [event(i + k) for k in range(10)])
        query = (
            spark.readStream.format(FMT)
            .option("server", server.address)
            .option("stream", "src")
            .option("maxOffsetsPerPartition", str(SPLIT))
            .option("failOnDataLoss", str(fail_on_data_loss).lower())
            .load()
            .select("offset", _held_back(gate)("value").alias("value"))
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "data"))
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .start()
        )
        try:

            def two_blocked() -> bool:
                assert query.exception() is None, query.exception()
                return len(list(gate.glob("blocked-*"))) >= 2

            wait_until(two_blocked, 120, "two tasks of batch 0 did not start")
            # No third task starts: both cores are held. Spark shows it pending.
            wait_until(
                lambda: _stage_with_one_task_waiting(spark), 30, "no stage with a task waiting"
            )
            blocked = sorted(int(p.name.split("-")[1]) for p in gate.glob("blocked-*"))
            assert len(blocked) == 2
            (waiting,) = set(range(3)) - set(blocked)

            def first_stored() -> int:
                return int(str(hw.query('SELECT min("offset") FROM src').scalar()))

            # Append until retention has cut past two thirds of batch 0, a segment
            # (~35 events) at a time: after each append, until retention has settled
            # under the byte limit again.
            i = 3 * SPLIT
            while first_stored() <= 2 * SPLIT:
                hw.append("src", [event(i + k) for k in range(10)])
                i += 10
                wait_until(
                    lambda: hw.stream_info("src").size_bytes <= 49152,
                    60,
                    "retention did not settle",
                )
                assert i < 3 * SPLIT + 1000, "retention did not remove the first segments"
            first = first_stored()
            end = hw.stream_info("src").next_offset
            assert 2 * SPLIT < first < 3 * SPLIT, first  # inside the last task's range
            (gate / "go").touch()  # the waiting task starts now
            if fail_on_data_loss:
                lost = rf"offsets {waiting * SPLIT}\.\.{first - 1} were removed by retention"
                with pytest.raises(Exception, match=lost + " before they were read"):
                    query.awaitTermination(120)
                return
            query.processAllAvailable()
            assert query.exception() is None
        finally:
            (gate / "go").touch()
            query.stop()
    rows = sorted(
        (r.offset, bytes(r.value)) for r in spark.read.parquet(str(tmp_path / "data")).collect()
    )
    expected = [o for p in blocked for o in range(p * SPLIT, (p + 1) * SPLIT)]
    expected += range(max(first, waiting * SPLIT), (waiting + 1) * SPLIT)  # read on from first
    expected += range(3 * SPLIT, end)  # the batches after batch 0
    assert rows == [(o, event(o)) for o in sorted(expected)]


def _started(query: Any, timeout: float = 120) -> None:
    """Until the query's first micro-batch is done: its starting offsets are fixed."""

    def first_batch_done() -> bool:
        assert query.exception() is None, query.exception()
        return any(p["batchId"] == 0 for p in query.recentProgress)

    wait_until(first_batch_done, timeout, "the query's first batch did not run")


def test_streaming_read_from_latest_sees_only_later_events(
    spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path: Path
):
    """startingOffsets latest and {"s": {"0": -1}}: a query reads what is appended after it
    started, and "latest" is resolved once (Spark asks for the initial offsets again
    until the first batch is logged)."""
    from headwater.spark.options import ReadOptions
    from headwater.spark.source import HeadwaterStreamReader

    source = sdk_stream_name
    forms = {"latest": "latest", "minus1": json.dumps({source: {"0": -1}})}
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(source)
        hw.append(source, [b"before%d" % i for i in range(20)])
        options = {"server": shared_server.address, "stream": source, "startingOffsets": "latest"}
        reader = HeadwaterStreamReader(ReadOptions.parse(options), schema=None)
        assert reader.initialOffset() == {source: {"0": 20}}
        hw.append(source, [b"between"])
        assert reader.initialOffset() == {source: {"0": 20}}  # not 21: resolved once
        reader.stop()
        queries = {
            name: _pipe(
                spark,
                shared_server.address,
                source,
                f"{source}_{name}",
                tmp_path / name,
                now=False,
                startingOffsets=start,
            )
            for name, start in forms.items()
        }
        try:
            for query in queries.values():
                _started(query)
            hw.append(source, [b"after%d" % i for i in range(15)])
            for query in queries.values():
                query.processAllAvailable()
        finally:
            for query in queries.values():
                query.stop()
        for name, query in queries.items():
            assert query.exception() is None
            assert _values(hw, f"{source}_{name}") == [b"after%d" % i for i in range(15)], name


def test_batch_read_offset_forms_latest_and_minus_one(
    spark: Any, shared_server: Any, sdk_stream_name: str
):
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, [b"e%d" % i for i in range(12)])
    minus1 = json.dumps({sdk_stream_name: {"0": -1}})
    for end in ("latest", minus1):  # exclusive end: the stream's end at planning
        df = _read(spark, shared_server.address, sdk_stream_name, endingOffsets=end)
        assert sorted(r.offset for r in df.collect()) == list(range(12)), end
    start3 = json.dumps({sdk_stream_name: {"0": 3}})
    df = _read(
        spark, shared_server.address, sdk_stream_name, startingOffsets=start3, endingOffsets=minus1
    )
    assert sorted(r.offset for r in df.collect()) == list(range(3, 12))
    for start in ("latest", minus1):  # from the end: nothing
        assert (
            _read(spark, shared_server.address, sdk_stream_name, startingOffsets=start).count() == 0
        )
    with pytest.raises(Exception, match=r"endingOffsets cannot be earliest \(-2\)"):
        _read(
            spark,
            shared_server.address,
            sdk_stream_name,
            endingOffsets=json.dumps({sdk_stream_name: {"0": -2}}),
        ).collect()
    # A range backwards: refused, as Spark's Kafka source does (it read nothing, silently).
    with pytest.raises(Exception, match=r"startingOffsets 8 is past endingOffsets 5"):
        _read(
            spark,
            shared_server.address,
            sdk_stream_name,
            startingOffsets=json.dumps({sdk_stream_name: {"0": 8}}),
            endingOffsets=json.dumps({sdk_stream_name: {"0": 5}}),
        ).collect()


AUTH_CONFIG = """
[auth]
required = true
[[auth.tokens]]
token = "s3cret"
tenants = [0, 42]
[[tenants]]
id = 42
name = "acme"
"""


def test_token_option_against_a_server_with_auth(spark: Any, make_server: Any, tmp_path: Path):
    server = make_server(config=AUTH_CONFIG)
    auth = {"server": server.address, "token": "s3cret", "tenant": "42"}
    spark.range(0, 50, numPartitions=2).selectExpr("CAST(id AS STRING) AS value").write.format(
        FMT
    ).options(**auth).option("stream", "acme_in").mode("append").save()
    with headwater.connect(server.address, token="s3cret", tenant=42) as hw:
        assert sorted(int(v) for v in _values(hw, "acme_in")) == list(range(50))
    batch = spark.read.format(FMT).options(**auth).option("stream", "acme_in").load()
    assert batch.count() == 50
    query = _pipe(
        spark,
        server.address,
        "acme_in",
        "acme_out",
        tmp_path / "cp",
        connection={"token": "s3cret", "tenant": "42"},
    )
    query.awaitTermination(120)
    assert query.exception() is None
    with headwater.connect(server.address, token="s3cret", tenant=42) as hw:
        assert sorted(int(v) for v in _values(hw, "acme_out")) == list(range(50))
    no_token = {k: v for k, v in auth.items() if k != "token"}
    for options, error in (
        (no_token, "AuthenticationFailed"),
        ({**auth, "token": "wrong"}, "AuthenticationFailed"),
        ({**auth, "tenant": "7"}, "AuthenticationFailed"),  # not granted by the token
    ):
        with pytest.raises(Exception, match=error):
            spark.read.format(FMT).options(**options).option("stream", "acme_in").load().collect()


def _failing_while(marker: Path, server: str, sink: str, fail_at: int) -> Callable[..., Any]:
    """A UDF that, while ``marker`` exists, fails every attempt of the task holding row
    ``fail_at`` once the sink has events from this batch: the query dies mid-batch."""
    from pyspark.sql.functions import udf

    def value(n: int) -> str:
        if n == fail_at and marker.exists():
            first = int(marker.read_text())
            with headwater.connect(server) as hw:
                wait_until(
                    lambda: hw.stream_info(sink).next_offset > first, 10, "nothing was appended"
                )
            raise RuntimeError("injected failure in the sink's task")
        return str(n)

    return udf(value, "string", useArrow=False)


def test_query_failing_mid_batch_restarts_without_loss_or_duplicates(
    spark: Any, shared_server: Any, sdk_stream_name: str, tmp_path: Path
):
    """A sink task fails in every attempt after part of its batch was appended: the query
    stops with the error. Restarted from its checkpoint, the batch runs again with the
    same producer ids and sequences: the sink holds each event once, in order."""

    source, sink = sdk_stream_name + "_in", sdk_stream_name + "_out"
    total, per_batch = 30_000, 12_000  # batch 1 is 2 Arrow batches: 2 appends
    marker = tmp_path / "fail"
    with headwater.connect(shared_server.address) as hw:
        hw.create_stream(source)
        hw.create_stream(sink)
        for first in range(0, total, 10_000):
            hw.append(source, [str(i).encode() for i in range(first, first + 10_000)])
        fail = _failing_while(marker, shared_server.address, sink, 2 * per_batch - 10)
        marker.write_text(str(per_batch))  # fail in batch 1, once batch 1 appended some

        def start() -> Any:
            return _pipe(
                spark,
                shared_server.address,
                source,
                sink,
                tmp_path / "cp",
                through=fail,
                maxOffsetsPerTrigger=str(per_batch),
            )

        query = start()
        with pytest.raises(Exception, match="injected failure in the sink's task"):
            query.awaitTermination(120)
        stored = hw.stream_info(sink).next_offset
        assert per_batch < stored < 2 * per_batch  # batch 0, and part of batch 1
        marker.unlink()
        query = start()  # the same checkpoint: batch 1 again, then batch 2
        query.awaitTermination(120)
        assert query.exception() is None
        assert [int(v) for v in _values(hw, sink)] == list(range(total))


def test_range_reader_row_schema_is_what_spark_declares(spark: Any) -> None:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import _parse_datatype_string

    from headwater.spark.options import ReadOptions
    from headwater.spark.streams import ROW_SCHEMA

    ddl = ReadOptions.parse({"stream": "s"}).schema_ddl()
    assert to_arrow_schema(_parse_datatype_string(ddl), timezone="UTC") == ROW_SCHEMA
