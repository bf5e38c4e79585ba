#!/usr/bin/env python3
"""Entity kinds: ConvergeDB BATCH asserts with 10 live subscribers, against Redis HSETs
pipelined with a PUBLISH of the same update to 10 subscribers, side by side in one run.

Every client is its own process (one writer, ``--subscribers`` readers) speaking the real
protocol over loopback: headwater's sans-I/O ConvergeDB codec on one side, RESP built by
``benchlib`` on the other. No redis-py.

* The update: a 32-byte entity id and 5 numeric fields (u64 ``batch``: the index of the
  frame that carried it, f64 ``bid``, ``ask``, ``last``, i64 ``volume``) over ``--keys``
  entities. headwater: ``--batch`` ASSERTs per BATCH frame, each ACKed once durable
  (policy ``fsync``: fdatasync before the ACK), at most ``--depth`` frames in flight.
  Each ACK waits for its 20 ms window and the fdatasync, so a writer is held to about
  ``depth * batch`` updates per window: 4 frames of 1,000 cap it near 170k/s whatever
  the server does, hence 16 by default (the entities SDK keeps up to 1,024). A writer
  that never waits at all fills windows faster than 10 subscribers on two cores drain
  them, and the 4,096-notification buffer then disconnects them. Redis (``appendfsync
  everysec``: an acknowledged write may still be lost for up to a second): per update
  ``HSET id batch .. volume ..`` plus ``PUBLISH kinds <id + the same 40 bytes of
  field_data>``, ``--batch`` updates pipelined per write, ``--depth`` pipelines in
  flight. Redis keyspace notifications would carry only the key name, so a subscriber
  would need a read per update to learn the values a ConvergeDB STATE carries: PUBLISH
  of the update is the closest equivalent.
* Subscribers: ConvergeDB SUBSCRIBE (no bootstrap): STATE per entity per 20 ms window
  (net change; an entity asserted twice in one window is notified once). Redis SUBSCRIBE:
  every published update.
* Throughput: the writer sends ``--updates`` updates as fast as the socket takes them,
  then a last update of an end-marker entity. ``durable``: until the last ACK (Redis:
  until every reply is read). ``delivered``: until the last subscriber has
  received the end marker.
* Latency: the writer notes the time it sends each frame (each pipeline); a subscriber
  notes when each recv() returned, and after the run decodes what it got with the codec:
  latency = arrival of the chunk completing a notification - send time of the frame that
  carried its update (CLOCK_MONOTONIC, shared by the processes). Measured twice: under
  the full load of the throughput run, and at a paced ``--latency-rate``.

Runs alternate between the sides (which goes first alternates too); the median run is
reported. Every number was taken with all 12 processes on this machine's cores.

    .venv/bin/python benchmarks/kinds_bench.py
    .venv/bin/python benchmarks/run_all.py --bench kinds_bench
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from array import array
from pathlib import Path
from queue import Empty
from typing import Any

from benchlib import (
    RECV,
    HeadwaterServer,
    HelpFormatter,
    RedisServer,
    RespClient,
    RespError,
    connect,
    cpu_model,
    default_root,
    fsync_latency,
    git_revision,
    loadavg,
    log,
    parse_reply,
    pct,
    proc_cpu,
    resp_command,
    settle,
)
from headwater.protocols.convergedb import messages as m
from headwater.protocols.convergedb.codes import Opcode
from headwater.protocols.convergedb.connection import ClientConnection
from headwater.protocols.convergedb.fields import FieldSpec, FieldType, encode_fields
from headwater.protocols.convergedb.frames import FrameDecoder

KIND = "bench_quotes"
FIELDS = (
    FieldSpec("batch", FieldType.U64),
    FieldSpec("bid", FieldType.F64),
    FieldSpec("ask", FieldType.F64),
    FieldSpec("last", FieldType.F64),
    FieldSpec("volume", FieldType.I64),
)
CHANNEL = b"kinds"
WRITER_SOURCE = 1
_BATCH_FIELD = struct.Struct("<Q")  # field 0 of a record: the frame index
_REDIS_FIELDS = [f.name.encode() for f in FIELDS]


def entity_ids(keys: int) -> list[bytes]:
    return [hashlib.blake2b(b"%d" % i, digest_size=32).digest() for i in range(keys)]


def end_marker(run: int) -> bytes:
    return b"end-of-run-%d" % run + bytes(32 - len(b"end-of-run-%d" % run))


def values_of(n: int, batch: int, run: int) -> list[int | float]:
    return [batch, 100.0 + n % 97 + run, 100.5 + n % 89, 100.25 + n % 83, n * 7 + run]


# ---- the work, encoded before any clock starts -----------------------------------------


def plan(
    updates: int, batch: int, ids: list[bytes], run: int
) -> list[list[tuple[bytes, list[Any]]]]:
    """``updates`` updates as frames of ``batch``, then the end marker as its own frame."""
    frames = []
    for start in range(0, updates, batch):
        index = len(frames)
        frames.append(
            [
                (ids[n % len(ids)], values_of(n, index, run))
                for n in range(start, min(updates, start + batch))
            ]
        )
    frames.append([(end_marker(run), values_of(updates, len(frames), run))])
    return frames


def hw_frames(
    conn: ClientConnection, kind_id: int, work: list[list[tuple[bytes, list[Any]]]]
) -> list[bytes]:
    return [
        conn.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind_id, eid, values) for eid, values in frame))
        )[1]
        for frame in work
    ]


def redis_frames(work: list[list[tuple[bytes, list[Any]]]]) -> list[bytes]:
    out = []
    for frame in work:
        parts = []
        for eid, values in frame:
            args: list[bytes] = [b"HSET", eid]
            for name, value in zip(_REDIS_FIELDS, values, strict=True):
                args += [name, repr(value).encode()]
            parts.append(resp_command(*args))
            parts.append(resp_command(b"PUBLISH", CHANNEL, eid + encode_fields(FIELDS, values)))
        out.append(b"".join(parts))
    return out


# ---- headwater clients ------------------------------------------------------------------


class CdbSession:
    """A blocking ConvergeDB connection for setup: request, then wait for its answer."""

    def __init__(
        self, port: int, *, read_only: bool = False, name: str = "", source_id: int | None = None
    ) -> None:
        self.sock = connect(port)
        self.conn = ClientConnection()
        self.frames: list[m.Frame] = []
        # The writer of every run takes over the same slot, with a deadline past the
        # benchmark: its entities stay (a new slot would see the old one's retracted,
        # a mass DELETE, in the middle of a later run).
        stream, data = self.conn.connect(
            name,
            read_only=read_only,
            source_id=source_id,
            liveness_deadline_ms=3_600_000 if source_id is not None else 0,
        )
        self.sock.sendall(data)
        self.wait(stream)

    def wait(self, stream: int) -> m.Message:
        while True:
            for i, frame in enumerate(self.frames):
                if frame.stream_id == stream:
                    message = self.frames.pop(i).message
                    if isinstance(message, m.ErrorMessage):
                        raise RuntimeError(f"headwater answered {message}")
                    return message
            data = self.sock.recv(RECV)
            if not data:
                raise ConnectionError("headwater closed the connection")
            self.frames += self.conn.receive_data(data)

    def call(self, message: m.ClientMessage) -> m.Message:
        stream, data = self.conn.send(message, ack=True)
        self.sock.sendall(data)
        return self.wait(stream)

    def kind(self, *, create: bool = False) -> int:
        reply = self.call(m.CreateKind(KIND, FIELDS) if create else m.GetKind(KIND, FIELDS))
        assert isinstance(reply, m.KindAck), reply
        return reply.kind_id


def _record_until(sock: socket.socket, marker: bytes) -> list[tuple[int, bytes]]:
    """Every chunk received (with its arrival time) up to the one completing ``marker``."""
    chunks: list[tuple[int, bytes]] = []
    tail = b""
    while True:
        data = sock.recv(RECV)
        now = time.monotonic_ns()
        if not data:
            last = b"".join(c for _, c in chunks[-2:])[-300:]
            raise ConnectionError(f"the server closed the connection after {last!r}")
        chunks.append((now, data))
        if marker in tail + data[: len(marker)] or marker in data:
            return chunks
        tail = data[-len(marker) :]


def hw_subscriber(port: int, run: int, ready: Any, results: Any) -> None:
    session = CdbSession(port, read_only=True, name="sub")
    kind_id = session.kind()
    session.call(m.Subscribe(kind_id))
    if not session.conn.at_frame_boundary or session.frames:
        raise RuntimeError("notifications arrived before the run started")
    ready.put(True)
    marker = end_marker(run)
    chunks = _record_until(session.sock, marker)
    # Offline: decode with the codec and note each notification's frame index.
    decoder = FrameDecoder()
    batches, arrivals = array("q"), array("q")
    notes = 0
    for arrived, data in chunks:
        decoder.feed(data)
        for raw in decoder:
            message = m.Frame.decode(raw).message
            if not isinstance(message, m.State):
                raise RuntimeError(f"unexpected {message}")
            notes += 1
            if message.entity_id == marker:
                continue
            batches.append(_BATCH_FIELD.unpack_from(message.field_data)[0])
            arrivals.append(arrived)
    results.put({"end": chunks[-1][0], "notes": notes, "batches": batches, "arrivals": arrivals})
    session.sock.close()


def in_flight(args: Any, interval: float) -> int:
    """Frames in flight: ``--depth`` when writing flat out; when paced, enough for 250 ms
    of frames, so the pace (not the 20 ms window + fsync before each ACK) sets the rate."""
    return args.depth if not interval else max(args.depth, math.ceil(0.25 / interval))


def hw_writer(port: int, run: int, args: Any, interval: float, results: Any) -> None:
    session = CdbSession(port, name="writer", source_id=WRITER_SOURCE)
    kind_id = session.kind(create=True)
    updates = args.latency_updates if interval else args.updates
    batch = args.latency_batch if interval else args.batch
    work = plan(updates, batch, entity_ids(args.keys), run)
    frames = [
        session.conn.send(
            m.Batch(tuple(m.Assert.of(FIELDS, kind_id, eid, values) for eid, values in frame)),
            ack=True,  # acknowledged once durable: at most --depth frames in flight
        )[1]
        for frame in work
    ]
    sent = array("q")
    acked = 0
    start = time.monotonic_ns()
    for i, frame in enumerate(frames):
        if interval:
            delay = start / 1e9 + i * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        while i - acked >= in_flight(args, interval):
            acked += _hw_acks(session)
        sent.append(time.monotonic_ns())
        session.sock.sendall(frame)
    while acked < len(frames):
        acked += _hw_acks(session)
    results.put({"start": start, "durable": time.monotonic_ns(), "sent": sent, "updates": updates})
    session.sock.close()


def _hw_acks(session: CdbSession) -> int:
    data = session.sock.recv(RECV)
    if not data:
        raise ConnectionError("headwater closed the connection")
    frames = session.conn.receive_data(data)
    for frame in frames:
        if frame.message != m.Ack(Opcode.BATCH):
            raise RuntimeError(f"a BATCH was answered {frame.message}")
    return len(frames)


# ---- redis clients ----------------------------------------------------------------------


def redis_subscriber(port: int, run: int, ready: Any, results: Any) -> None:
    client = RespClient(port)
    client.sock.sendall(resp_command(b"SUBSCRIBE", CHANNEL))
    reply = client.read_reply()
    if reply[:2] != [b"subscribe", CHANNEL] or client.buf:
        raise RuntimeError(f"SUBSCRIBE answered {reply!r}")
    ready.put(True)
    marker = end_marker(run)
    chunks = _record_until(client.sock, marker)
    buf = bytearray()
    batches, arrivals = array("q"), array("q")
    notes = 0
    for arrived, data in chunks:
        buf += data
        pos = 0
        while True:
            message, after = parse_reply(buf, pos)
            if after == pos:
                break
            pos = after
            notes += 1
            payload = message[2]
            if payload[:32] == marker:
                continue
            batches.append(_BATCH_FIELD.unpack_from(payload, 32)[0])
            arrivals.append(arrived)
        del buf[:pos]
    results.put({"end": chunks[-1][0], "notes": notes, "batches": batches, "arrivals": arrivals})
    client.close()


def redis_writer(port: int, run: int, args: Any, interval: float, results: Any) -> None:
    client = RespClient(port)
    sock = client.sock
    updates = args.latency_updates if interval else args.updates
    batch = args.latency_batch if interval else args.batch
    work = plan(updates, batch, entity_ids(args.keys), run)
    frames = redis_frames(work)
    want = 2 * sum(len(frame) for frame in work)  # one integer reply line per command
    depth = in_flight(args, interval)
    sent = array("q")
    lines = 0
    start = time.monotonic_ns()
    for i, frame in enumerate(frames):
        if interval:
            delay = start / 1e9 + i * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        while i - lines // (2 * batch) >= depth:
            lines += _count_replies(sock)
        sent.append(time.monotonic_ns())
        sock.sendall(frame)
    while lines < want:
        lines += _count_replies(sock)
    results.put({"start": start, "durable": time.monotonic_ns(), "sent": sent, "updates": updates})
    client.close()


def _count_replies(sock: socket.socket) -> int:
    data = sock.recv(RECV)
    if not data:
        raise ConnectionError("redis closed the connection")
    if b"-" in data:
        raise RespError(f"a command failed: {data[:200]!r}")
    return data.count(b"\n")


# ---- one run ----------------------------------------------------------------------------


def one_run(side: str, port: int, pid: int, run: int, args: Any, interval: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    ready, results, written = ctx.Queue(), ctx.Queue(), ctx.Queue()
    subscriber, writer = (
        (hw_subscriber, hw_writer) if side == "headwater" else (redis_subscriber, redis_writer)
    )
    subs = [
        ctx.Process(target=subscriber, args=(port, run, ready, results))
        for _ in range(args.subscribers)
    ]
    w = ctx.Process(target=writer, args=(port, run, args, interval, written))
    try:
        for p in subs:
            p.start()
        for _ in subs:
            _get(ready, subs)
        cpu_before = proc_cpu(pid)
        w.start()
        wrote = _get(written, [w])
        got = [_get(results, subs) for _ in subs]
        cpu = proc_cpu(pid) - cpu_before
    finally:
        for p in [w, *subs]:
            if p.pid is not None:
                p.join(timeout=5)  # each sent its result first: they end on their own
                if p.exitcode is None:
                    p.kill()
                    p.join()
    sent = wrote["sent"]
    latencies: list[float] = []
    for r in got:
        latencies += [(t - sent[b]) / 1e6 for b, t in zip(r["batches"], r["arrivals"], strict=True)]
    start, updates = wrote["start"], wrote["updates"]
    # With --subscribers 0 (the server's write path alone) delivery is the last ACK.
    delivered = max((r["end"] for r in got), default=wrote["durable"])
    return {
        "updates": updates,
        "durable_s": (wrote["durable"] - start) / 1e9,
        "delivered_s": (delivered - start) / 1e9,
        "durable_rate": updates / ((wrote["durable"] - start) / 1e9),
        "delivered_rate": updates / ((delivered - start) / 1e9),
        "notifications_per_subscriber": statistics.mean(r["notes"] for r in got) if got else 0,
        "latency_p50_ms": pct(latencies, 50),
        "latency_p99_ms": pct(latencies, 99),
        "latency_max_ms": max(latencies) if latencies else float("nan"),
        "server_cpu_s": cpu,
    }


def _get(queue: Any, processes: list[Any]) -> Any:
    """The next item of ``queue``; raises once one of ``processes`` failed instead."""
    while True:
        try:
            return queue.get(timeout=1)
        except Empty:
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed:
                code = failed[0].exitcode
                raise RuntimeError(f"a client process failed (exit code {code})") from None


def median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[len(ordered) // 2]


# ---- report -----------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    lines = [
        f"Machine: {env['cpu']}, {env['cores']} cores; load average before/after "
        f"{env['loadavg_before']} / {env['loadavg_after']}; headwater {env['git']}, "
        f"redis {env['redis_version']}; fdatasync p50 {env['fsync']['4k_p50_ms']:.2f} ms. "
        f"{cfg['subscribers']} subscribers, {cfg['keys']:,} entities, median of "
        f"{cfg['repeat']} runs.",
        "",
        f"Throughput: {cfg['updates']:,} updates, {cfg['batch']:,} per BATCH / pipeline, "
        f"{cfg['depth']} in flight.",
        "",
        "| side | durable (acked) updates/s | delivered to all subscribers, updates/s | "
        "notifications per subscriber | latency p50 ms | p99 ms | server CPU s |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for side, label in (
        ("headwater", "headwater (ConvergeDB BATCH, fsync before ACK)"),
        ("redis", "Redis (HSET + PUBLISH pipelined, appendfsync everysec)"),
    ):
        if side not in results["throughput"]:
            continue
        r = results["throughput"][side]
        lines.append(
            f"| {label} | {r['durable_rate']:,.0f} | {r['delivered_rate']:,.0f} | "
            f"{r['notifications_per_subscriber']:,.0f} | {r['latency_p50_ms']:.1f} | "
            f"{r['latency_p99_ms']:.1f} | {r['server_cpu_s']:.2f} |"
        )
    t = results["throughput"]
    if "ratio_delivered" in t:
        lines += [
            "",
            f"headwater / Redis, delivered: **{t['ratio_delivered']:.2f}**; durable: "
            f"**{t['ratio_durable']:.2f}**.",
        ]
    lines += [
        "",
        f"Latency at a paced {cfg['latency_rate']:,} updates/s ({cfg['latency_batch']} per "
        f"frame every {cfg['latency_interval_ms']} ms, {cfg['latency_updates']:,} updates):",
        "",
        "| side | latency p50 ms | p99 ms | max ms |",
        "|---|--:|--:|--:|",
    ]
    for side in ("headwater", "redis"):
        if side not in results["latency"]:
            continue
        r = results["latency"][side]
        lines.append(
            f"| {side} | {r['latency_p50_ms']:.1f} | {r['latency_p99_ms']:.1f} | "
            f"{r['latency_max_ms']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--updates", type=int, default=300_000, help="updates per throughput run")
    p.add_argument("--keys", type=int, default=100_000, help="distinct entities")
    p.add_argument("--batch", type=int, default=1000, help="updates per BATCH / pipeline")
    p.add_argument("--depth", type=int, default=16, help="BATCHes / pipelines in flight")
    p.add_argument("--subscribers", type=int, default=10, help="subscriber processes")
    p.add_argument("--repeat", type=int, default=3, help="throughput runs per side")
    p.add_argument("--latency-rate", type=int, default=20_000, help="paced updates/s")
    p.add_argument("--latency-seconds", type=float, default=3.0, help="paced run length")
    p.add_argument("--latency-interval-ms", type=float, default=5.0, help="between frames")
    p.add_argument("--redis", default=shutil.which("redis-server") or "redis-server")
    p.add_argument("--only", choices=("headwater", "redis"), help="run one side (profiling)")
    p.add_argument(
        "--py-spy", type=Path, help="py-spy the headwater server (collapsed stacks to this file)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.updates, args.keys, args.repeat, args.latency_seconds = 20_000, 5_000, 1, 0.5
    args.latency_batch = max(1, round(args.latency_rate * args.latency_interval_ms / 1000))
    frames = max(1, round(args.latency_seconds * 1000 / args.latency_interval_ms))
    args.latency_updates = frames * args.latency_batch
    root = default_root("headwater-kinds-bench-")
    hw, redis = HeadwaterServer(), RedisServer(args.redis, appendfsync="everysec")
    results: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": {
            "cpu": cpu_model(),
            "cores": mp.cpu_count(),
            "git": git_revision(),
            "loadavg_before": loadavg(),
            "fsync": fsync_latency(root, 100),
        },
    }
    spy: subprocess.Popen[bytes] | None = None
    try:
        hw.start(root, listeners=("convergedb",))
        CdbSession(hw.ports["convergedb"], name="setup").kind(create=True)
        redis.start(root, aof_rewrite=False)
        results["environment"]["redis_version"] = redis.version
        if args.py_spy:
            spy = subprocess.Popen(
                [
                    *(
                        str(Path(sys.executable).with_name("py-spy")),
                        "record",
                        "-p",
                        str(hw.pid),
                        "-o",
                        str(args.py_spy),
                    ),
                    *("--format", "raw", "--nonblocking", "--rate", "200"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ports = {"headwater": hw.ports["convergedb"], "redis": redis.port}
        pids = {"headwater": hw.pid, "redis": redis.pid}
        run = 0
        phases: list[tuple[str, int, float]] = [("throughput", args.repeat, 0.0)]
        phases.append(("latency", 1, args.latency_interval_ms / 1000))
        for phase, repeat, interval in phases:
            runs: dict[str, list[dict[str, Any]]] = {"headwater": [], "redis": []}
            for i in range(repeat):
                order = ("headwater", "redis") if i % 2 == 0 else ("redis", "headwater")
                for side in [s for s in order if args.only in (None, s)]:
                    settle([hw.pid, redis.pid], 10)
                    run += 1
                    r = one_run(side, ports[side], pids[side], run, args, interval)
                    runs[side].append(r)
                    log(
                        f"{phase} {side:9s}: durable {r['durable_rate']:,.0f}/s, delivered "
                        f"{r['delivered_rate']:,.0f}/s, p50 {r['latency_p50_ms']:.1f} ms, "
                        f"p99 {r['latency_p99_ms']:.1f} ms"
                    )
            out = {
                side: median_run(runs[side], "delivered_rate") | {"runs": runs[side]}
                for side in runs
                if runs[side]
            }
            if phase == "throughput" and len(out) == 2:
                out["ratio_delivered"] = (
                    out["headwater"]["delivered_rate"] / out["redis"]["delivered_rate"]
                )
                out["ratio_durable"] = (
                    out["headwater"]["durable_rate"] / out["redis"]["durable_rate"]
                )
            results[phase] = out
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        hw.stop()
        redis.stop()
        results["environment"]["loadavg_after"] = loadavg()
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
