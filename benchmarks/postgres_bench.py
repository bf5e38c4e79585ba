#!/usr/bin/env python3
"""A GROUP BY over N events through the postgres listener against the Kimberlite Query,
on one server, in one run (issue 21: goal postgres / Kimberlite <= 1.2).

Setup: N JSON events (default 1,000,000) appended to one stream through the SDK, in
batches of 1,000, with sync policy ``none`` (setup speed only).

Measured, best of ``--repeat`` rounds after one warm-up each, the same SQL every time,
the clients taking turns within each round (``timed_together``):

* ``kimberlite``: the SDK's ``client.query(SQL)`` (Kimberlite Query, one connection);
* ``psycopg``: ``cursor.execute(SQL); fetchall()`` on one open psycopg connection
  (the PostgreSQL wire, extended protocol);
* ``psql_session``: one psql session, as a user at its prompt runs the query again and
  again: the statement is typed into one running ``psql`` (its stdin) with ``\timing
  on``, and the time is psql's own ``Time: ... ms`` for it (what the user reads);
* ``psql``: one ``psql -c SQL`` process per run, as a script calls it: process start,
  connect and start-up included (trust: no password); beside it ``psql -c 'SELECT 1'``,
  that start alone, and the psql time less it.

Each is also run over a 10,000-row result (``SELECT ... LIMIT 10000``), which the
GROUP BY's few rows do not exercise: the wire's per-row encoding. Results go to stdout
as a markdown table and, with ``--out``, to JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

import headwater
from benchlib import HeadwaterServer, cpu_model, git_revision, loadavg, report

KINDS = ["click", "view", "purchase", "signup", "logout", "search", "share", "like"]
QUERIES = {
    "group_by": (
        "SELECT json->>'kind' AS kind, count(*) AS n, sum((json->>'amount')::BIGINT) AS total "
        "FROM events GROUP BY 1 ORDER BY 1"
    ),
    "rows_10k": "SELECT \"offset\", json->>'kind' AS kind, ts FROM events LIMIT 10000",
}
GOAL = 1.2


def event(i: int) -> bytes:
    return json.dumps(
        {"kind": KINDS[i % len(KINDS)], "user": i % 1000, "amount": i % 100, "seq": i}
    ).encode()


class PsqlSession:
    """One interactive psql (``\\timing on``) fed statements on its stdin, as typed at its
    prompt; :meth:`run` returns psql's own time of the statement, in seconds."""

    TIME = re.compile(r"^Time: ([0-9.]+) ms")
    DONE = "-- headwater bench: done --"

    def __init__(self, psql: str, dsn: str) -> None:
        self.proc = subprocess.Popen(
            [psql, "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", dsn],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send("\\timing on")

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def run(self, sql: str) -> float:
        """Run ``sql``; its result rows are read (and dropped) up to a marker."""
        self._send(sql.rstrip(";") + ";")
        self._send(f"\\echo '{self.DONE}'")
        assert self.proc.stdout is not None
        seconds: float | None = None
        for line in self.proc.stdout:
            if line.rstrip("\n") == self.DONE:
                break
            timed = self.TIME.match(line)
            if timed:
                seconds = float(timed.group(1)) / 1000
        if seconds is None:
            raise RuntimeError(f"psql printed no timing for {sql!r} (exit {self.proc.poll()})")
        return seconds

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def timed_together(clients: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Best time of each client over ``repeat`` rounds, after one warm-up each. A round
    runs every client once, in an order rotated each round, so a burst of load on the
    shared machine (or the projection still settling after the load) falls on all of
    them alike rather than on whichever ran its runs back to back at that moment. A
    client that returns a float timed itself (psql's own timing): that is its time."""
    for fn in clients.values():
        fn()
    names = list(clients)
    best = dict.fromkeys(names, float("inf"))
    for round_ in range(repeat):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            started = time.perf_counter()
            outcome = clients[name]()
            elapsed = time.perf_counter() - started
            best[name] = min(best[name], outcome if isinstance(outcome, float) else elapsed)
    return best


def run(events: int, batch: int, repeat: int) -> dict[str, Any]:
    psql = shutil.which("psql")
    if psql is None:
        raise SystemExit("psql is missing: `make system-deps` installs postgresql-client")
    with tempfile.TemporaryDirectory() as tmp:
        server = HeadwaterServer()
        server.start(
            Path(tmp),
            '[storage]\nsync = "none"\n',
            listeners=("kimberlite", "postgres"),
        )
        try:
            address = f"127.0.0.1:{server.ports['kimberlite']}"
            dsn = f"host=127.0.0.1 port={server.ports['postgres']} user=bench dbname=0"
            with headwater.connect(address) as client:
                client.create_stream("events")
                started = time.perf_counter()
                for first in range(0, events, batch):
                    client.append(
                        "events", [event(i) for i in range(first, min(first + batch, events))]
                    )
                load_s = time.perf_counter() - started
                session = PsqlSession(psql, dsn)
                with psycopg.connect(dsn, autocommit=True) as pg:
                    results: dict[str, Any] = {}
                    for name, sql in QUERIES.items():
                        kimberlite = client.query(sql)
                        rows = pg.execute(sql).fetchall()
                        assert len(rows) == len(kimberlite.rows), (name, len(rows))
                        best = timed_together(
                            {
                                "kimberlite": lambda sql=sql: client.query(sql),
                                "psycopg": lambda sql=sql: pg.execute(sql).fetchall(),
                                "psql_session": lambda sql=sql: session.run(sql),
                                "psql": lambda sql=sql: subprocess.run(
                                    [psql, "-X", "-A", "-t", "-c", sql, dsn],
                                    check=True,
                                    capture_output=True,
                                ),
                                # What psql -c costs before any query: process start,
                                # connect and start-up, a trivial statement.
                                "psql_start": lambda: subprocess.run(
                                    [psql, "-X", "-A", "-t", "-c", "SELECT 1", dsn],
                                    check=True,
                                    capture_output=True,
                                ),
                            },
                            repeat,
                        )
                        k, p, q = best["kimberlite"], best["psycopg"], best["psql"]
                        start, session_s = best["psql_start"], best["psql_session"]
                        results[name] = {
                            "rows": len(rows),
                            "kimberlite_s": k,
                            "psycopg_s": p,
                            "psql_session_s": session_s,
                            "psql_s": q,
                            "psycopg_ratio": p / k,
                            "psql_session_ratio": session_s / k,
                            "psql_ratio": q / k,
                            "psql_start_s": start,
                            "psql_less_start_ratio": (q - start) / k,
                        }
                session.close()
        finally:
            server.stop()
    return {
        "benchmark": "postgres_bench",
        "machine": {"cpu": cpu_model(), "loadavg": loadavg(), "revision": git_revision()},
        "events": events,
        "load_s": load_s,
        "repeat": repeat,
        "goal": GOAL,
        "queries": results,
    }


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"GROUP BY through the postgres listener vs the Kimberlite Query, "
        f"{results['events']:,} events (best of {results['repeat']}; goal <= {GOAL}x)",
        "",
        "| query | rows | Kimberlite | psycopg | psycopg / Kimberlite | psql session "
        "| psql session / Kimberlite | psql -c "
        "| psql / Kimberlite | psql -c 'SELECT 1' | psql less that / Kimberlite |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["queries"].items():
        lines.append(
            f"| {name} | {r['rows']:,} | {r['kimberlite_s'] * 1000:.1f} ms "
            f"| {r['psycopg_s'] * 1000:.1f} ms | {r['psycopg_ratio']:.2f}x "
            f"| {r['psql_session_s'] * 1000:.1f} ms | {r['psql_session_ratio']:.2f}x "
            f"| {r['psql_s'] * 1000:.1f} ms | {r['psql_ratio']:.2f}x "
            f"| {r['psql_start_s'] * 1000:.1f} ms | {r['psql_less_start_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="100,000 events, 3 repeats")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.repeat = 100_000, 3
    results = run(args.events, args.batch, args.repeat)
    report(results, markdown, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
