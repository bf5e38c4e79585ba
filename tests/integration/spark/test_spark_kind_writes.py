"""Writing entity kinds from Spark (rows -> Ripple deltas): Set, Patch and Remove in batch
and streaming, a retried task and a restarted query applying nothing twice, the errors a
user meets before any task runs, and a pipeline from one kind's changelog to another kind."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import LOCAL, Server, serving

import headwater
from headwater.pipeline.runner import run_pipeline
from headwater.pipeline.spec import PipelineError, load_pipeline, server_kind_columns
from headwater.spark.kind_writer import RIPPLE_PORT
from waiting import wait_until

pytestmark = pytest.mark.spark

FMT = "headwater"


@pytest.fixture(scope="module")
def ripple_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("spark_kind_writes")
    yield from serving(root, listen={"ripple": LOCAL, "http": LOCAL})


def _writer(df: Any, server: Server, kind: str, **options: str) -> Any:
    writer = (
        df.write.format(FMT)
        .option("server", server.address)
        .option("rippleServer", f"127.0.0.1:{server.ports['ripple']}")
        .option("kind", kind)
    )
    for key, value in options.items():
        writer = writer.option(key, value)
    return writer.mode("append")


def _state(spark: Any, server: Server, kind: str) -> dict[str, tuple[Any, ...]]:
    """The kind's entities by key (Ripple keys are UTF-8, zero-padded to 32 bytes), read
    back with the format's own kind reader."""
    df = spark.read.format(FMT).option("server", server.address).option("kind", kind).load()
    # The readable key (entity_key, the last column) is the id this test decodes itself.
    df = df.drop("entity_key")
    return {bytes.fromhex(r[0]).rstrip(b"\0").decode(): tuple(r[3:]) for r in df.collect()}


def _ripple_deltas(server: Server) -> dict[str, float]:
    url = f"http://127.0.0.1:{server.ports['http']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.findall(r'headwater_ripple_deltas_total\{outcome="(\w+)"\} (\S+)', text)
    return {outcome: float(value) for outcome, value in found}


def test_batch_set_patch_remove(spark: Any, ripple_server: Server) -> None:
    # Each partition is one Ripple source and a Remove clears only its own source's bit:
    # every write partitions by key, so one key always comes from one partition.
    rows = [(f"s{i}", float(i) + 0.5, i * 10, i % 2 == 0) for i in range(50)]
    df = spark.createDataFrame(rows, "key string, price double, size long, ok boolean")
    _writer(df.repartition(2, "key"), ripple_server, "kw_batch").save()
    state = _state(spark, ripple_server, "kw_batch")
    assert state == {k: (p, s, ok) for k, p, s, ok in rows}

    patch = spark.createDataFrame([("s1", 99.25), ("s2", -1.0)], "key string, price double")
    _writer(patch.repartition(2, "key"), ripple_server, "kw_batch", patchColumns="price").save()
    removed = spark.createDataFrame(
        [("s3", True), ("s4", False)], "key string, deleted boolean"
    ).selectExpr("key", "cast(null as double) as price", "deleted")
    _writer(removed.repartition(2, "key"), ripple_server, "kw_batch", patchColumns="price").save()

    state = _state(spark, ripple_server, "kw_batch")
    assert state["s1"] == (99.25, 10, False) and state["s2"] == (-1.0, 20, True)
    assert "s3" not in state and state["s4"] == (4.5, 40, True)  # false: nothing removed
    assert len(state) == 49


def test_ripple_listener_found_through_the_handshake(spark: Any, ripple_server: Server) -> None:
    """Without rippleServer the driver asks the Kimberlite listener (capability
    ``ripple:<port>``); a given rippleServer wins, and a task that cannot reach it says
    where it looked."""
    assert ripple_server.ports["ripple"] != RIPPLE_PORT
    df = spark.createDataFrame([("a", 1.5), ("b", 2.5)], "key string, price double")
    found = df.coalesce(1).write.format(FMT).option("server", ripple_server.address)
    found.option("kind", "kw_found").mode("append").save()
    assert _state(spark, ripple_server, "kw_found") == {"a": (1.5,), "b": (2.5,)}
    wrong = f"127.0.0.1:{ripple_server.ports['http']}"  # not a Ripple listener
    with pytest.raises(Exception, match="cannot reach the Ripple listener at " + re.escape(wrong)):
        _writer(df.coalesce(1), ripple_server, "kw_found", rippleServer=wrong).save()


def test_schema_errors_come_before_any_task(spark: Any, ripple_server: Server) -> None:
    no_key = spark.createDataFrame([(1.0,)], "price double")
    with pytest.raises(Exception, match="needs a key column 'key'"):
        _writer(no_key, ripple_server, "kw_errors").save()
    binary = spark.createDataFrame([("a", bytearray(b"x"))], "key string, raw binary")
    with pytest.raises(Exception, match="raw of type binary cannot be a kind field"):
        _writer(binary, ripple_server, "kw_errors").save()
    df = spark.createDataFrame([("a", 1.0)], "key string, price double")
    with pytest.raises(Exception, match="patchColumns"):
        _writer(df, ripple_server, "kw_errors", patchColumns="volume").save()
    with headwater.connect(ripple_server.address) as hw:
        assert "kw_errors" not in {str(t[0]) for t in hw.query("SHOW TABLES").rows}
    # A null in a Set is found by the task that meets it (the job fails, nothing is set).
    nulls = spark.createDataFrame([("a", None)], "key string, price double").coalesce(1)
    with pytest.raises(Exception, match=r"\['price'\] are null"):
        _writer(nulls, ripple_server, "kw_errors").save()
    assert _state(spark, ripple_server, "kw_errors") == {}


def _failing_once(
    marker: Path, fail_at: int, metrics_url: str, applied: float
) -> Callable[..., Any]:
    """A UDF failing the first attempt of its task at row ``fail_at``, once the server
    has applied more than ``applied`` deltas (rows before it sent in an earlier Arrow
    batch), so the retry re-sends those."""
    from pyspark.sql.functions import udf

    def price(n: int) -> float:
        import re
        import urllib.request

        from pyspark import TaskContext

        def applied_now() -> bool:
            text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
            found = re.search(r'headwater_ripple_deltas_total\{outcome="applied"\} (\S+)', text)
            return found is not None and float(found.group(1)) > applied

        context = TaskContext.get()
        if n == fail_at and context is not None and context.attemptNumber() == 0:
            wait_until(applied_now, 60, "no delta of this task reached the server")
            marker.write_text("failed once")
            raise RuntimeError("injected failure")
        return n * 0.5

    return udf(price, "double")


def test_retried_task_applies_nothing_twice(
    spark: Any, ripple_server: Server, tmp_path: Path
) -> None:
    total = 25_000  # several Arrow batches of 10,000 rows: the first ones are sent before
    before = _ripple_deltas(ripple_server)
    marker = tmp_path / "marker"
    metrics = f"http://{ripple_server.address_of('http')}/metrics"
    # ... the failure, in the last one
    price = _failing_once(marker, total - 100, metrics, before.get("applied", 0))
    df = spark.range(0, total, numPartitions=1).selectExpr("id", "concat('k', id) as key")
    df = df.select("key", price("id").alias("price"))
    _writer(df, ripple_server, "kw_retry").save()
    assert marker.exists()
    after = _ripple_deltas(ripple_server)
    state = _state(spark, ripple_server, "kw_retry")
    assert state == {f"k{i}": (i * 0.5,) for i in range(total)}
    # every row applied once; the retry's re-sent rows were recognised and dropped
    assert after["applied"] - before.get("applied", 0) == total
    assert after["duplicate"] - before.get("duplicate", 0) > 0


def test_streaming_kind_write_resumes_from_checkpoint(
    spark: Any, ripple_server: Server, sdk_stream_name: str, tmp_path: Path
) -> None:
    with headwater.connect(ripple_server.address) as hw:
        hw.create_stream(sdk_stream_name)
        hw.append(sdk_stream_name, [json.dumps({"s": f"x{i % 5}", "p": i}) for i in range(20)])
    checkpoint = tmp_path / "checkpoint"

    def run() -> None:
        query = (
            spark.readStream.format(FMT)
            .option("server", ripple_server.address)
            .option("stream", sdk_stream_name)
            .option("valueFormat", "json")
            .option("schema", "s string, p long")
            .load()
            .selectExpr("s as key", "p as last")
            .writeStream.format(FMT)
            .option("server", ripple_server.address)  # no rippleServer: the handshake's
            .option("kind", "kw_stream")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)

    assert ripple_server.ports["ripple"] != RIPPLE_PORT  # found, not the default port
    before = _ripple_deltas(ripple_server)
    run()
    assert _state(spark, ripple_server, "kw_stream") == {f"x{k}": (15 + k,) for k in range(5)}
    with headwater.connect(ripple_server.address) as hw:
        hw.append(sdk_stream_name, [json.dumps({"s": "x1", "p": 100})])
    run()  # the same query (checkpoint): only the new event
    assert _state(spark, ripple_server, "kw_stream")["x1"] == (100,)
    after = _ripple_deltas(ripple_server)
    assert after["applied"] - before.get("applied", 0) == 21


def test_pipeline_from_a_kind_changelog_to_a_kind(
    spark: Any, ripple_server: Server, tmp_path: Path
) -> None:
    """A pipeline reads kind kw_src's changes (columns asked of the server before Spark
    runs) and keeps kind kw_double in step: upserts doubled, deletions removed."""
    src = spark.createDataFrame([(f"e{i}", float(i)) for i in range(6)], "key string, p double")
    _writer(src.repartition(1), ripple_server, "kw_src").save()
    spec_path = tmp_path / "p.yaml"
    spec_path.write_text(
        json.dumps(
            {
                "server": ripple_server.address,
                "sources": [{"name": "changes", "type": "kind", "kind": "kw_src"}],
                "transforms": [
                    {
                        "sql": "SELECT entity_id AS key, p * 2 AS p2, deleted FROM changes "
                        "DISTRIBUTE BY key"
                    }
                ],
                # No rippleServer: the sink finds the listener through the handshake.
                "sinks": [{"type": "kind", "kind": "kw_double"}],
                "checkpoint": str(tmp_path / "cp"),
                "trigger": "availableNow",
            }
        )
    )
    spec = load_pipeline(spec_path, server_kind_columns)
    assert spec.views["changes"] == {
        "entity_id": "STRING",
        "version": "BIGINT",
        "deleted": "BOOLEAN",
        "p": "DOUBLE",
        "entity_key": "STRING",  # the readable key, last (docs/spark.md)
    }

    def doubled() -> dict[str, float]:
        df = spark.read.format(FMT).option("server", ripple_server.address)
        return {r.entity_id: r.p2 for r in df.option("kind", "kw_double").load().collect()}

    def target(key: str) -> str:
        # kw_src's entity id (64 hex characters) is kw_double's key: longer than a
        # Ripple key, so it is hashed (docs/spark.md).
        return hashlib.sha256(_ripple_key(key).hex().encode()).hexdigest()

    assert run_pipeline(spec, "unused", lambda _: None, spark=spark) == 0
    assert doubled() == {target(f"e{i}"): 2.0 * i for i in range(6)}
    removed = spark.createDataFrame(
        [("e2", None, True), ("e3", 30.0, False)], "key string, p double, deleted boolean"
    )
    _writer(removed.repartition(1), ripple_server, "kw_src", patchColumns="p").save()
    assert (
        run_pipeline(
            load_pipeline(spec_path, server_kind_columns), "unused", lambda _: None, spark=spark
        )
        == 0
    )
    want = {target(f"e{i}"): 2.0 * i for i in range(6) if i != 2}
    assert doubled() == {**want, target("e3"): 60.0}
    with pytest.raises(PipelineError, match="kind kw_nothing does not exist"):
        server_kind_columns(spec.connection, "kw_nothing")


def _ripple_key(key: str) -> bytes:
    return key.encode().ljust(32, b"\0")


def _ripple_workers(server: Server, kind: str) -> list[str]:
    url = f"http://127.0.0.1:{server.ports['http']}/api/ripple/workers"
    workers = json.loads(urllib.request.urlopen(url, timeout=10).read())["workers"]
    return sorted(w["worker_id"] for w in workers if any(o["output"] == kind for o in w["outputs"]))


def test_kind_sink_after_an_aggregation_with_200_shuffle_partitions(
    spark: Any, make_server: Any, tmp_path: Path
) -> None:
    """Spark's default spark.sql.shuffle.partitions (200) puts 150 keys in ~100 partitions,
    each a Ripple worker: more than a tenant's 64 source slots. A pipeline's kind sink
    writes from 8 partitions (hashed by key) and gets every sum in; the format alone,
    given those partitions, fails with an error that says what to change."""
    server = make_server(listen={"ripple": "127.0.0.1:0", "http": "127.0.0.1:0"})
    keys = 150
    with headwater.connect(server.address) as hw:
        hw.create_stream("amounts")
        hw.append("amounts", [json.dumps({"k": f"k{i % keys}", "n": i}) for i in range(600)])
    expected = {f"k{k}": (sum(range(k, 600, keys)), 4) for k in range(keys)}
    spec_path = tmp_path / "p.yaml"
    spec_path.write_text(
        json.dumps(
            {
                "server": server.address,
                "sources": [
                    {
                        "name": "amounts",
                        "type": "stream",
                        "stream": "amounts",
                        "format": "json",
                        "schema": "k STRING, n BIGINT",
                    }
                ],
                "transforms": [
                    {
                        "sql": "SELECT k AS key, sum(n) AS total, count(*) AS n "
                        "FROM amounts GROUP BY k"
                    }
                ],
                "sinks": [{"type": "kind", "kind": "kw_totals"}],
                "checkpoint": str(tmp_path / "cp"),
                "trigger": "availableNow",
                "output_mode": "complete",
            }
        )
    )
    default = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "200")
    try:
        assert run_pipeline(load_pipeline(spec_path), "unused", print, spark=spark) == 0
        assert _state(spark, server, "kw_totals") == expected
        workers = _ripple_workers(server, "kw_totals")
        assert 1 < len(workers) <= 8, workers
        assert all(re.fullmatch(r"spark/kw_totals/[0-9a-f-]+/[0-7]", w) for w in workers)

        query = (
            spark.readStream.format(FMT)
            .option("server", server.address)
            .option("stream", "amounts")
            .option("valueFormat", "json")
            .option("schema", "k STRING, n BIGINT")
            .load()
            .groupBy("k")
            .agg({"n": "sum"})
            .withColumnRenamed("k", "key")
            .withColumnRenamed("sum(n)", "total")
            .writeStream.format(FMT)
            .option("server", server.address)
            .option("kind", "kw_totals_direct")
            .option("checkpointLocation", str(tmp_path / "cp_direct"))
            .outputMode("complete")
            .trigger(availableNow=True)
            .start()
        )
        with pytest.raises(Exception, match=r"got no source slot .*at most 64 at once"):
            query.awaitTermination(300)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", default)


def test_foreach_batch_writes_number_as_the_streaming_writers(
    spark: Any, ripple_server: Server, sdk_stream_name: str
) -> None:
    """Options queryId and batchId (what a pipeline in update mode passes from
    foreachBatch): a batch run again writes nothing twice; the next batch id does."""
    rows = spark.createDataFrame([(f"f{i}", float(i)) for i in range(30)], "key string, p double")
    values = rows.selectExpr("concat(key, ':', p) AS value")

    def write(df: Any, batch_id: int, **target: str) -> None:
        writer = df.repartition(2).write.format(FMT).option("server", ripple_server.address)
        for key, value in {**target, "queryId": "q-1", "batchId": str(batch_id)}.items():
            writer = writer.option(key, value)
        writer.mode("append").save()

    before = _ripple_deltas(ripple_server)
    for batch_id in (7, 7, 8):  # batch 7 run again after a failure, then batch 8
        write(rows, batch_id, kind="kw_foreach")
        write(values, batch_id, stream=sdk_stream_name)
    after = _ripple_deltas(ripple_server)
    assert after["applied"] - before.get("applied", 0) == 60  # batches 7 and 8, once each
    assert after["duplicate"] - before.get("duplicate", 0) == 30  # batch 7's rerun
    assert _state(spark, ripple_server, "kw_foreach") == {f"f{i}": (float(i),) for i in range(30)}
    workers = _ripple_workers(ripple_server, "kw_foreach")
    assert workers == ["spark/kw_foreach/q-1/0", "spark/kw_foreach/q-1/1"]
    with headwater.connect(ripple_server.address) as hw:
        events = sorted(e.value.decode() for e in hw.scan(sdk_stream_name))
    assert events == sorted([f"f{i}:{float(i)}" for i in range(30)] * 2)
    with pytest.raises(Exception, match="options queryId and batchId go together"):
        write(rows, -1, kind="kw_foreach")
