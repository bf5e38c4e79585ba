#!/usr/bin/env python3
"""Storage engine benchmarks, each side by side with a raw-file reference in one run.

What is measured (see docs/benchmarks.md for results and how to read them):

* append: ``Engine.append`` (asyncio, the real group commit) for every sync policy with
  1 writer, 4 writers on 4 streams and 4 writers on one stream, against the physical
  limit: the same encoded batches written to a plain file with ``os.write`` and an
  ``fdatasync`` at the same points (after every batch for ``fsync``, once the interval has
  passed for ``interval:<ms>``, never for ``none``); N writers = N threads, one file each.
* sequential read: a whole log read back through ``PartitionLog.read`` in 4 MiB chunks,
  once as stored values chunks (the wire path) and once through the decoding
  ``events()`` iterator, against ``os.read`` of the same segment files in 4 MiB chunks;
  cold (page cache dropped, when ``/proc/sys/vm/drop_caches`` is writable) and warm.
* recovery: a ~1 GiB log written with policy ``none`` by a child process that is
  SIGKILLed mid-write, then ``PartitionLog.open`` and ``Engine.open`` timed, cold and
  warm, against a raw read of the bytes recovery has to scan.

Run ``python benchmarks/storage_bench.py --help`` for the size flags; ``--quick`` is a
smoke-test size. Results go to stdout as a markdown table and, with ``--out``, to JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    HelpFormatter,
    cpu_model,
    default_root,
    fsync_latency,
    git_revision,
    loadavg,
    log,
    mount_of,
)
from headwater.engine.engine import Engine, EngineConfig, StreamSettings
from headwater.storage.batch import build_batch, encode_values
from headwater.storage.log import LogConfig, PartitionLog, SyncPolicy

MIB = 1 << 20
READ_CHUNK = 4 * MIB
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# ---- environment ------------------------------------------------------------------------


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache (needs root)."""
    os.sync()
    DROP_CACHES.write_text("3\n")


def run_loop(main: Coroutine[Any, Any, Any], loop_kind: str) -> Any:
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


# ---- workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    """Pre-generated event values and the batches they encode to (not timed)."""

    size: int
    batch: int
    values: list[list[bytes]]  # distinct batches of values, cycled
    encoded: list[bytes]  # values sections (u64 len | bytes per event)
    raw_batches: list[bytes]  # whole stored batches: what the raw writers write

    @classmethod
    def make(cls, size: int, batch: int, distinct: int) -> Workload:
        values = [[os.urandom(size) for _ in range(batch)] for _ in range(distinct)]
        encoded = [encode_values(v) for v in values]
        raw = [
            build_batch(e, batch, base_offset=0, first_position=0, timestamp_ms=0) for e in encoded
        ]
        return cls(size, batch, values, encoded, raw)

    @property
    def batch_bytes(self) -> int:
        return len(self.raw_batches[0])


@dataclass
class Measurement:
    seconds: float
    events: int
    stored_bytes: int  # bytes of stored batches (what reaches the file)
    payload_bytes: int  # event value bytes
    cpu_seconds: float
    fsyncs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.stored_bytes / self.seconds / 1e6

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["events_per_s"] = self.events_per_s
        d["mb_per_s"] = self.mb_per_s
        d["payload_mb_per_s"] = self.payload_bytes / self.seconds / 1e6
        d["cpu_utilisation"] = self.cpu_seconds / self.seconds
        return d


def split(total: int, parts: int) -> list[int]:
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# ---- append: engine ---------------------------------------------------------------------


def engine_append(
    directory: Path,
    policy: str,
    writers: int,
    shared_stream: bool,
    batches: int,
    work: Workload,
    loop_kind: str,
    encoded: bool,
    yield_between: bool,
) -> Measurement:
    """``batches`` appends of ``work.batch`` events spread over ``writers`` asyncio tasks.

    With ``yield_between`` each writer gives the loop a turn after every append, as a
    connection handler waiting on its socket would; without it, appends that need no
    fsync never suspend, so writers run one after another and nothing else on the loop
    (such as the ``interval`` syncer) runs until they finish."""

    async def main() -> Measurement:
        config = EngineConfig(sync=SyncPolicy.parse(policy), maintenance_interval_ms=0)
        engine = await Engine.open(directory, config)
        n_streams = 1 if shared_stream else writers
        ids = [(await engine.create_stream(0, f"bench_{i}")).stream_id for i in range(n_streams)]
        distinct = len(work.values)
        count = work.batch

        async def writer(w: int, n: int) -> None:
            sid = ids[0] if shared_stream else ids[w]
            if encoded:
                sections = work.encoded
                for i in range(n):
                    await engine.append_encoded(0, sid, sections[(w + i) % distinct], count)
                    if yield_between:
                        await asyncio.sleep(0)
            else:
                values = work.values
                for i in range(n):
                    await engine.append(0, sid, values[(w + i) % distinct])
                    if yield_between:
                        await asyncio.sleep(0)

        shares = split(batches, writers)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(writer(w, n) for w, n in enumerate(shares)))
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        streams = [engine.stream(0, sid) for sid in ids]
        fsyncs = sum(s.committer.fsyncs for s in streams)
        fsync_s = sum(s.committer.fsync_seconds_total for s in streams)
        stored = sum(s.log.size_bytes for s in streams)
        await engine.close()
        events = batches * count
        return Measurement(
            seconds,
            events,
            stored,
            events * work.size,
            cpu,
            fsyncs,
            {"fsync_seconds_total": fsync_s},
        )

    result: Measurement = run_loop(main(), loop_kind)
    return result


def log_append(directory: Path, policy: str, batches: int, work: Workload) -> Measurement:
    """The storage layer without asyncio: ``PartitionLog.append_encoded`` on this thread,
    then ``sync()`` where the policy puts an fsync (after every batch for ``fsync``, once
    ``interval_ms`` has passed for ``interval``). Separates the log's own cost from the
    engine's (the event loop and the worker-thread hop of the group commit)."""
    sync = SyncPolicy.parse(policy)
    plog = PartitionLog.open(directory / "log", LogConfig(sync=sync))
    sections = work.encoded
    fsyncs = 0
    last_sync = time.perf_counter()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for i in range(batches):
        plog.append_encoded(sections[i % len(sections)], work.batch, first_position=0)
        if sync.kind == "fsync" or (
            sync.kind == "interval" and time.perf_counter() - last_sync >= sync.interval_ms / 1000
        ):
            plog.sync()
            fsyncs += 1
            last_sync = time.perf_counter()
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    stored = plog.size_bytes
    plog.close()
    events = batches * work.batch
    return Measurement(seconds, events, stored, events * work.size, cpu, fsyncs, {})


# ---- append: raw reference --------------------------------------------------------------


def raw_append(
    directory: Path, policy: str, writers: int, batches: int, work: Workload, one_file: bool
) -> Measurement:
    """The same batches written with os.write by ``writers`` threads (one file each, or
    all appending to one file), with fdatasync at the points the policy implies: after
    every batch for ``fsync``; every ``interval_ms`` from a background thread (as the
    engine does) for ``interval``; never for ``none``."""
    sync = SyncPolicy.parse(policy)
    shares = split(batches, writers)
    raw = work.raw_batches
    distinct = len(raw)
    fsyncs = [0] * (writers + 1)  # the last slot counts the interval syncer
    written = [0] * writers
    errors: list[BaseException] = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    if one_file:
        shared_fd = os.open(directory / "raw-shared.log", flags, 0o644)
        fds = [shared_fd] * writers
    else:
        fds = [os.open(directory / f"raw-{w}.log", flags, 0o644) for w in range(writers)]
    start = threading.Barrier(writers + 1)
    stop = threading.Event()

    def body(w: int) -> None:
        fd, n = fds[w], shares[w]
        write, fdatasync = os.write, os.fdatasync
        every_batch = sync.kind == "fsync"
        total = syncs = 0
        try:
            start.wait()
            for i in range(n):
                total += write(fd, raw[(w + i) % distinct])
                if every_batch:
                    fdatasync(fd)
                    syncs += 1
        except BaseException as exc:  # reported by the caller
            errors.append(exc)
        written[w] = total
        fsyncs[w] = syncs

    def syncer() -> None:
        distinct_fds = sorted(set(fds))
        try:
            while not stop.wait(sync.interval_ms / 1000):
                for fd in distinct_fds:
                    os.fdatasync(fd)
                    fsyncs[-1] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(w,)) for w in range(writers)]
    background = threading.Thread(target=syncer) if sync.kind == "interval" else None
    for t in threads:
        t.start()
    cpu0 = time.process_time()
    start.wait()
    t0 = time.perf_counter()
    if background is not None:
        background.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    stop.set()
    if background is not None:
        background.join()
    for fd in set(fds):
        os.close(fd)
    if errors:
        raise errors[0]
    events = batches * work.batch
    return Measurement(seconds, events, sum(written), events * work.size, cpu, sum(fsyncs))


# ---- append: the matrix -----------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    writers: int
    shared_stream: bool
    encoded: bool
    direct: bool = False  # the storage layer alone: PartitionLog on the caller's thread


def variants(writer_counts: list[int], with_encoded: bool) -> list[Variant]:
    out: list[Variant] = []
    for w in writer_counts:
        if w == 1:
            out.append(Variant("1w", "1 writer", 1, False, False))
            if with_encoded:
                out.append(Variant("1w-enc", "1 writer, append_encoded", 1, False, True))
                out.append(Variant("1w-log", "1 writer, PartitionLog direct", 1, False, True, True))
        else:
            out.append(Variant(f"{w}w-{w}s", f"{w} writers, {w} streams", w, False, False))
            out.append(Variant(f"{w}w-1s", f"{w} writers, 1 stream", w, True, False))
    return out


def bench_appends(args: argparse.Namespace, root: Path, work: Workload) -> list[dict[str, Any]]:
    batches = max(1, args.events // args.batch)
    rows: list[dict[str, Any]] = []
    for policy in args.policies:
        for var in variants(args.writers, args.encoded):
            engine_runs: list[Measurement] = []
            raw_runs: list[Measurement] = []
            raw_one_file: list[Measurement] = []
            for _ in range(args.repeat):
                # Interleave engine and raw so drifting machine load hits both alike.
                d = fresh_dir(root, "append")
                os.sync()
                if var.direct:
                    engine_runs.append(log_append(d, policy, batches, work))
                else:
                    engine_runs.append(
                        engine_append(
                            d,
                            policy,
                            var.writers,
                            var.shared_stream,
                            batches,
                            work,
                            args.loop,
                            var.encoded,
                            args.yield_between,
                        )
                    )
                d = fresh_dir(root, "append")
                os.sync()
                raw_runs.append(raw_append(d, policy, var.writers, batches, work, False))
                if var.shared_stream:
                    d = fresh_dir(root, "append")
                    os.sync()
                    raw_one_file.append(raw_append(d, policy, var.writers, batches, work, True))
                shutil.rmtree(d, ignore_errors=True)
            eng = median_run(engine_runs)
            ref = median_run(raw_runs)
            row = {
                "policy": policy,
                "variant": var.key,
                "label": var.label,
                "writers": var.writers,
                "engine": eng.as_dict(),
                "raw": ref.as_dict(),
                "ratio": eng.events_per_s / ref.events_per_s,
                "ratios_each_repeat": [
                    e.events_per_s / r.events_per_s
                    for e, r in zip(engine_runs, raw_runs, strict=True)
                ],
            }
            if raw_one_file:
                one = median_run(raw_one_file)
                row["raw_one_file"] = one.as_dict()
                row["ratio_vs_one_file"] = eng.events_per_s / one.events_per_s
            rows.append(row)
            log(
                f"append {policy:<12} {var.label:<26} engine {eng.events_per_s:>12,.0f} ev/s "
                f"{eng.mb_per_s:7.1f} MB/s | raw {ref.events_per_s:>12,.0f} ev/s "
                f"{ref.mb_per_s:7.1f} MB/s | ratio {row['ratio']:.2f}"
            )
    return rows


def median_run(runs: list[Measurement]) -> Measurement:
    """The run with the median time (odd counts) or the faster of the middle two."""
    ordered = sorted(runs, key=lambda m: m.seconds)
    return ordered[(len(ordered) - 1) // 2]


# ---- sequential read --------------------------------------------------------------------


def read_raw_files(paths: list[Path]) -> tuple[int, int]:
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, READ_CHUNK):
                total += len(chunk)
        finally:
            os.close(fd)
    return total, 0


def read_raw_files_into(paths: list[Path]) -> tuple[int, int]:
    """Like read_raw_files, into one reused buffer (no 4 MiB allocation per read)."""
    total = 0
    buf = bytearray(READ_CHUNK)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total, 0


def read_values_chunks(plog: PartitionLog) -> tuple[int, int]:
    """The wire path: stored values chunks, never decoded per event."""
    offset, events, nbytes = plog.start_offset, 0, 0
    while True:
        result = plog.read(offset, READ_CHUNK)
        if result.count == 0:
            break
        for chunk in result.values_chunks():
            nbytes += len(chunk)
        events += result.count
        if result.next_offset is None:
            break
        offset = result.next_offset
    return nbytes, events


def read_events(plog: PartitionLog) -> tuple[int, int]:
    """Through the decoding ``ReadResult.events()`` iterator."""
    offset, events, nbytes = plog.start_offset, 0, 0
    while True:
        result = plog.read(offset, READ_CHUNK)
        if result.count == 0:
            break
        for event in result.events():
            nbytes += len(event.value)
            events += 1
        if result.next_offset is None:
            break
        offset = result.next_offset
    return nbytes, events


def build_log(
    directory: Path, events: int, work: Workload, loop_kind: str, segment_bytes: int
) -> Path:
    """Write ``events`` with policy none through the engine; returns the partition dir."""

    async def main() -> Path:
        config = EngineConfig(
            sync=SyncPolicy.parse("none"), maintenance_interval_ms=0, segment_bytes=segment_bytes
        )
        engine = await Engine.open(directory, config)
        sid = (await engine.create_stream(0, "bench")).stream_id
        for i in range(max(1, events // work.batch)):
            await engine.append_encoded(0, sid, work.encoded[i % len(work.encoded)], work.batch)
        path = engine.stream(0, sid).log.directory
        await engine.close()
        return path

    result: Path = run_loop(main(), loop_kind)
    return result


def bench_reads(args: argparse.Namespace, root: Path, work: Workload) -> dict[str, Any]:
    directory = fresh_dir(root, "read")
    part = build_log(directory, args.read_events, work, args.loop, args.segment_mib * MIB)
    os.sync()
    plog = PartitionLog.open(part, LogConfig(segment_bytes=args.segment_mib * MIB))
    files = [seg.log_path for seg in plog.segments]
    stored = sum(p.stat().st_size for p in files)
    n_events = plog.end_offset - plog.start_offset
    cold = can_drop_caches() and not args.no_drop_caches

    def timed(fn: Callable[[], tuple[int, int]], drop: bool) -> dict[str, float]:
        if drop:
            drop_caches()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        return {
            "seconds": seconds,
            "mb_per_s": stored / seconds / 1e6,
            "events_per_s": n_events / seconds,
            "cpu_seconds": cpu,
        }

    paths: dict[str, Callable[[], tuple[int, int]]] = {
        "raw": lambda: read_raw_files(files),
        "raw_into": lambda: read_raw_files_into(files),
        "values_chunks": lambda: read_values_chunks(plog),
        "events": lambda: read_events(plog),
    }
    # Sanity: the wire path and the decoder see every event.
    _, seen = read_values_chunks(plog)
    if seen != n_events:
        raise RuntimeError(f"read {seen} events, log holds {n_events}")
    out: dict[str, Any] = {"stored_bytes": stored, "events": n_events, "segments": len(files)}
    modes = (["cold"] if cold else []) + ["warm"]
    for mode in modes:
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in paths}
        for _ in range(args.repeat):
            for name, fn in paths.items():
                if mode == "warm" and not runs[name]:
                    fn()  # an untimed pass fills the cache
                runs[name].append(timed(fn, drop=mode == "cold"))
        res: dict[str, Any] = {}
        for name, rs in runs.items():
            res[name] = sorted(rs, key=lambda r: r["seconds"])[(len(rs) - 1) // 2]
        for name in ("raw", "raw_into", "values_chunks", "events"):
            res[name]["ratio"] = res["raw"]["seconds"] / res[name]["seconds"]
            res[name]["ratio_vs_raw_into"] = res["raw_into"]["seconds"] / res[name]["seconds"]
        out[mode] = res
        log(
            f"read {mode:<5} raw {res['raw']['mb_per_s']:8.1f} MB/s | raw_into "
            f"{res['raw_into']['mb_per_s']:8.1f} MB/s | values_chunks "
            f"{res['values_chunks']['mb_per_s']:8.1f} MB/s ({res['values_chunks']['ratio']:.2f})"
            f" | events {res['events']['mb_per_s']:8.1f} MB/s ({res['events']['ratio']:.2f})"
        )
    out["cache"] = "cold and warm" if cold else "warm only (page cache could not be dropped)"
    plog.close()
    shutil.rmtree(directory, ignore_errors=True)
    return out


# ---- recovery ---------------------------------------------------------------------------


def recovery_child(args: argparse.Namespace) -> int:
    """Child mode: append with policy none until the log holds the target size, say so
    on stdout, and keep appending until killed."""
    work = Workload.make(args.size, args.batch, args.distinct)
    target = int(args.recovery_gib * (1 << 30))

    async def main() -> None:
        config = EngineConfig(
            sync=SyncPolicy.parse("none"),
            maintenance_interval_ms=0,
            segment_bytes=args.recovery_child_segment,
        )
        engine = await Engine.open(args.recovery_child, config)
        settings = StreamSettings()
        sid = (await engine.create_stream(0, "bench", settings)).stream_id
        plog = engine.stream(0, sid).log
        # Kill with the tail segment well filled: recovery scans the whole tail.
        tail_target = min(int(0.75 * args.recovery_child_segment), target)
        told = False
        i = 0
        deadline = None
        batch_bytes = work.batch_bytes
        while True:
            if told and plog.active.size + batch_bytes > args.recovery_child_segment:
                # The kill is late: rather than roll to an empty tail, wait for it idle.
                time.sleep(0.001)
            else:
                section = work.encoded[i % len(work.encoded)]
                await engine.append_encoded(0, sid, section, work.batch)
                i += 1
            if not told and plog.size_bytes >= target and plog.active.size >= tail_target:
                print(f"READY {plog.size_bytes}", flush=True)
                told = True
                deadline = time.monotonic() + 30
            if deadline is not None and time.monotonic() > deadline:
                os._exit(3)  # the parent should have killed us long ago

    run_loop(main(), args.loop)
    return 0


def bench_recovery_one(
    args: argparse.Namespace, root: Path, segment_bytes: int
) -> dict[str, Any] | None:
    directory = fresh_dir(root, "recovery")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--recovery-child",
        str(directory),
        "--recovery-child-segment",
        str(segment_bytes),
        "--recovery-gib",
        str(args.recovery_gib),
        "--size",
        str(args.size),
        "--batch",
        str(args.batch),
        "--distinct",
        str(args.distinct),
        "--loop",
        args.loop,
    ]
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line.startswith("READY"):
        child.kill()
        child.wait()
        log(f"recovery: child did not get ready: {line!r}")
        return None
    # No pause: the child is still appending, so the kill lands mid-write, before the
    # tail (>= 3/4 full) can roll over.
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    build_s = time.perf_counter() - t0
    part = directory / "tenants" / "0" / "streams" / "1" / "partition-0"
    logs = sorted(part.glob("*.log"))
    total = sum(p.stat().st_size for p in logs)
    tail = logs[-1]
    tail_before = tail.stat().st_size
    cold = can_drop_caches() and not args.no_drop_caches
    config = LogConfig(segment_bytes=segment_bytes)
    res: dict[str, Any] = {
        "segment_bytes": segment_bytes,
        "log_bytes": total,
        "segments": len(logs),
        "tail_segment_bytes": tail_before,
        "killed_by": "SIGKILL",
        "child_returncode": child.returncode,
        "build_seconds": build_s,
        "cache": "cold and warm" if cold else "warm only",
    }

    def time_plog_open(drop: bool) -> float:
        if drop:
            drop_caches()
        t = time.perf_counter()
        plog = PartitionLog.open(part, config)
        seconds = time.perf_counter() - t
        plog.close()
        return seconds

    def time_engine_open(drop: bool) -> float:
        async def main() -> float:
            t = time.perf_counter()
            engine = await Engine.open(
                directory,
                EngineConfig(
                    sync=SyncPolicy.parse("none"),
                    maintenance_interval_ms=0,
                    segment_bytes=segment_bytes,
                ),
            )
            seconds = time.perf_counter() - t
            await engine.close()
            return seconds

        if drop:
            drop_caches()
        seconds: float = run_loop(main(), args.loop)
        return seconds

    def time_raw(paths: list[Path], drop: bool) -> float:
        if drop:
            drop_caches()
        t = time.perf_counter()
        read_raw_files(paths)
        return time.perf_counter() - t

    if not cold:
        os.sync()
    # The first open sees the crashed state (and truncates any torn tail).
    first = time_plog_open(cold)
    res["tail_segment_bytes_after"] = tail.stat().st_size
    res["torn_bytes_truncated"] = tail_before - res["tail_segment_bytes_after"]
    modes = (["cold"] if cold else []) + ["warm"]
    for mode in modes:
        drop = mode == "cold"
        if mode == "warm":
            time_plog_open(False)  # fill the cache
        plog_s = [first] if (mode == modes[0]) else []
        while len(plog_s) < args.repeat:
            plog_s.append(time_plog_open(drop))
        engine_s = [time_engine_open(drop) for _ in range(args.repeat)]
        raw_tail_s = [time_raw([tail], drop) for _ in range(args.repeat)]
        raw_all_s = [time_raw(logs, drop) for _ in range(args.repeat)]
        p, e, rt, ra = (statistics.median(x) for x in (plog_s, engine_s, raw_tail_s, raw_all_s))
        scanned = res["tail_segment_bytes_after"]
        r: dict[str, Any] = {
            "partition_log_open_s": p,
            "engine_open_s": e,
            "raw_read_tail_s": rt,
            "raw_read_all_s": ra,
            "log_gb_per_s": total / p / 1e9,
            "engine_log_gb_per_s": total / e / 1e9,
            "tail_gb_per_s": scanned / p / 1e9,
            "raw_tail_gb_per_s": scanned / rt / 1e9,
            "ratio_raw_tail_vs_open": rt / p,
            "runs": {
                "partition_log_open": plog_s,
                "engine_open": engine_s,
                "raw_tail": raw_tail_s,
                "raw_all": raw_all_s,
            },
        }
        if mode == modes[0]:
            r["first_open_after_kill_s"] = first
        res[mode] = r
        log(
            f"recovery {mode:<5} segments {segment_bytes // MIB} MiB, log {total / 1e9:.2f} GB, "
            f"tail {scanned / 1e6:.0f} MB: PartitionLog.open {p:.3f}s "
            f"({total / p / 1e9:.2f} GB/s of log), Engine.open {e:.3f}s, "
            f"raw read of tail {rt:.3f}s, of whole log {ra:.3f}s"
        )
    shutil.rmtree(directory, ignore_errors=True)
    return res


# ---- report -----------------------------------------------------------------------------


def fmt_int(x: float) -> str:
    return f"{x:,.0f}"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    cfg = results["config"]
    lines = [
        f"Machine: {env['nproc']} CPUs ({env['cpu']}), {env['fs']['fstype']} on "
        f"{env['fs']['device']}; fdatasync p50 {env['fsync']['4k_p50_ms']:.2f} ms after "
        f"4 KiB, {env['fsync']['batch_p50_ms']:.2f} ms after one "
        f"{env['batch_bytes'] / 1e3:.0f} kB batch (p99 {env['fsync']['batch_p99_ms']:.2f} ms); "
        f"load average before/after {env['loadavg_before']} / {env.get('loadavg_after')}; "
        f"loop {cfg['loop']}; {cfg['events']:,} events of {cfg['size']} B in batches of "
        f"{cfg['batch']:,} per cell, median of {cfg['repeat']}; writers "
        f"{'yield to the loop' if cfg['yield_between'] else 'do not yield'} between appends.",
        "",
    ]
    if results.get("append"):
        lines += [
            "| policy | writers | engine events/s | engine MB/s | raw events/s | raw MB/s "
            "| engine/raw | engine fsyncs | raw fsyncs |",
            "|---|---|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for row in results["append"]:
            e, r = row["engine"], row["raw"]
            lines.append(
                f"| {row['policy']} | {row['label']} | {fmt_int(e['events_per_s'])} "
                f"| {e['mb_per_s']:.1f} | {fmt_int(r['events_per_s'])} | {r['mb_per_s']:.1f} "
                f"| **{row['ratio']:.2f}** | {e['fsyncs']:,} | {r['fsyncs']:,} |"
            )
        lines.append("")
    reads = results.get("read")
    if reads:
        lines += [
            f"Sequential read of {reads['stored_bytes'] / 1e6:.0f} MB "
            f"({reads['events']:,} events, {reads['segments']} segment(s)), 4 MiB chunks:",
            "",
            "| cache | path | MB/s | events/s | vs raw os.read | vs raw readv into buffer |",
            "|---|---|--:|--:|--:|--:|",
        ]
        for mode in ("cold", "warm"):
            if mode not in reads:
                continue
            res = reads[mode]
            for name, label in (
                ("raw", "raw os.read"),
                ("raw_into", "raw os.readv into one buffer"),
                ("values_chunks", "PartitionLog.read → values_chunks()"),
                ("events", "PartitionLog.read → events()"),
            ):
                ratio = res[name].get("ratio", 1.0)
                ratio_into = res[name].get("ratio_vs_raw_into", 1.0)
                lines.append(
                    f"| {mode} | {label} | {res[name]['mb_per_s']:.1f} "
                    f"| {fmt_int(res[name]['events_per_s'])} | **{ratio:.2f}** "
                    f"| **{ratio_into:.2f}** |"
                )
        lines.append("")
    if results.get("recovery"):
        lines += [
            "Recovery after SIGKILL during writes (policy none):",
            "",
            "| segment size | log | tail | torn bytes cut | cache | first open after kill "
            "| PartitionLog.open | Engine.open | log GB/s | raw read: tail | raw read: whole log "
            "| raw tail read / open |",
            "|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for rec in results["recovery"]:
            for mode in ("cold", "warm"):
                if mode not in rec:
                    continue
                r = rec[mode]
                first = r.get("first_open_after_kill_s")
                first_text = f"{first:.3f} s" if first is not None else "-"
                lines.append(
                    f"| {rec['segment_bytes'] // MIB} MiB | {rec['log_bytes'] / (1 << 30):.2f} GiB "
                    f"| {rec['tail_segment_bytes_after'] / 1e6:.0f} MB "
                    f"| {rec['torn_bytes_truncated']:,} | {mode} "
                    f"| {first_text} "
                    f"| {r['partition_log_open_s']:.3f} s | {r['engine_open_s']:.3f} s "
                    f"| {r['log_gb_per_s']:.2f} | {r['raw_read_tail_s']:.3f} s "
                    f"| {r['raw_read_all_s']:.3f} s | **{r['ratio_raw_tail_vs_open']:.2f}** |"
                )
        lines.append("")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--events", type=int, default=2_000_000, help="events per append cell")
    p.add_argument("--batch", type=int, default=1000, help="events per append (batch)")
    p.add_argument("--size", type=int, default=100, help="bytes per event value")
    p.add_argument("--writers", default="1,4", help="comma-separated writer counts")
    p.add_argument(
        "--policies", default="fsync,interval:5,none", help="comma-separated sync policies"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is kept")
    p.add_argument(
        "--no-encoded",
        dest="encoded",
        action="store_false",
        help="skip the single-writer Engine.append_encoded rows",
    )
    p.add_argument(
        "--no-yield",
        dest="yield_between",
        action="store_false",
        help="writers do not give the loop a turn between appends (see engine_append)",
    )
    p.add_argument(
        "--read-events", type=int, default=None, help="events in the read log (default: --events)"
    )
    p.add_argument(
        "--recovery-gib", type=float, default=1.0, help="log size for the recovery test (GiB)"
    )
    p.add_argument(
        "--recovery-segment-mib",
        default="128,2048",
        help="segment sizes for the recovery test, comma-separated (MiB, at most 2048); "
        "2048 puts the whole log in the one segment recovery scans",
    )
    p.add_argument("--segment-mib", type=int, default=128, help="segment size for the read log")
    p.add_argument("--distinct", type=int, default=16, help="distinct pre-generated batches")
    p.add_argument(
        "--only",
        default="append,read,recovery",
        help="comma-separated subset of append, read, recovery",
    )
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (disk under test)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument("--no-drop-caches", action="store_true", help="warm-cache reads only")
    p.add_argument("--fsync-probes", type=int, default=200, help="fdatasync latency samples")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--recovery-child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--recovery-child-segment", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.events, args.repeat, args.recovery_gib = 50_000, 1, 0.05
        args.recovery_segment_mib, args.fsync_probes = "16", 50
    args.writers = [int(x) for x in str(args.writers).split(",") if x]
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    for policy in args.policies:
        SyncPolicy.parse(policy)  # fail early on a typo
    args.recovery_segment_mib = [int(x) for x in str(args.recovery_segment_mib).split(",") if x]
    args.only = set(args.only.split(","))
    if args.read_events is None:
        args.read_events = args.events
    if args.events < args.batch:
        p.error("--events must be at least --batch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recovery_child is not None:
        return recovery_child(args)
    root = args.dir.resolve() if args.dir else default_root()
    root.mkdir(parents=True, exist_ok=True)
    fs = mount_of(root)
    if fs["fstype"] in ("tmpfs", "ramfs"):
        log(f"{root} is on {fs['fstype']}: fsync costs nothing there; pass --dir on a disk")
        return 2
    work = Workload.make(args.size, args.batch, args.distinct)
    started = time.time()
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "config": {
            k: (sorted(v) if isinstance(v, set) else v)
            for k, v in vars(args).items()
            if k not in ("dir", "out", "recovery_child", "recovery_child_segment")
        },
        "environment": {
            "nproc": os.cpu_count(),
            "cpu": cpu_model(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "git": git_revision(),
            "dir": str(root),
            "fs": fs,
            "batch_bytes": work.batch_bytes,
            "drop_caches": can_drop_caches() and not args.no_drop_caches,
            "loadavg_before": loadavg(),
        },
    }
    log(f"scratch dir {root} ({fs['fstype']} on {fs['device']}), batch {work.batch_bytes} B")
    try:
        results["environment"]["fsync"] = fsync_latency(root, args.fsync_probes, work.batch_bytes)
        log(f"fdatasync latency: {results['environment']['fsync']}")
        if "append" in args.only:
            results["append"] = bench_appends(args, root, work)
        if "read" in args.only:
            results["read"] = bench_reads(args, root, work)
        if "recovery" in args.only:
            results["recovery"] = [
                r
                for mib in args.recovery_segment_mib
                if (r := bench_recovery_one(args, root, mib * MIB)) is not None
            ]
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    results["environment"]["loadavg_after"] = loadavg()
    results["seconds_total"] = time.time() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {args.out}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
