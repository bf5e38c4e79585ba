"""What any PySpark Python data source can reach on this machine, against Parquet and the
headwater format, in one run (issue 18's goal: a 6-partition stream read and written at
≥ 0.5x Spark on Parquet).

A Python data source (``pyspark.sql.datasource``) hands Spark Arrow batches through a
Python worker, which the JVM then reads; Parquet is read and written inside the JVM.
This measures the ceiling of the first path: a ``ceiling`` source whose partitions
memory-map Arrow IPC files of exactly the rows and columns the headwater source yields
(no server, no decoding: its reads cost only the mapping) and a ``ceiling`` sink whose
tasks count the Arrow batches Spark gives them and drop them. No Python source or sink,
headwater's included, can do less per row than these. Three sides, alternating run by
run, into the same ``noop`` / from the same Parquet rows as
``spark_partitions_bench.py`` (same stream, ``--events`` keyed events over
``--partitions`` partitions, ``local[2]``):

* **read**: ``ceiling`` / ``headwater`` / Parquet, every column into ``noop``;
* **write**: ``key, value`` from Parquet into the ``ceiling`` sink / a fresh
  ``headwater`` stream / Parquet files.

Each side's CPU per row is given by role (server, Python workers, JVM), from /proc.

    .venv/bin/python benchmarks/spark_ceiling_bench.py --events 5000000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import headwater
from benchlib import HeadwaterServer, report, spark_session, timed
from spark_partitions_bench import ROLES, cpu_table, create, fill
from spark_read_profile import cpu_by_process

SIDES = ("ceiling", "headwater", "parquet")


def ceiling_source(directory: str, schema_ddl: str) -> type:
    """The ``ceiling`` data source over the IPC files in ``directory`` (one per
    partition). Defined in a function so the workers get it by value (cloudpickle)."""
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        InputPartition,
        WriterCommitMessage,
    )

    class CeilingReader(DataSourceReader):
        def partitions(self) -> list[InputPartition]:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".arrow"))
            return [InputPartition(os.path.join(directory, f)) for f in files]

        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            with pa.memory_map(partition.value) as source:
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)

    class Counted(WriterCommitMessage):
        def __init__(self, rows: int) -> None:
            self.rows = rows

    class CeilingWriter(DataSourceArrowWriter):
        def write(self, iterator: Iterator[pa.RecordBatch]) -> Counted:
            return Counted(sum(batch.num_rows for batch in iterator))

        def commit(self, messages: list[Any]) -> None:
            rows = sum(m.rows for m in messages)
            with open(os.path.join(directory, "written"), "w") as f:
                f.write(str(rows))

    class CeilingDataSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ceiling"

        def schema(self) -> str:
            return schema_ddl

        def reader(self, schema: Any) -> CeilingReader:
            return CeilingReader()

        def writer(self, schema: Any, overwrite: bool) -> CeilingWriter:
            return CeilingWriter()

    return CeilingDataSource


def ipc_files(parquet: Path, out: Path, batch_rows: int) -> None:
    """One Arrow IPC file per Parquet file (= per stream partition, up to the source's
    1M-offset splits), in batches of ``batch_rows``: the records path's rounds, 65,536
    events unless their stored bytes pass 8 MiB first, which these rows' do not."""
    out.mkdir()
    for i, path in enumerate(sorted(parquet.glob("*.parquet"))):
        table = pq.read_table(path)
        # Spark's Parquet holds the timestamps as INT96 (read as ns): the source yields
        # them as Spark's TIMESTAMP wants them, µs in UTC.
        at = table.schema.get_field_index("timestamp")
        field = pa.field("timestamp", pa.timestamp("us", tz="UTC"))
        table = table.set_column(at, field, table.column(at).cast(field.type))
        table = table.replace_schema_metadata(None)
        with (
            pa.OSFile(str(out / f"part-{i:03d}.arrow"), "wb") as sink,
            pa.ipc.new_file(sink, table.schema) as writer,
        ):
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=5_000_000)
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch-rows", type=int, default=65_536)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="spark_ceiling_bench_"))
    hw_server = HeadwaterServer()
    hw_server.start(root, listeners=("kimberlite", "http"))
    server = f"127.0.0.1:{hw_server.port}"
    seconds: dict[str, dict[str, list[float]]] = {
        "read": {s: [] for s in SIDES},
        "write": {s: [] for s in SIDES},
    }
    cpu: dict[str, list[dict[str, float]]] = {}
    try:
        fill(server, "bench", args.events, args.partitions)
        spark = spark_session()

        def stream_df() -> Any:
            return (
                spark.read.format("headwater")
                .option("server", server)
                .option("stream", "bench")
                .load()
            )

        parquet = root / "parquet"
        stream_df().write.parquet(str(parquet))  # one file per stream partition
        ipc = root / "ipc"
        ipc_files(parquet, ipc, args.batch_rows)
        ddl = stream_df().schema.simpleString()[len("struct<") : -1].replace(":", " ")
        spark.dataSource.register(ceiling_source(str(ipc), ddl))
        assert spark.read.format("ceiling").load().count() == args.events

        def measured(phase: str, side: str, action: Any) -> None:
            before = cpu_by_process({hw_server.pid: "server"})
            seconds[phase][side].append(timed(action))
            after = cpu_by_process({hw_server.pid: "server"})
            cpu.setdefault(f"{phase} {side}", []).append(
                {r: after.get(r, 0.0) - before.get(r, 0.0) for r in ROLES}
            )

        with headwater.connect(server) as hw, hw.http_api() as api:
            for run in range(args.repeat):
                order = SIDES[run % 3 :] + SIDES[: run % 3]
                for side in order:
                    if side == "ceiling":
                        df = spark.read.format("ceiling").load()
                    elif side == "headwater":
                        df = stream_df()
                    else:
                        df = spark.read.parquet(str(parquet))
                    measured(
                        "read", side, lambda df=df: df.write.format("noop").mode("append").save()
                    )
                for side in order:
                    rows = spark.read.parquet(str(parquet)).select("key", "value")
                    if side == "ceiling":
                        action = rows.write.format("ceiling").mode("append").save
                    elif side == "headwater":
                        create(api, f"copy{run}", args.partitions)
                        action = (
                            rows.write.format("headwater")
                            .option("server", server)
                            .option("stream", f"copy{run}")
                            .mode("append")
                            .save
                        )
                    else:
                        target = str(root / f"copy{run}")
                        action = lambda t=target, r=rows: r.write.parquet(t)  # noqa: E731
                    measured("write", side, action)
                    if side == "ceiling":
                        assert int((ipc / "written").read_text()) == args.events
                    if side == "parquet":
                        shutil.rmtree(root / f"copy{run}")
            for run in range(args.repeat):
                copied = api.stream(f"copy{run}")["partition_offsets"]
                assert sum(p["next_offset"] for p in copied) == args.events
        spark.stop()
    finally:
        hw_server.stop()
        shutil.rmtree(root, ignore_errors=True)

    rates = {
        phase: {side: args.events / statistics.median(runs) for side, runs in sides.items()}
        for phase, sides in seconds.items()
    }
    results = {
        "events": args.events,
        "partitions": args.partitions,
        "repeat": args.repeat,
        "rows_per_s": rates,
        "runs_s": seconds,
        "cpu_s": cpu,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    report(results, markdown, args.out)
    return 0


def markdown(results: dict[str, Any]) -> str:
    events = results["events"]
    lines = [
        f"{events:,} rows, {results['partitions']} partitions, {results['repeat']} runs "
        f"(medians); load {results['load_before']:.1f} -> {results['load_after']:.1f}",
        "",
        "| phase | ceiling rows/s | headwater rows/s | Parquet rows/s | ceiling / Parquet "
        "| headwater / Parquet | headwater / ceiling |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for phase, r in results["rows_per_s"].items():
        lines.append(
            f"| {phase} | {r['ceiling']:,.0f} | {r['headwater']:,.0f} | {r['parquet']:,.0f} "
            f"| {r['ceiling'] / r['parquet']:.2f} | {r['headwater'] / r['parquet']:.2f} "
            f"| {r['headwater'] / r['ceiling']:.2f} |"
        )
    lines += ["", *cpu_table(results["cpu_s"], events)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
