#!/usr/bin/env python3
"""Append -> entity kind update through a Spark streaming query (1-second trigger).

A real ``headwater serve`` (Kimberlite, ConvergeDB and Ripple listeners) and one local
Spark (local[2]). A writer appends ``--rate`` events per second to stream ``ticks`` for
``--seconds``, each a JSON object carrying its own send time (wall clock, this machine).
Two streaming queries read the stream with the same trigger:

* headwater: rows become kind ``ticks_latest`` through the ``headwater`` sink (Ripple
  deltas, a checkpoint per task); a ConvergeDB subscriber (headwater.entities) notes when
  each entity's notification arrives: append -> visible to a subscriber.
* reference: Spark's own floor for the same source and trigger, a ``foreachBatch`` that
  notes when each row reaches the sink's hands (nothing written anywhere).

Each event is its own entity (key ``e<n>``), so the kind's 20 ms coalescing merges
nothing. Reported: p50/p99/max latency of both and the ratio of the medians.

    .venv/bin/python benchmarks/spark_kind_latency_bench.py
    .venv/bin/python benchmarks/spark_kind_latency_bench.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import headwater
from benchlib import HeadwaterServer, git_revision, loadavg, pct, report
from headwater import entities


@dataclass
class Tick:
    """The kind as the sink creates it from the query's columns (after the key)."""

    n: int
    sent_ns: int


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=int, default=200, help="events appended per second")
    p.add_argument("--seconds", type=float, default=30.0, help="how long to append")
    p.add_argument("--trigger", default="1 second")
    p.add_argument("--quick", action="store_true", help="8 seconds")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 8.0
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    root = Path(tempfile.mkdtemp(prefix="spark_kind_latency_"))
    server = HeadwaterServer()
    load_before = loadavg()
    server.start(root, listeners=("kimberlite", "convergedb", "ripple"))
    address = f"127.0.0.1:{server.ports['kimberlite']}"
    total = int(args.rate * args.seconds)
    kind_ms: dict[int, float] = {}
    floor_ms: dict[int, float] = {}
    try:
        with headwater.connect(address) as hw:
            hw.create_stream("ticks")
        spark = (
            SparkSession.builder.master("local[2]")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        ticks = (
            spark.readStream.format("headwater")
            .option("server", address)
            .option("stream", "ticks")
            .option("valueFormat", "json")
            .option("schema", "n BIGINT, sent_ns BIGINT")
            .load()
            .selectExpr("concat('e', CAST(n AS STRING)) AS key", "n", "sent_ns")
        )
        to_kind = (
            ticks.writeStream.format("headwater")
            .option("server", address)
            .option("rippleServer", f"127.0.0.1:{server.ports['ripple']}")
            .option("kind", "ticks_latest")
            .option("checkpointLocation", str(root / "ck_kind"))
            .trigger(processingTime=args.trigger)
            .start()
        )

        def at_sink(df: Any, batch_id: int) -> None:
            now = time.time_ns()
            for row in df.select("n", "sent_ns").collect():
                if row["n"] >= 0:
                    floor_ms[row["n"]] = (now - row["sent_ns"]) / 1e6

        reference = (
            ticks.writeStream.foreachBatch(at_sink)
            .option("checkpointLocation", str(root / "ck_floor"))
            .trigger(processingTime=args.trigger)
            .start()
        )
        stop = threading.Event()
        subscribed = threading.Event()

        def subscribe() -> None:
            cdb = f"127.0.0.1:{server.ports['convergedb']}"
            with entities.connect(cdb, read_only=True) as reader:
                while not stop.is_set():
                    try:
                        kind = reader.get_kind(Tick, "ticks_latest")
                        break
                    except entities.KindNotFound:
                        time.sleep(0.05)
                else:
                    return
                with reader.subscribe(kind, bootstrap=False) as changes:
                    subscribed.set()
                    for change in changes:
                        value = change.value
                        if value is not None and value.n >= 0:  # -1 made the kind
                            kind_ms.setdefault(value.n, (time.time_ns() - value.sent_ns) / 1e6)
                        if len(kind_ms) >= total or stop.is_set():
                            return

        watcher = threading.Thread(target=subscribe, daemon=True)
        watcher.start()
        with headwater.connect(address) as hw:
            # A first event creates the kind; measuring starts once the subscriber is in.
            hw.append("ticks", [json.dumps({"n": -1, "sent_ns": time.time_ns()}).encode()])
            if not subscribed.wait(120):
                raise RuntimeError("the kind did not appear within 120 s")
            start = time.monotonic()
            for i in range(total):
                delay = start + i / args.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                hw.append("ticks", [json.dumps({"n": i, "sent_ns": time.time_ns()}).encode()])
        deadline = time.monotonic() + 60
        while (len(kind_ms) < total or len(floor_ms) < total) and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        to_kind.stop()
        reference.stop()
        spark.stop()
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    kind = [kind_ms[n] for n in range(total) if n in kind_ms]
    floor = [floor_ms[n] for n in range(total) if n in floor_ms]
    results = {
        "rate": args.rate,
        "seconds": args.seconds,
        "trigger": args.trigger,
        "events": total,
        "revision": git_revision(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "kind": summary(kind, total),
        "spark_floor": summary(floor, total),
    }
    results["ratio_p50"] = results["kind"]["p50_ms"] / results["spark_floor"]["p50_ms"]
    report(results, markdown, args.out)
    return 0


def summary(samples: list[float], total: int) -> dict[str, float]:
    return {
        "received": len(samples),
        "missing": total - len(samples),
        "p50_ms": pct(samples, 50),
        "p99_ms": pct(samples, 99),
        "max_ms": max(samples) if samples else float("nan"),
    }


def markdown(r: dict[str, Any]) -> str:
    rows = [
        ("headwater sink -> kind -> ConvergeDB subscriber", r["kind"]),
        ("Spark floor (foreachBatch, same source and trigger)", r["spark_floor"]),
    ]
    lines = [
        "## spark_kind_latency_bench",
        "",
        f"{r['events']:,} events at {r['rate']}/s, trigger {r['trigger']}; headwater "
        f"{r['revision']}; load average before/after {r['loadavg_before']} / "
        f"{r['loadavg_after']}.",
        "",
        "| path | received | p50 ms | p99 ms | max ms |",
        "|---|--:|--:|--:|--:|",
    ]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['received']:,} | {s['p50_ms']:.0f} | {s['p99_ms']:.0f} "
            f"| {s['max_ms']:.0f} |"
        )
    lines += ["", f"headwater / Spark floor, p50: **{r['ratio_p50']:.2f}**"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
