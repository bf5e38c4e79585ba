"""Running a checked :class:`~.spec.PipelineSpec` on Spark (local or a cluster)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .spec import PipelineSpec, SinkSpec, SourceSpec, TransformSpec

FORMAT = "headwater"
Report = Callable[[str], None]


def spark_session(master: str, app_name: str, conf: dict[str, str]) -> Any:
    # Executors must run an interpreter that has headwater installed: this one.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.pyspark.python", os.environ["PYSPARK_PYTHON"])
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.streaming.schemaInference", "true")
        .config("spark.ui.showConsoleProgress", "false")  # the runner prints its own lines
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _connection_options(spec: PipelineSpec) -> dict[str, str]:
    options = {"server": spec.connection.server, "tenant": str(spec.connection.tenant)}
    if spec.connection.token:
        options["token"] = spec.connection.token
    connection = spec.connection
    if connection.tls:
        options["tls"] = "true"
    for option, path in (
        ("caFile", connection.ca_file),
        ("certFile", connection.cert_file),
        ("keyFile", connection.key_file),
    ):
        if path is not None:
            options[option] = path
    return options


def _source(spark: Any, spec: PipelineSpec, source: SourceSpec) -> Any:
    reader = spark.readStream
    if source.type == "stream":
        reader = reader.format(FORMAT).options(**_connection_options(spec))
        reader = reader.option("stream", source.settings["stream"])
        if source.settings["format"] != "raw":
            reader = reader.option("valueFormat", source.settings["format"])
            reader = reader.option("schema", source.settings["schema"])
        return reader.options(**source.options).load()
    if source.type == "kind":
        reader = reader.format(FORMAT).options(**_connection_options(spec))
        return reader.option("kind", source.settings["kind"]).options(**source.options).load()
    reader = reader.format(source.type).options(**source.options)
    if source.settings["schema"]:
        reader = reader.schema(source.settings["schema"])
    else:  # parquet: the schema its files carry (without the session's schemaInference)
        reader = reader.schema(spark.read.parquet(source.settings["path"]).schema)
    return reader.load(source.settings["path"])


def _transform(spark: Any, frames: dict[str, Any], step: TransformSpec) -> Any:
    from pyspark.sql import functions as F

    if step.type == "sql":
        return spark.sql(step.settings)
    df = frames[step.input]
    if step.type == "filter":
        return df.filter(step.settings)
    if step.type == "select":
        return df.select([F.col(k).alias(v) for k, v in step.settings.items()])
    if step.type == "mask":
        # A stable SHA-256 keeps joins and counts on the field possible without its value.
        for column in step.settings:
            df = df.withColumn(column, F.sha2(F.col(column).cast("string"), 256))
        return df
    w = step.settings
    window = (
        F.window(w["time"], w["duration"], w["slide"])
        if w["slide"]
        else F.window(w["time"], w["duration"])
    )
    aggs = [F.expr(expr).alias(name) for name, expr in w["aggregations"].items()]
    grouped = df.withWatermark(w["time"], w["watermark"]).groupBy(window, *w["group_by"])
    return grouped.agg(*aggs).select(
        F.col("window.start").alias("window_start"),
        F.col("window.end").alias("window_end"),
        *w["group_by"],
        *w["aggregations"],
    )


QUERY_ID_PROPERTY = "sql.streaming.queryId"  # the local property Spark sets per batch
RowsOut = dict[tuple[str, int], int]  # (query id, batch id) -> rows a sink wrote


def _foreach_batch(
    options: dict[str, str], rows_out: RowsOut, *, ordered: bool
) -> Callable[[Any, int], None]:
    """Update mode on a headwater sink: Spark's Python data sources take append and
    complete only, so each micro-batch is a batch write numbered as the streaming writer
    numbers that (query, batch) (options queryId, batchId): exactly once across reruns.
    Its rows are counted on the way (an Observation) for the progress line.

    ``ordered``: sort each partition's rows on every column first. A kind sink numbers
    its deltas by row position, and after the shuffle by key a retried task may get its
    rows in another order: sorted, it numbers the same rows the same way."""

    def write(batch: Any, batch_id: int) -> None:
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        query_id = batch.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
        if not query_id:
            raise RuntimeError(f"Spark did not pass {QUERY_ID_PROPERTY} to foreachBatch")
        observation = Observation("headwater_rows_out")
        if ordered:
            batch = batch.sortWithinPartitions(*batch.columns)
        counted = batch.observe(observation, F.count(F.lit(1)).alias("rows"))
        writer = counted.write.format(FORMAT).options(**options).mode("append")
        writer.option("queryId", query_id).option("batchId", str(batch_id)).save()
        rows_out[(query_id, batch_id)] = int(observation.get["rows"])

    return write


def _start_sink(spec: PipelineSpec, sink: SinkSpec, df: Any, rows_out: RowsOut) -> Any:
    if sink.type == "kind" and sink.partitions is not None:
        # Each writing partition is a Ripple worker holding one of the tenant's 64 source
        # slots: a bounded number of partitions, and hashed by the key so that a key
        # always comes from the same worker (a Remove clears only what its worker set),
        # whatever spark.sql.shuffle.partitions the steps before had.
        df = df.repartition(sink.partitions, df[sink.settings["key"]])
    writer = df.writeStream.queryName(f"{spec.name}_{sink.name}").outputMode(spec.output_mode)
    writer = writer.option("checkpointLocation", str(spec.checkpoint / sink.name))
    if sink.type in ("stream", "kind"):
        options = {**_connection_options(spec), **sink.settings, **sink.options}
        if spec.output_mode == "update":
            ordered = sink.type == "kind"
            writer = writer.foreachBatch(_foreach_batch(options, rows_out, ordered=ordered))
        else:
            writer = writer.format(FORMAT).options(**options)
    elif sink.type == "parquet":
        writer = writer.format("parquet").option("path", sink.settings["path"])
        writer = writer.options(**sink.options)
    else:
        writer = writer.format("console").option("truncate", "false").options(**sink.options)
    trigger = spec.trigger
    if "processingTime" in trigger:
        writer = writer.trigger(processingTime=str(trigger["processingTime"]))
    elif trigger.get("availableNow"):
        writer = writer.trigger(availableNow=True)
    elif trigger.get("once"):
        writer = writer.trigger(once=True)
    return writer.start()


def progress_line(progress: dict[str, Any], rows_out: int | None = None) -> str:
    """One line per micro-batch: rows in/out, lag behind the sources, batch duration.
    ``rows_out``: what the sink wrote when Spark does not know (foreachBatch)."""
    lag = 0
    for source in progress.get("sources", []):
        lag += _offset_lag(source.get("endOffset"), source.get("latestOffset"))
    if rows_out is None:
        rows_out = progress.get("sink", {}).get("numOutputRows", -1)
    duration = progress.get("durationMs", {}).get("triggerExecution", 0)
    out = "?" if rows_out is None or rows_out < 0 else str(rows_out)
    return (
        f"[{progress.get('name')}] batch {progress.get('batchId')}: "
        f"in {progress.get('numInputRows', 0)} rows, out {out} rows, "
        f"lag {lag} offsets, {duration} ms"
    )


def _offset_lag(end: Any, latest: Any) -> int:
    import json

    try:
        end_d = json.loads(end) if isinstance(end, str) else end
        latest_d = json.loads(latest) if isinstance(latest, str) else latest
    except (TypeError, ValueError):
        return 0
    if not isinstance(end_d, dict) or not isinstance(latest_d, dict):
        return 0
    lag = 0
    for stream, parts in latest_d.items():
        if isinstance(parts, int) and isinstance(end_d.get(stream), int):
            lag += max(0, parts - end_d[stream])  # a kind's changelog: {"position": N}
        elif isinstance(parts, dict):
            for part, offset in parts.items():
                done = (
                    end_d.get(stream, {}).get(part, 0) if isinstance(end_d.get(stream), dict) else 0
                )
                lag += max(0, int(offset) - int(done))
    return lag


def run_pipeline(spec: PipelineSpec, master: str, report: Report, spark: Any = None) -> int:
    """Start every sink's query and wait; returns 0 when all ended without error."""
    if spark is None:
        spark = spark_session(master, f"headwater-{spec.name}", spec.spark_conf)
    frames: dict[str, Any] = {}
    for source in spec.sources:
        frames[source.name] = _source(spark, spec, source)
        frames[source.name].createOrReplaceTempView(source.name)
    for step in spec.transforms:
        frames[step.name] = _transform(spark, frames, step)
        frames[step.name].createOrReplaceTempView(step.name)
    rows_out: RowsOut = {}
    queries = [_start_sink(spec, sink, frames[sink.input], rows_out) for sink in spec.sinks]
    seen: set[tuple[str, int]] = set()

    def report_progress(query: Any) -> None:
        for progress in query.recentProgress:
            key = (str(progress["runId"]), int(progress["batchId"]))
            if key not in seen:
                seen.add(key)
                written = rows_out.get((str(progress["id"]), int(progress["batchId"])))
                report(progress_line(progress, written))

    failed = 0
    interrupted = threading.Event()
    with _sigint_sets(interrupted):
        try:
            while queries and not interrupted.is_set():
                for query in list(queries):
                    active = query.isActive  # before its progress: a last batch is not missed
                    report_progress(query)
                    if not active:
                        queries.remove(query)
                        error = query.exception()
                        if error is not None:
                            failed += 1
                            report(f"[{query.name}] failed: {error}")
                interrupted.wait(0.2)
        except KeyboardInterrupt:
            interrupted.set()
    if interrupted.is_set():
        for query in queries:
            try:
                query.stop()
                report_progress(query)  # the batches that ended since the last look
            except Exception as exc:  # the JVM got the Ctrl-C too and is gone
                report(f"[{query.name}] stopped with the JVM: {exc}")
        return 130
    return 1 if failed else 0


@contextlib.contextmanager
def _sigint_sets(interrupted: threading.Event) -> Iterator[None]:
    """While the pipeline waits, Ctrl-C only sets ``interrupted``: PySpark's own handler
    raises KeyboardInterrupt inside whatever py4j call is running, which py4j then turns
    into an error of its own, and the queries would not be stopped. Only the main thread
    can take signals; elsewhere KeyboardInterrupt stays the way in."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
