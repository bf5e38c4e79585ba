#!/usr/bin/env python3
"""Ripple deltas into one kind from one worker, against the same updates sent as
ConvergeDB BATCH asserts, side by side against one real ``headwater serve``.

Both sides send Sets of a 5-field record (1 string, 3 floats, 1 int) over ``--keys``
entities from one connection with equally raw clients (the sans-I/O codecs over a plain
socket), all encoded before timing, and stop the clock when the server confirms that
everything is durable: a Checkpoint_ack (Ripple) or the ACK of a HEARTBEAT barrier
(ConvergeDB). Ripple has one envelope per delta; ConvergeDB batches ``--batch`` asserts
per frame. Runs alternate between the two sides.

    .venv/bin/python benchmarks/ripple_bench.py
    .venv/bin/python benchmarks/run_all.py --bench ripple_bench
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from benchlib import (
    HeadwaterServer,
    HelpFormatter,
    cpu_model,
    default_root,
    git_revision,
    loadavg,
    log,
    proc_cpu,
    report,
)
from headwater.protocols.convergedb import messages as cm
from headwater.protocols.convergedb.codes import Opcode
from headwater.protocols.convergedb.connection import ClientConnection as CdbConnection
from headwater.protocols.convergedb.fields import FieldType
from headwater.protocols.ripple import messages as rm
from headwater.protocols.ripple.connection import ClientConnection as RippleConnection

SCHEMA = rm.Schema(
    "quotes",
    1,
    (
        rm.Field("symbol", rm.FieldType.STRING),
        rm.Field("bid", rm.FieldType.FLOAT),
        rm.Field("ask", rm.FieldType.FLOAT),
        rm.Field("last", rm.FieldType.FLOAT),
        rm.Field("volume", rm.FieldType.INT),
    ),
)
CDB_FIELDS = [
    ("symbol", FieldType.STRING),
    ("bid", FieldType.F64),
    ("ask", FieldType.F64),
    ("last", FieldType.F64),
    ("volume", FieldType.I64),
]


def record(n: int, keys: int) -> tuple[str, list[Any]]:
    key = f"SYM{n % keys:05d}"
    return key, [key, 100.0 + n % 97, 100.5 + n % 89, 100.25 + n % 83, n]


def _recv_until(sock: socket.socket, feed: Any, done: Any) -> None:
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        if any(done(x) for x in feed(data)):
            return


def ripple_run(port: int, worker: str, output: str, deltas: int, keys: int) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = RippleConnection(worker)
    sock.sendall(conn.handshake({output: SCHEMA}))
    _recv_until(sock, conn.receive_data, lambda r: isinstance(r.message, rm.SchemaNegotiation))
    chunks = []
    for start in range(0, deltas, 1000):
        parts = []
        for n in range(start, min(deltas, start + 1000)):
            key, values = record(n, keys)
            names = [f.field_name for f in SCHEMA.fields]
            parts.append(
                conn.send_delta(output, key, rm.Set(dict(zip(names, values, strict=True))))
            )
        chunks.append(b"".join(parts))
    barrier = conn.checkpoint_request("end", 1)
    began = time.perf_counter()
    for chunk in chunks:
        sock.sendall(chunk)
    sock.sendall(barrier)
    _recv_until(sock, conn.receive_data, lambda r: isinstance(r.message, rm.CheckpointAck))
    elapsed = time.perf_counter() - began
    sock.close()
    return elapsed


def cdb_run(port: int, kind_name: str, updates: int, keys: int, batch: int) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = CdbConnection()

    def answered(stream: int) -> Any:
        return lambda frame: frame.stream_id == stream

    stream, data = conn.connect("bench")
    sock.sendall(data)
    _recv_until(sock, conn.receive_data, answered(stream))
    stream, data = conn.send(cm.CreateKind(kind_name, CDB_FIELDS), ack=True)
    sock.sendall(data)
    kind_id = 0

    def kind_ack(frame: Any) -> bool:
        nonlocal kind_id
        if frame.stream_id == stream and isinstance(frame.message, cm.KindAck):
            kind_id = frame.message.kind_id
            return True
        return False

    _recv_until(sock, conn.receive_data, kind_ack)
    frames = []
    for start in range(0, updates, batch):
        ops = []
        for n in range(start, min(updates, start + batch)):
            key, values = record(n, keys)
            entity = key.encode().ljust(32, b"\0")
            ops.append(cm.Assert.of(CDB_FIELDS, kind_id, entity, values))
        frames.append(conn.send(cm.Batch(tuple(ops)))[1])
    stream, barrier = conn.send(cm.Heartbeat(), ack=True)
    began = time.perf_counter()
    for frame in frames:
        sock.sendall(frame)
    sock.sendall(barrier)
    _recv_until(
        sock,
        conn.receive_data,
        lambda f: f.stream_id == stream and f.message == cm.Ack(Opcode.HEARTBEAT),
    )
    elapsed = time.perf_counter() - began
    sock.close()
    return elapsed


def markdown(results: dict[str, Any]) -> str:
    env, cfg = results["environment"], results["config"]
    lines = [
        f"Machine: {env['cpu']}; load average before/after {env['loadavg_before']} / "
        f"{env['loadavg_after']}; headwater {env['git']}; {cfg['deltas']:,} updates of a "
        f"5-field record over {cfg['keys']:,} entities per run, median of {cfg['repeat']}.",
        "",
        "| path | updates/s | per-run updates/s | server CPU s per run |",
        "|---|--:|---|--:|",
    ]
    for name in ("ripple", "convergedb"):
        r = results[name]
        each = ", ".join(f"{x:,.0f}" for x in r["rates"])
        lines.append(f"| {r['label']} | {r['median']:,.0f} | {each} | {r['server_cpu_s']:.2f} |")
    lines += [
        "",
        f"Ripple / ConvergeDB BATCH: **{results['ratio']:.2f}**",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--deltas", type=int, default=100_000, help="updates per run")
    p.add_argument("--keys", type=int, default=10_000, help="distinct entities")
    p.add_argument("--batch", type=int, default=1000, help="asserts per ConvergeDB BATCH")
    p.add_argument("--repeat", type=int, default=3, help="runs per side")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.deltas, args.keys, args.repeat = 5_000, 500, 1
    root = default_root("headwater-ripple-bench-")
    server = HeadwaterServer()
    results: dict[str, Any] = {
        "config": vars(args) | {"out": str(args.out) if args.out else None},
        "environment": {"cpu": cpu_model(), "git": git_revision(), "loadavg_before": loadavg()},
    }
    try:
        server.start(root, listeners=("kimberlite", "convergedb", "ripple"))
        times: dict[str, list[float]] = {"ripple": [], "convergedb": []}
        cpu: dict[str, float] = {"ripple": 0.0, "convergedb": 0.0}
        for run in range(args.repeat):
            for side in ("ripple", "convergedb") if run % 2 == 0 else ("convergedb", "ripple"):
                before = proc_cpu(server.pid)
                if side == "ripple":
                    t = ripple_run(
                        server.ports["ripple"], f"w{run}", "quotes", args.deltas, args.keys
                    )
                else:
                    t = cdb_run(
                        server.ports["convergedb"], "quotes_cdb", args.deltas, args.keys, args.batch
                    )
                cpu[side] += proc_cpu(server.pid) - before
                times[side].append(t)
                log(f"{side:10s} run {run}: {args.deltas / t:,.0f} updates/s")
        for side, label in (
            ("ripple", "Ripple: one worker, one Delta (Set) envelope per update"),
            ("convergedb", f"ConvergeDB: BATCH of {args.batch} ASSERTs"),
        ):
            rates = [args.deltas / t for t in times[side]]
            results[side] = {
                "label": label,
                "rates": rates,
                "median": statistics.median(rates),
                "server_cpu_s": cpu[side] / args.repeat,
            }
        results["ratio"] = results["ripple"]["median"] / results["convergedb"]["median"]
    finally:
        server.stop()
        results["environment"]["loadavg_after"] = loadavg()
        shutil.rmtree(root, ignore_errors=True)
    report(results, markdown, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
