#!/usr/bin/env python3
"""Data larger than memory (issue 16): a real server under its default settings, each
figure side by side with its reference in the same run.

1. RSS and append throughput versus data size: 1,000-byte JSON events appended over
   Kimberlite (pre-encoded batches of 1,000, 4 in flight, one connection) up to each of
   ``--sizes-gib`` in turn, while a thread samples the server's RssAnon and RssFile from
   /proc/<pid>/status. After each size: a full-scan GROUP BY, then a restart. Reference:
   the disk's sequential write rate, the same number of bytes written dd-like (1 MiB
   writes, one fdatasync at the end, like ``dd conv=fdatasync``) just before the step.
2. SQL GROUP BY over ``--sql-events`` events (about 80-byte JSON) through headwater's
   Query (over Kimberlite: the wire, the service and DuckDB over the sealed projection
   files) against bare DuckDB over the same rows written by this benchmark as one
   Parquet file. Goal: headwater / DuckDB <= 1.5. Runs alternate, best of ``--repeat``.
3. Restart time to ready versus data size (from 1): SIGTERM, the new process started,
   until its ports file is written and until its first query (a count of the stream,
   checked) is answered.
4. Cold read throughput: every event of the large stream read with ReadEvents from offset
   0 (8 MiB pages) against ``os.read`` of the same segment files, the page cache dropped
   before each (needs root; without it both sides are warm and the table says so).
   Runs alternate: raw, headwater, headwater, raw. Goal: headwater / raw >= 0.8.

Run ``python benchmarks/memory_bench.py --sizes-gib 1,4`` (``--quick``: 64 and 128 MiB,
200,000 SQL events). Results go to stdout as markdown and, with ``--out``, to JSON;
docs/benchmarks.md ("Data larger than memory (issue 16)") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from zlib_ng.zlib_ng import crc32

from benchlib import (
    HeadwaterServer,
    HelpFormatter,
    cpu_model,
    default_root,
    git_revision,
    loadavg,
    log,
    mount_of,
    proc_cpu,
)
from headwater.errors import ProjectionLag
from headwater.protocols.kimberlite import (
    AppendEventsRequest,
    AppendEventsResponse,
    EventBatch,
    QueryRequest,
    QueryResponse,
    ReadEventsRequest,
    ReadEventsResponse,
    decode_response,
)
from headwater.protocols.kimberlite.frames import HEADER, HEADER_SIZE, MAGIC, MAX_FRAME, VERSION
from headwater.server.memory import process_memory
from storage_bench import can_drop_caches, drop_caches, read_raw_files
from wire_bench import KimberliteClient, Workload, hw_produce

MIB = 1 << 20
GIB = 1 << 30
EVENT_BYTES = 1000
BATCH = 1000  # events per append: 1 MB, under Kimberlite's 4 MiB append limit
DEPTH = 4  # appends in flight
GROUPS = 10
DISTINCT_BATCHES = 16
READ_PAGE = 8 * MIB
BIG_STREAM = "big"
SQL_STREAM = "events"
SQL_BATCH = 5000
KINDS = ["click", "view", "purchase", "signup", "logout", "search", "share", "like"]
BIG_GROUP_BY = (
    f"SELECT CAST(json->>'g' AS INTEGER) AS g, count(*) AS n FROM {BIG_STREAM} "
    "GROUP BY g ORDER BY g"
)
SQL_GROUP_BY = (
    "SELECT json->>'kind' AS kind, count(*) AS n, sum((json->>'amount')::BIGINT) AS total "
    f"FROM {SQL_STREAM} GROUP BY 1 ORDER BY 1"
)


# ---- reading a stream from offset 0 -------------------------------------------------------


def _recv_exactly(sock: Any, view: memoryview) -> None:
    """Fill ``view`` from the socket (recv_into: the kernel's copy is the only one)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("headwater closed the connection")
        got += n


def read_all(client: KimberliteClient, stream_id: int, total: int, page_bytes: int) -> int:
    """Read ``total`` events from offset 0 with ReadEvents, one request at a time, as a
    client that does not copy: each frame is received straight into one reused buffer,
    its CRC checked there and its payload decoded in place (the events are views into
    it, good until the next page is received). ``wire_bench.hw_consume`` (the
    protocol's incremental decoder: each received chunk appended to its buffer, each
    payload copied out of it) was the client before (cold_read_bench ``--clients``)."""
    conn, sock = client.conn, client.sock
    head = memoryview(bytearray(HEADER_SIZE))
    payload = memoryview(bytearray(MAX_FRAME))
    offset = 0
    request_id, data = conn.send_request(ReadEventsRequest(stream_id, offset, page_bytes))
    sock.sendall(data)
    while offset < total:
        _recv_exactly(sock, head)
        magic, version, length, crc = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or length > MAX_FRAME:
            raise RuntimeError(f"bad frame header {bytes(head).hex()}")
        body = payload[:length]
        _recv_exactly(sock, body)
        if crc32(body) != crc:
            raise RuntimeError(f"frame CRC mismatch ({length}-byte payload)")
        response = decode_response(body)
        events = response.payload
        if not isinstance(events, ReadEventsResponse) or response.request_id != request_id:
            raise RuntimeError(f"read failed: {events!r}")
        if events.events.count == 0:
            raise RuntimeError(f"stream ended at {offset}, expected {total} events")
        offset += events.events.count
        if offset < total:
            request_id, data = conn.send_request(ReadEventsRequest(stream_id, offset, page_bytes))
            sock.sendall(data)
    return offset


# ---- the server's memory, sampled -------------------------------------------------------


@dataclass
class PhasePeak:
    anon: int = 0
    file: int = 0


@dataclass
class RssSampler:
    """Samples /proc/<pid>/status every ``interval`` s in a thread: the peak RssAnon and
    RssFile per phase, and a coarse time series (every ``keep_every``-th sample)."""

    server: HeadwaterServer
    interval: float = 0.05
    keep_every: int = 20
    phase: str = "start"
    peaks: dict[str, PhasePeak] = field(default_factory=dict)
    series: list[tuple[float, str, int, int]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _count: int = 0

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            proc = self.server.proc
            memory = process_memory(proc.pid) if proc is not None else None
            if memory is None:  # between a stop and the next start
                continue
            peak = self.peaks.setdefault(self.phase, PhasePeak())
            peak.anon = max(peak.anon, memory.rss_anon)
            peak.file = max(peak.file, memory.rss_file)
            if self._count % self.keep_every == 0:
                at = time.monotonic() - self.started
                self.series.append((round(at, 2), self.phase, memory.rss_anon, memory.rss_file))
            self._count += 1

    def now(self) -> tuple[int, int]:
        proc = self.server.proc
        memory = process_memory(proc.pid) if proc is not None else None
        return (memory.rss_anon, memory.rss_file) if memory is not None else (0, 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# ---- workloads --------------------------------------------------------------------------


def big_event(i: int) -> bytes:
    """A 1,000-byte JSON event of group ``i % GROUPS``."""
    head = b'{"i":%d,"g":%d,"user":"user-%d","page":"/items/%d","pad":"' % (
        i,
        i % GROUPS,
        i % 1013,
        i % 97,
    )
    return head + b"z" * (EVENT_BYTES - len(head) - 2) + b'"}'


class BigEvents(Workload):
    """``DISTINCT_BATCHES`` batches of ``BATCH`` events, sent in turn: every batch holds
    BATCH / GROUPS events of each group, so a GROUP BY's answer is known."""

    def __init__(self) -> None:
        self.size = EVENT_BYTES
        self.batch = BATCH
        self.values = [
            [big_event(b * BATCH + k) for k in range(BATCH)] for b in range(DISTINCT_BATCHES)
        ]
        self.hw_batches = [EventBatch.of(values) for values in self.values]


def sql_event(i: int) -> bytes:
    return b'{"kind":"%s","user":%d,"amount":%d,"seq":%d}' % (
        KINDS[i % len(KINDS)].encode(),
        i % 1000,
        i % 100,
        i,
    )


# ---- steps ------------------------------------------------------------------------------


def raw_write(path: Path, nbytes: int, block: bytes) -> float:
    """dd-like: ``nbytes`` written in ``len(block)`` writes, one fdatasync at the end;
    returns the seconds taken."""
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - began
    path.unlink()
    return elapsed


def query(client: KimberliteClient, sql: str) -> list[list[str]]:
    response = client.call(QueryRequest(sql))
    assert isinstance(response, QueryResponse), response
    return [[str(value) for value in row] for row in response.rows]


def caught_up(client: KimberliteClient) -> float:
    """Seconds until a query is answered: a Query waits up to 30 s for the SQL projection
    to cover every acknowledged event, then answers ProjectionLag (retryable) saying how
    far it got; appends faster than the projection is built leave it behind, and this is
    how long it takes to catch up after them."""
    began = time.perf_counter()
    while True:
        try:
            query(client, f"SELECT count(*) FROM {BIG_STREAM}")
        except ProjectionLag as lag:
            log(f"  still catching up after {time.perf_counter() - began:.0f} s: {lag}")
            continue
        return time.perf_counter() - began


def big_group_by(client: KimberliteClient, events: int) -> float:
    began = time.perf_counter()
    rows = query(client, BIG_GROUP_BY)
    elapsed = time.perf_counter() - began
    expected = [[str(g), str(events // GROUPS)] for g in range(GROUPS)]
    if rows != expected:
        raise RuntimeError(f"GROUP BY answered {rows}, expected {expected}")
    return elapsed


def restart(server: HeadwaterServer, root: Path, events: int) -> dict[str, float]:
    """Stop (SIGTERM; its finishing work is timed too), start, time to the ports file and
    to the first answered query."""
    proc = server.proc
    assert proc is not None
    began = time.perf_counter()
    proc.terminate()
    code = proc.wait(timeout=900)
    stop_s = time.perf_counter() - began
    if code != 0:
        raise RuntimeError(f"headwater exited with {code} on SIGTERM:\n{server.log_tail()}")
    (root / "headwater-ports.json").unlink(missing_ok=True)
    began = time.perf_counter()
    server.start(root)
    ports_s = time.perf_counter() - began
    client = KimberliteClient(server.port)
    rows = query(client, f"SELECT count(*) FROM {BIG_STREAM}")
    ready_s = time.perf_counter() - began
    client.close()
    if rows != [[str(events)]]:
        raise RuntimeError(f"after the restart the stream counts {rows}, expected {events}")
    return {"stop_s": stop_s, "ports_file_s": ports_s, "ready_s": ready_s}


def segment_files(data_dir: Path) -> list[Path]:
    # The big stream's segments: everything else in the data dir (projections, indexes,
    # the SQL stream) is not what ReadEvents reads.
    files = [p for p in data_dir.rglob("*.log") if p.is_file()]
    return sorted(files, key=lambda p: (str(p.parent), p.name))


def cold() -> bool:
    if can_drop_caches():
        drop_caches()
        return True
    return False


def bench_size_steps(
    args: argparse.Namespace, root: Path, results: dict[str, Any]
) -> dict[str, Any]:
    server = HeadwaterServer()
    server.start(root)
    sampler = RssSampler(server)
    work = BigEvents()
    steps: list[dict[str, Any]] = []
    events = 0
    try:
        client = KimberliteClient(server.port)
        stream_id = client.create_stream(BIG_STREAM)
        block = b"".join(work.values[0])
        for size in args.sizes_mib:
            target = size * MIB // EVENT_BYTES // BATCH * BATCH
            batches = (target - events) // BATCH
            step_bytes = batches * BATCH * EVENT_BYTES
            load_before = loadavg()
            sampler.phase = f"raw write {size} MiB"
            raw_s = raw_write(root / "raw-write", step_bytes, block)
            log(f"raw write of {step_bytes / MIB:.0f} MiB: {step_bytes / raw_s / 1e6:.0f} MB/s")
            sampler.phase = f"append to {size} MiB"
            cpu_before = (proc_cpu(server.pid), proc_cpu(os.getpid()))
            began = time.perf_counter()
            # One batch per round-trip window; offsets are continuous so big_event(i)'s
            # group is i % GROUPS for every event (each batch holds whole group cycles).
            appended = hw_produce(client, stream_id, work, batches, DEPTH, client_encode=False)
            append_s = time.perf_counter() - began
            server_cpu = proc_cpu(server.pid) - cpu_before[0]
            append_cpu = (server_cpu, proc_cpu(os.getpid()) - cpu_before[1])
            events += appended
            anon_after, file_after = sampler.now()
            log(
                f"appended to {events} events ({events * EVENT_BYTES / MIB:.0f} MiB):"
                f" {step_bytes / append_s / 1e6:.0f} MB/s,"
                f" RssAnon {anon_after / MIB:.0f} MiB"
            )
            sampler.phase = f"GROUP BY at {size} MiB"
            catch_up_s = caught_up(client)
            group_by_s = big_group_by(client, events)
            log(f"GROUP BY over {events} events: {group_by_s:.2f} s ({catch_up_s:.1f} s catch-up)")
            client.close()
            sampler.phase = f"restart at {size} MiB"
            restarted = restart(server, root, events)
            log(f"restart: {restarted}")
            client = KimberliteClient(server.port)
            sampler.phase = f"GROUP BY after restart at {size} MiB"
            group_by_restarted_s = big_group_by(client, events)
            on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            steps.append(
                {
                    "size_mib": size,
                    "events": events,
                    "step_bytes": step_bytes,
                    "append_s": append_s,
                    "projection_catch_up_s": catch_up_s,
                    "append_mb_s": step_bytes / append_s / 1e6,
                    "append_server_cpu_s": append_cpu[0],
                    "append_client_cpu_s": append_cpu[1],
                    "raw_write_s": raw_s,
                    "raw_write_mb_s": step_bytes / raw_s / 1e6,
                    "rss_anon_after_append": anon_after,
                    "rss_file_after_append": file_after,
                    "group_by_s": group_by_s,
                    "group_by_after_restart_s": group_by_restarted_s,
                    "restart": restarted,
                    "on_disk_bytes": on_disk,
                    "loadavg_before": load_before,
                    "loadavg_after": loadavg(),
                }
            )
        results["cold_read"] = bench_cold_read(args, server, client, sampler, stream_id, events)
        client.close()
    finally:
        sampler.close()
        server.stop()
    results["size_steps"] = steps
    results["rss_peaks"] = {
        phase: {"anon": peak.anon, "file": peak.file} for phase, peak in sampler.peaks.items()
    }
    results["rss_series"] = sampler.series
    return results


def bench_cold_read(
    args: argparse.Namespace,
    server: HeadwaterServer,
    client: KimberliteClient,
    sampler: RssSampler,
    stream_id: int,
    events: int,
) -> dict[str, Any]:
    files = segment_files(root_data_dir(server))
    file_bytes = sum(p.stat().st_size for p in files)
    runs: list[dict[str, Any]] = []
    # Cold runs alternate; then one warm run each (the files just read, no drop): a warm
    # ReadEvents no faster than a cold one says the read is bound by CPU, not the disk.
    cold_sides = ("raw", "headwater", "headwater", "raw")[: 4 if args.read_rounds > 1 else 2]
    for side, want_cold in [*((s, True) for s in cold_sides), ("raw", False), ("headwater", False)]:
        dropped = cold() if want_cold else False
        sampler.phase = f"{'cold' if want_cold else 'warm'} read ({side})"
        # CPU seconds of each process over the run: which side a CPU-bound read waits on.
        cpu_before = (proc_cpu(server.pid), proc_cpu(os.getpid()))
        began = time.perf_counter()
        if side == "raw":
            read_raw_files(files)
        else:
            read_all(client, stream_id, events, READ_PAGE)
        elapsed = time.perf_counter() - began
        runs.append(
            {
                "side": side,
                "s": elapsed,
                "mb_s": file_bytes / elapsed / 1e6,
                "cold": dropped,
                "server_cpu_s": proc_cpu(server.pid) - cpu_before[0],
                "client_cpu_s": proc_cpu(os.getpid()) - cpu_before[1],
            }
        )
        log(f"read {side}: {file_bytes / elapsed / 1e6:.0f} MB/s (cache dropped: {dropped})")
    raw = [r["s"] for r in runs[: len(cold_sides)] if r["side"] == "raw"]
    hw = [r["s"] for r in runs[: len(cold_sides)] if r["side"] == "headwater"]
    return {
        "segment_files": len(files),
        "file_bytes": file_bytes,
        "value_bytes": events * EVENT_BYTES,
        "runs": runs,
        "ratio": (sum(raw) / len(raw)) / (sum(hw) / len(hw)),
        "loadavg_after": loadavg(),
    }


def root_data_dir(server: HeadwaterServer) -> Path:
    assert server.log_path is not None
    return server.log_path.parent / "headwater-data"


def bench_sql(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    events = args.sql_events
    server = HeadwaterServer()
    server.start(root)
    try:
        client = KimberliteClient(server.port)
        stream_id = client.create_stream(SQL_STREAM)
        values = [sql_event(i) for i in range(events)]
        began = time.perf_counter()
        sent = done = 0
        conn, sock = client.conn, client.sock
        starts = range(0, events, SQL_BATCH)
        while done < len(starts):
            while sent < len(starts) and sent - done < DEPTH:
                first = starts[sent]
                batch = EventBatch.of(values[first : first + SQL_BATCH])
                sock.sendall(conn.send_request(AppendEventsRequest(stream_id, batch))[1])
                sent += 1
            for response in client.recv():
                if not isinstance(response.payload, AppendEventsResponse):
                    raise RuntimeError(f"append failed: {response.payload!r}")
                done += 1
        append_s = time.perf_counter() - began
        log(f"SQL: appended {events} events in {append_s:.1f} s")

        parquet = root / "events.parquet"
        began = time.perf_counter()
        texts = pa.array([v.decode() for v in values], pa.string())
        table = pa.table(
            {
                "offset": pa.array(range(events), pa.int64()),
                "data": pa.array(values, pa.binary()),
                "json": pa.ExtensionArray.from_storage(pa.json_(pa.string()), texts),
            }
        )
        pq.write_table(table, parquet)
        del table, texts, values
        parquet_s = time.perf_counter() - began
        con = duckdb.connect()
        con.execute(f"CREATE VIEW {SQL_STREAM} AS SELECT * FROM read_parquet('{parquet}')")
        json_type = con.execute(f"SELECT typeof(json) FROM {SQL_STREAM} LIMIT 1").fetchone()

        began = time.perf_counter()
        served = query(client, SQL_GROUP_BY)  # waits for the projection to catch up
        first_query_s = time.perf_counter() - began
        direct = [[str(v) for v in row] for row in con.execute(SQL_GROUP_BY).fetchall()]
        if served != direct:
            raise RuntimeError(f"headwater answered {served}, DuckDB {direct}")
        hw_times: list[float] = []
        duck_times: list[float] = []
        for i in range(args.repeat):
            order = ("hw", "duck") if i % 2 == 0 else ("duck", "hw")
            for side in order:
                began = time.perf_counter()
                if side == "hw":
                    query(client, SQL_GROUP_BY)
                    hw_times.append(time.perf_counter() - began)
                else:
                    con.execute(SQL_GROUP_BY).fetchall()
                    duck_times.append(time.perf_counter() - began)
        con.close()
        client.close()
        log(f"SQL: headwater {min(hw_times):.3f} s, DuckDB over Parquet {min(duck_times):.3f} s")
        return {
            "events": events,
            "sql": SQL_GROUP_BY,
            "append_s": append_s,
            "parquet_write_s": parquet_s,
            "parquet_bytes": parquet.stat().st_size,
            "parquet_json_type": json_type[0] if json_type else "?",
            "first_query_s": first_query_s,
            "headwater_s": hw_times,
            "duckdb_s": duck_times,
            "ratio": min(hw_times) / min(duck_times),
            "loadavg_after": loadavg(),
        }
    finally:
        server.stop()


# ---- report -----------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / MIB:,.0f}"


def goal(ok: bool) -> str:
    return "met" if ok else "**not met**"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        f"{env['cpu']}, {env['cpus']} CPUs, {env['mem_mib']:,} MiB RAM, {env['fstype']} on "
        f"{env['device']}; revision {env['revision']}, duckdb {env['duckdb']}; load average "
        f"{env['loadavg_before']} before, {results.get('loadavg_after')} after.",
        "",
    ]
    if "size_steps" in results:
        lines += [
            "RSS and append throughput versus data size (1,000-byte events, batches of "
            f"{BATCH}, {DEPTH} in flight, default settings):",
            "",
            "| stored | append MB/s | raw write MB/s | ratio | RssAnon after appends | "
            "peak RssAnon appending | peak RssFile | GROUP BY s (first / after restart) | "
            "restart: stop s | ports file s | ready s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        peaks = results["rss_peaks"]
        for step in results["size_steps"]:
            size = step["size_mib"]
            peak = peaks.get(f"append to {size} MiB", {"anon": 0, "file": 0})
            r = step["restart"]
            lines.append(
                f"| {size / 1024:g} GiB | {step['append_mb_s']:.0f} | {step['raw_write_mb_s']:.0f}"
                f" | {step['append_mb_s'] / step['raw_write_mb_s']:.2f}"
                f" | {mib(step['rss_anon_after_append'])} MiB | {mib(peak['anon'])} MiB"
                f" | {mib(peak['file'])} MiB | {step['group_by_s']:.2f}"
                f" / {step['group_by_after_restart_s']:.2f}"
                f" | {r['stop_s']:.1f} | {r['ports_file_s']:.2f} | {r['ready_s']:.2f} |"
            )
        lines += [
            "",
            "The first GROUP BY after the appends waits for the SQL projection to catch up"
            " (read-your-writes); the one after the restart is the query alone.",
            "",
            "Peak RssAnon / RssFile per phase (MiB):",
            "",
        ]
        lines += ["| phase | RssAnon | RssFile |", "|---|---:|---:|"]
        for phase, peak in peaks.items():
            lines.append(f"| {phase} | {mib(peak['anon'])} | {mib(peak['file'])} |")
        lines.append("")
    if "cold_read" in results:
        c = results["cold_read"]
        cold_text = "page cache dropped before each" if c["runs"][0]["cold"] else "WARM (no root)"
        lines += [
            f"Cold read of {c['file_bytes'] / GIB:.2f} GiB ({c['segment_files']} segment files;"
            f" {cold_text}):",
            "",
            "| run | side | cache | MB/s of segment bytes | server CPU s | client CPU s | wall s |",
            "|---:|---|---|---:|---:|---:|---:|",
        ]
        for i, run in enumerate(c["runs"], 1):
            cache = "dropped" if run["cold"] else "warm"
            lines.append(
                f"| {i} | {run['side']} | {cache} | {run['mb_s']:.0f}"
                f" | {run['server_cpu_s']:.1f} | {run['client_cpu_s']:.1f} | {run['s']:.1f} |"
            )
        lines += [
            "",
            f"Cold ReadEvents / cold raw read (mean times): {c['ratio']:.2f} (goal >= 0.8:"
            f" {goal(c['ratio'] >= 0.8)}).",
            "",
        ]
    if "sql" in results:
        s = results["sql"]
        lines += [
            f"SQL GROUP BY over {s['events']:,} events ({s['parquet_bytes'] / MIB:.0f} MiB"
            f" Parquet, json column read as {s['parquet_json_type']}), best of"
            f" {len(s['headwater_s'])}, alternating:",
            "",
            "| headwater Query | DuckDB over Parquet | ratio |",
            "|---:|---:|---:|",
            f"| {min(s['headwater_s']) * 1000:.0f} ms | {min(s['duckdb_s']) * 1000:.0f} ms"
            f" | {s['ratio']:.2f} (goal <= 1.5: {goal(s['ratio'] <= 1.5)}) |",
            "",
            f"(First headwater query after the appends, projection catch-up included:"
            f" {s['first_query_s']:.1f} s; {s['events']:,} appends took {s['append_s']:.1f} s.)",
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--sizes-gib", default="1,4", help="data sizes, comma-separated (GiB)")
    p.add_argument("--sql-events", type=int, default=10_000_000, help="events for the GROUP BY")
    p.add_argument("--repeat", type=int, default=3, help="timed SQL runs per side")
    p.add_argument("--read-rounds", type=int, default=2, help="cold reads per side (1 or 2)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: sizes, sql")
    p.add_argument("--root", type=Path, default=None, help="scratch directory (removed)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    args.sizes_mib = [int(float(s) * 1024) for s in args.sizes_gib.split(",") if s]
    if args.quick:
        args.sizes_mib, args.sql_events, args.repeat = [64, 128], 200_000, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    skip = set(args.skip.split(","))
    root = args.root or default_root("headwater-memory-bench-")
    root.mkdir(parents=True, exist_ok=True)
    mount = mount_of(root)
    results: dict[str, Any] = {
        "environment": {
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "mem_mib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB,
            "device": mount["device"],
            "fstype": mount["fstype"],
            "revision": git_revision(),
            "duckdb": duckdb.__version__,
            "loadavg_before": loadavg(),
            "drop_caches": can_drop_caches(),
        },
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "root")},
    }
    try:
        if "sql" not in skip:
            sql_root = root / "sql"
            sql_root.mkdir()
            results["sql"] = bench_sql(args, sql_root)
            shutil.rmtree(sql_root)
        if "sizes" not in skip:
            sizes_root = root / "sizes"
            sizes_root.mkdir()
            bench_size_steps(args, sizes_root, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["loadavg_after"] = loadavg()
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
