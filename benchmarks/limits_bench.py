#!/usr/bin/env python3
"""What the ``[limits]`` checks cost on the hot path: this checkout against a baseline
revision (default: the commit before ``[limits]`` existed), side by side in one run.

Both servers run as real processes on loopback with their default configuration, the
baseline from a ``git worktree`` of ``--baseline`` (its ``src/`` on PYTHONPATH), the other
from the installed package (this checkout). The same raw Kimberlite client as
wire_bench.py drives both, alternating which goes first, each run after both servers
have gone idle; the median of ``--repeat`` runs is reported:

* produce: ``--events`` events of ``--size`` bytes, AppendEvents of ``--batch`` events,
  ``--depth`` in flight;
* consume: the same events read back with ReadEvents pages of ``--page-bytes``;
* append latency: one event per AppendEvents, one at a time; p50/p99.

    .venv/bin/python benchmarks/limits_bench.py
    .venv/bin/python benchmarks/run_all.py --bench limits_bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import (
    HeadwaterServer,
    HelpFormatter,
    default_root,
    git_revision,
    loadavg,
    log,
    pct,
    proc_cpu,
    report,
    settle,
)
from headwater.protocols.kimberlite import AppendEventsRequest, EventBatch
from wire_bench import KimberliteClient, Workload, hw_consume, hw_produce

REPO = Path(__file__).resolve().parent.parent
BASELINE = "5867cc6^"  # the parent of the commit that introduced [limits]


def measure(
    server: HeadwaterServer, work: Workload, args: argparse.Namespace, run: int
) -> dict[str, Any]:
    client = KimberliteClient(server.port)
    try:
        stream_id = client.create_stream(f"limits_{run}")
        batches = args.events // args.batch
        cpu0 = proc_cpu(server.pid)
        t0 = time.perf_counter()
        produced = hw_produce(client, stream_id, work, batches, args.depth, client_encode=False)
        produce_s = time.perf_counter() - t0
        cpu1 = proc_cpu(server.pid)
        t0 = time.perf_counter()
        consumed = hw_consume(client, stream_id, produced, args.page_bytes)
        consume_s = time.perf_counter() - t0
        cpu2 = proc_cpu(server.pid)
        samples: list[float] = []
        one = EventBatch.of([b"x" * args.size])
        for _ in range(args.latency_samples):
            t0 = time.perf_counter()
            client.call(AppendEventsRequest(stream_id, one))
            samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        client.close()
    return {
        "produce_events_per_s": produced / produce_s,
        "produce_cpu_us_per_event": (cpu1 - cpu0) / produced * 1e6,
        "consume_events_per_s": consumed / consume_s,
        "consume_cpu_us_per_event": (cpu2 - cpu1) / consumed * 1e6,
        "append_p50_ms": pct(samples, 50),
        "append_p99_ms": pct(samples, 99),
    }


METRICS = (
    ("produce_events_per_s", "produce, events/s", "higher"),
    ("produce_cpu_us_per_event", "produce, server CPU µs/event", "lower"),
    ("consume_events_per_s", "consume, events/s", "higher"),
    ("consume_cpu_us_per_event", "consume, server CPU µs/event", "lower"),
    ("append_p50_ms", "single-event append p50, ms", "lower"),
    ("append_p99_ms", "single-event append p99, ms", "lower"),
)


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"limits overhead: {env['after']} vs baseline {env['before']} "
        f"({results['config']['events']:,} events of {results['config']['size']} B, "
        f"median of {results['config']['repeat']} alternating runs, "
        f"load average {env['loadavg_before']} before)",
        "",
        "| measure | baseline | this checkout | ratio (this / baseline) |",
        "|---|---:|---:|---:|",
    ]
    for key, label, _better in METRICS:
        before = results["before"][key]
        after = results["after"][key]
        lines.append(f"| {label} | {before:,.3g} | {after:,.3g} | {after / before:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--baseline", default=BASELINE, help="git revision to compare against")
    p.add_argument("--events", type=int, default=300_000, help="events per produce run")
    p.add_argument("--batch", type=int, default=1000, help="events per AppendEvents")
    p.add_argument("--size", type=int, default=100, help="bytes per event")
    p.add_argument("--depth", type=int, default=8, help="appends in flight")
    p.add_argument("--page-bytes", type=int, default=1 << 20, help="ReadEvents max_bytes")
    p.add_argument("--latency-samples", type=int, default=1000, help="single-event appends")
    p.add_argument("--repeat", type=int, default=5, help="runs per side; the median is kept")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (a disk)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.latency_samples, args.repeat = 20_000, 100, 1
    root = args.dir.resolve() if args.dir else default_root("headwater-limits-bench-")
    root.mkdir(parents=True, exist_ok=True)
    tree = root / "baseline"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline],
        check=True,
        capture_output=True,
    )
    before_rev = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    sides = {
        "before": HeadwaterServer(
            src=tree / "src",
            name="before",
            known_listeners=("kimberlite", "http", "convergedb", "ripple"),
        ),
        "after": HeadwaterServer(name="after"),
    }
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "config": {k: v for k, v in vars(args).items() if k not in ("dir", "out")},
        "environment": {
            "before": before_rev,
            "after": git_revision(),
            "loadavg_before": loadavg(),
        },
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    try:
        for name, server in sides.items():
            (root / name).mkdir()
            server.start(root / name)
            log(f"{name}: pid {server.pid} on port {server.port}")
        work = Workload(args.size, args.batch, distinct=16)
        pids = [server.pid for server in sides.values()]
        for run in range(args.repeat):
            order = list(sides) if run % 2 == 0 else list(reversed(sides))
            for name in order:
                settle(pids, timeout=30)
                runs[name].append(measure(sides[name], work, args, run))
                log(f"run {run} {name}: {json.dumps(runs[name][-1])}")
        for name in sides:
            sides[name].check_alive()
    finally:
        for server in sides.values():
            server.stop()
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
            check=False,
            capture_output=True,
        )
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    for name in sides:
        results[name] = {
            key: statistics.median(r[key] for r in runs[name]) for key, _l, _b in METRICS
        }
    results["runs"] = runs
    report(results, markdown, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
